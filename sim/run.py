"""`kvhandoff simulate [push|ec|all] --seeds N`: seeded fault schedules over in-memory planes.

Every run is one seed: a simulated world (push: P and D over the in-memory fabric,
`SimulatedPushWorld`; ec: a producer and a consumer over the in-memory encoder-cache
planes, `SimulatedECWorld`), with one seeded scheduler owning every ordering decision,
serves `--requests` client requests under the selected faults, then settles past every
deadline with faults off, probes recovery, and checks its invariants. A seed replays
exactly; a failing seed prints the command that replays it and a minimal event log of
what happened to the requests involved.

Protocols plug in through `PROTOCOLS` (a runner, an explainer and its broken variants
per name); `all` runs every registered one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvhandoff.sim.result import SimRunResult

if TYPE_CHECKING:
    from kvhandoff.sim.ec.world import SimulatedECWorld
    from kvhandoff.sim.push.world import SimulatedPushWorld

EVENT_LOG_LINES = 40


@dataclass(frozen=True, slots=True)
class SimulateOptions:
    requests: int = 16
    faults: tuple[str, ...] = ("all",)
    variant: str | None = None  # a deliberately broken variant (self-check)


@dataclass(frozen=True, slots=True)
class Protocol:
    name: str
    run: Callable[[int, SimulateOptions], SimRunResult]
    explain: Callable[[int, SimulateOptions], list[str]]
    variants: Callable[[], Sequence[str]]


# -- push ---------------------------------------------------------------------------------


def _push_world(
    seed: int, options: SimulateOptions, *, record: bool, pull: bool = False
) -> SimulatedPushWorld:
    from kvhandoff.sim.faults import SimFaults
    from kvhandoff.sim.push.settings import SimSettings
    from kvhandoff.sim.push.variants import PULL_VARIANTS, VARIANTS
    from kvhandoff.sim.push.world import SimulatedPullWorld, SimulatedPushWorld

    faults = SimFaults.select(options.faults)
    variants = PULL_VARIANTS if pull else VARIANTS
    variant = variants[options.variant] if options.variant else None
    settings = SimSettings(requests=options.requests)
    log_limit = None if record else 0
    world = SimulatedPullWorld if pull else SimulatedPushWorld
    return world(
        seed, faults=faults, settings=settings, variant=variant, record=record, log_limit=log_limit
    )


def run_push_seed(seed: int, options: SimulateOptions) -> SimRunResult:
    return _push_world(seed, options, record=False).run()


def explain_push_seed(seed: int, options: SimulateOptions) -> list[str]:
    """Re-run `seed` recording every transition; keep what concerns the failing requests."""
    world = _push_world(seed, options, record=True)
    result = world.run()
    return minimal_log(list(world.log), result.violations)


def run_pull_seed(seed: int, options: SimulateOptions) -> SimRunResult:
    """Pull mode on the same world (B-09), with pull's own planted variants."""
    return _push_world(seed, options, record=False, pull=True).run()


def explain_pull_seed(seed: int, options: SimulateOptions) -> list[str]:
    world = _push_world(seed, options, record=True, pull=True)
    result = world.run()
    return minimal_log(list(world.log), result.violations)


def _push_variants() -> list[str]:
    from kvhandoff.sim.push.variants import VARIANTS

    return sorted(VARIANTS)


def _pull_variants() -> list[str]:
    from kvhandoff.sim.push.variants import PULL_VARIANTS

    return sorted(PULL_VARIANTS)


# -- encoder cache --------------------------------------------------------------------------


def _ec_world(seed: int, options: SimulateOptions, *, record: bool) -> SimulatedECWorld:
    from kvhandoff.sim.ec.settings import ECSimSettings
    from kvhandoff.sim.ec.variants import EC_VARIANTS
    from kvhandoff.sim.ec.world import SimulatedECWorld
    from kvhandoff.sim.faults import SimFaults

    return SimulatedECWorld(
        seed,
        faults=SimFaults.select(options.faults),
        settings=ECSimSettings(requests=options.requests),
        variant=EC_VARIANTS[options.variant] if options.variant else None,
        record=record,
        log_limit=None if record else 0,
    )


