"""`python -m kvhandoff.bench.probes.scheduler_hooks`: what `PushScheduler`, the scheduler
half the vLLM connector hands vLLM, costs per request in each of its engine hooks (a probe:
no vLLM, no rank, one process).

Per rep, `requests` requests go through one engine step on each side, as the workers would
report them at once:

- D: `update_state_after_alloc` for each (`alloc`), `build_connector_meta` (`meta`), and
  `update_connector_output` with one rank's `finished_recving` naming all of them (`out`);
- P: `request_finished` for each (`finish`), `build_connector_meta`, and
  `update_connector_output` with the rank's `finished_sending`.

Prints one JSON line: the median over the reps of each hook's µs per request, by side.
`kvhandoff bench vllm` measures the same hooks inside vLLM's scheduler, against vLLM's own
connector; this probe isolates kvhandoff's share for A/B runs between trees.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from kvhandoff.machines.push.meta import PushWorkerOutput
from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler
from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg


def _timed_steps(
    sched: PushScheduler,
    first: str,
    begin: Callable[[list[str], list[Any], float], None],
    prepare: Callable[[list[str]], list[Any]],
    report: Callable[[int, tuple[str, ...]], PushWorkerOutput],
    requests: int,
    reps: int,
) -> dict[str, float]:
    """Per rep: `begin` the requests (timed as `first`) with what `prepare` built for them
    untimed, one `build_connector_meta`, and one rank's report ending all of them; the
    median µs per request of each phase."""
    phases: dict[str, list[float]] = {first: [], "meta": [], "out": []}
    now = 1.0
    for rep in range(reps):
        ids = [f"cmpl-{rep}-{q}-0" for q in range(requests)]
        prepared = prepare(ids)
        t0 = time.perf_counter()
        begin(ids, prepared, now)
        t1 = time.perf_counter()
        meta = sched.build_connector_meta(now)
        t2 = time.perf_counter()
        out = sched.update_connector_output([report(meta.step, tuple(ids))], now)
        t3 = time.perf_counter()
        ended = len(out.finished_recving) + len(out.finished_sending)
        if ended != requests:
            raise RuntimeError(f"{ended} of {requests} requests ended")
        for name, spent in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            phases[name].append(spent * 1e6 / requests)
        now += 0.001
    return {name: round(statistics.median(v), 3) for name, v in phases.items()}


def _decode(requests: int, reps: int) -> dict[str, float]:
    sched = PushScheduler("decode", LocalEngine("probe-decode", "127.0.0.1", 5700))
    prefill = PrefillCoordinates("probe-prefill", "127.0.0.1", 5600, 1)

    def legs(ids: list[str]) -> list[Any]:
        return [decode_leg({"request_id": i}, prefill)["kv_transfer_params"] for i in ids]

    def begin(ids: list[str], legs: list[Any], now: float) -> None:
        for request_id, leg in zip(ids, legs, strict=True):
            sched.update_state_after_alloc(request_id, [1, 2], leg, now)

    def report(step: int, ids: tuple[str, ...]) -> PushWorkerOutput:
        return PushWorkerOutput(rank=0, step=step, finished_recving=ids)

    return _timed_steps(sched, "alloc", begin, legs, report, requests, reps)


def _prefill(requests: int, reps: int) -> dict[str, float]:
    sched = PushScheduler("prefill", LocalEngine("probe-prefill", "127.0.0.1", 5600))

    def params(ids: list[str]) -> list[Any]:
        return [{"do_remote_decode": True} for _ in ids]

    def begin(ids: list[str], params: list[Any], now: float) -> None:
        for request_id, leg in zip(ids, params, strict=True):
            sched.request_finished(request_id, [1, 2], leg, now)

    def report(step: int, ids: tuple[str, ...]) -> PushWorkerOutput:
        return PushWorkerOutput(rank=0, step=step, finished_sending=ids)

    return _timed_steps(sched, "finish", begin, params, report, requests, reps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50, help="requests per engine step")
    parser.add_argument("--reps", type=int, default=400)
    args = parser.parse_args()
    result = {
        "decode": _decode(args.requests, args.reps),
        "prefill": _prefill(args.requests, args.reps),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