def run_ec_seed(seed: int, options: SimulateOptions) -> SimRunResult:
    return _ec_world(seed, options, record=False).run()


def explain_ec_seed(seed: int, options: SimulateOptions) -> list[str]:
    """Re-run `seed` recording every transition; keep what concerns the failing requests
    (their client ids and the encodings they asked for) and every injected fault."""
    world = _ec_world(seed, options, record=True)
    result = world.run()
    terms = world.terms_of(result.violations)
    return minimal_log(list(world.log), result.violations, extra_terms=terms)


def _ec_variants() -> list[str]:
    from kvhandoff.sim.ec.variants import EC_VARIANTS

    return sorted(EC_VARIANTS)


PROTOCOLS: dict[str, Protocol] = {
    "push": Protocol("push", run_push_seed, explain_push_seed, _push_variants),
    "ec": Protocol("ec", run_ec_seed, explain_ec_seed, _ec_variants),
    "pull": Protocol("pull", run_pull_seed, explain_pull_seed, _pull_variants),
}


# -- the event log of a failure --------------------------------------------------------------

_CLIENT = re.compile(r"cmpl-\d+-\d+")
_FAULTS = ("CRASH", "RESTART", "PARTITION", "HEAL", "CLOCK JUMP", "EVICTION PRESSURE")


def minimal_log(
    lines: Sequence[str], violations: Sequence[str], *, extra_terms: Iterable[str] = ()
) -> list[str]:
    """The lines about the clients the first violations name, or any of `extra_terms`
    (and every injected fault)."""
    clients = {m.group(0) for v in violations[:3] for m in _CLIENT.finditer(v)}
    clients.update(extra_terms)
    picked = []
    for line in lines:
        text = _compact(line)
        if any(c in text for c in clients) or any(f in text for f in _FAULTS):
            picked.append(text)
    return picked[-EVENT_LOG_LINES:] if picked else [_compact(x) for x in lines[-10:]]


def _compact(line: str) -> str:
    source, _, rest = line.partition(" ")
    if not rest.startswith("{"):
        return line
    record = json.loads(rest)
    effects = ", ".join(e.split("(")[0] for e in record["effects"])
    return (
        f"t={record['t']:.4f} {source} {record['kind']} {record['key']} "
        f"{record['event']}: {record['from']} -> {record['to']}"
        + (f" [{effects}]" if effects else "")
    )


# -- many seeds --------------------------------------------------------------------------------


@dataclass(slots=True)
class SimulateReport:
    runs: int = 0
    requests: int = 0
    completed: int = 0
    failed_cleanly: int = 0
    leaked: int = 0
    hung: int = 0
    violations: int = 0
    seconds: float = 0.0
    failures: list[SimRunResult] = field(default_factory=list)

    def add(self, result: SimRunResult) -> None:
        self.runs += 1
        self.requests += result.requests
        self.completed += result.completed
        self.failed_cleanly += result.failed_cleanly
        self.leaked += result.leaked
        self.hung += result.hung
        self.violations += len(result.violations)
        if not result.ok:
            self.failures.append(result)

    @property
    def ok(self) -> bool:
        return not (self.leaked or self.hung or self.violations)

    @property
    def requests_per_s(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> dict[str, int]:
        return {
            "runs": self.runs,
            "requests": self.requests,
            "completed": self.completed,
            "failed_cleanly": self.failed_cleanly,
            "leaked": self.leaked,
            "hung": self.hung,
            "violations": self.violations,
        }


@contextlib.contextmanager
def quiet_framework_logs() -> Iterator[None]:
    """Fault schedules make the framework warn a lot; the verdict is in the report."""
    logger = logging.getLogger("kvhandoff")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _run_task(task: tuple[str, int, SimulateOptions]) -> SimRunResult:
    name, seed, options = task
    return PROTOCOLS[name].run(seed, options)


def simulate(
    protocols: Sequence[str],
    seeds: int,
    *,
    first_seed: int = 0,
    options: SimulateOptions | None = None,
    jobs: int = 1,
    on_result: Callable[[SimRunResult], None] | None = None,
) -> SimulateReport:
    """Run `seeds` seeds of each protocol; `jobs` > 1 spreads seeds over processes."""
    options = options or SimulateOptions()
    tasks = [(name, first_seed + i, options) for name in protocols for i in range(seeds)]
    report = SimulateReport()
    started = time.perf_counter()
    with quiet_framework_logs():
        if jobs <= 1 or len(tasks) < 2 * jobs:
            results: Iterator[SimRunResult] = map(_run_task, tasks)
            for result in results:
                report.add(result)
                if on_result is not None:
                    on_result(result)
        else:
            context = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(jobs, mp_context=context) as pool:
                chunk = max(1, min(50, len(tasks) // (8 * jobs)))
                for result in pool.map(_run_task, tasks, chunksize=chunk):
                    report.add(result)
                    if on_result is not None:
                        on_result(result)
    report.seconds = time.perf_counter() - started
    return report


def replay_command(result: SimRunResult, options: SimulateOptions) -> str:
    parts = [
        "kvhandoff simulate",
        result.protocol,
        "--seeds 1",
        f"--first-seed {result.seed}",
        f"--requests {options.requests}",
        f"--faults {','.join(options.faults)}",
    ]
    if options.variant:
        parts.append(f"--variant {options.variant}")
    return " ".join(parts)


# -- the command ---------------------------------------------------------------------------------


def main_from_args(args: Any) -> int:
    names = list(PROTOCOLS) if args.what == "all" else [args.what]
    options = SimulateOptions(
        requests=args.requests,
        faults=tuple(f for f in args.faults.split(",") if f) or ("none",),
        variant=args.variant,
    )
    problem = _check_options(options, names)
    if problem:
        print(f"kvhandoff simulate: {problem}", file=sys.stderr)
        return 2
    jobs = args.jobs if args.jobs > 0 else (os.cpu_count() or 1)
    total = args.seeds * len(names)
    done = 0
    step = max(1, total // 10)

    def progress(_result: SimRunResult) -> None:
        nonlocal done
        done += 1
        if total >= 100 and done % step == 0:
            print(f"simulate: {done}/{total} runs", file=sys.stderr, flush=True)

    report = simulate(
        names,
        args.seeds,
        first_seed=args.first_seed,
        options=options,
        jobs=jobs,
        on_result=progress,
    )
    _print_failures(report, options, out=sys.stderr if args.json else sys.stdout)
    throughput = (
        f"throughput: {report.requests} simulated requests in {report.seconds:.1f} s = "
        f"{report.requests_per_s:.0f} requests/s ({report.runs} runs, {jobs} jobs)"
    )
    if args.json:
        print(throughput, file=sys.stderr)
        print(json.dumps(report.summary()))
    else:
        s = report.summary()
        print(
            f"{'+'.join(names)}: {s['runs']} runs, {s['requests']} requests: "
            f"{s['completed']} completed, {s['failed_cleanly']} failed cleanly, "
            f"{s['leaked']} leaked, {s['hung']} hung, {s['violations']} violations"
        )
        print(throughput)
        print("simulate ok" if report.ok else "simulate FAILED")
    return 0 if report.ok else 1


def _check_options(options: SimulateOptions, names: Sequence[str]) -> str | None:
    from kvhandoff.protocol.errors import LocalProtocolError
    from kvhandoff.sim.faults import SimFaults

    try:
        SimFaults.select(options.faults)
    except LocalProtocolError as exc:
        return str(exc)
    if options.variant is not None:
        for name in names:
            known = PROTOCOLS[name].variants()
            if options.variant not in known:
                return f"unknown {name} variant {options.variant!r}; known: {', '.join(known)}"
    if options.requests < 1:
        return "--requests must be at least 1"
    return None


def _print_failures(report: SimulateReport, options: SimulateOptions, *, out: Any) -> None:
    for result in report.failures[:3]:
        print(f"FAILED {result.protocol} seed {result.seed}:", file=out)
        for violation in result.violations[:8]:
            print(f"  {violation}", file=out)
        print(f"  replay: {replay_command(result, options)}", file=out)
        with quiet_framework_logs():
            lines = PROTOCOLS[result.protocol].explain(result.seed, options)
        print("  event log (the requests involved, and every injected fault):", file=out)
        for line in lines:
            print(f"    {line}", file=out)
    if len(report.failures) > 3:
        print(f"... and {len(report.failures) - 3} more failing seeds", file=out)
