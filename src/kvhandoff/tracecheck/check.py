"""`kvhandoff check-trace`: replay traces against the declarations and the P/D rules.

Per stream (one traced bus), in the order its lines were written, every lifecycle is
replayed: a creation must be in the declared initial state; a transition must be a
declared edge (source, trigger, destination) and leave the state the previous line of
the same instance left it in; nothing may happen to an instance after it ended, and no
live instance may be created again. An instance first seen mid-life is an error when
its writer's trace is complete (part 0 read, no line missing), and is adopted otherwise
(its earlier parts were rotated away). At the end of each stream, an instance still in a
state whose timeout (as the stream's machines were compiled, heartbeat extensions
included) passed before the stream's last line is reported as stuck. Then the rules of
`relations.py` compare the processes. Every finding quotes the lines that prove it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.tracecheck.read import Record, Ref, Stream, TraceSet
from kvhandoff.tracecheck.relations import RULES, Once, Requires, Rule, correlate, inactive
from kvhandoff.tracecheck.relations import matches as step_matches

EPSILON = 1e-6
MAX_REFS = 6


@dataclass(frozen=True, slots=True)
class Finding:
    what: str
    message: str
    refs: tuple[Ref, ...]

    def render(self) -> str:
        lines = [f"FINDING [{self.what}] {self.message}"]
        lines += [f"    {ref.quote()}" for ref in self.refs[:MAX_REFS]]
        if len(self.refs) > MAX_REFS:
            lines.append(f"    ... and {len(self.refs) - MAX_REFS} more lines")
        return "\n".join(lines)


@dataclass(slots=True)
class Report:
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    instances: int = 0
    transitions: int = 0
    rules_checked: int = 0

    def add(self, what: str, message: str, refs: Iterable[Ref]) -> None:
        self.findings.append(Finding(what, message, tuple(refs)))


@dataclass(slots=True)
class _Live:
    state: str
    deadline: float | None
    last: Ref
    ended: bool = False


def check(
    trace: TraceSet, declarations: Sequence[Declaration[Any]], rules: Sequence[Rule] = RULES
) -> Report:
    decls = {decl.name: decl for decl in declarations}
    report = Report()
    for what, refs in trace.problems:
        report.add("integrity", what, refs)
    for stream in trace.streams.values():
        _replay(report, trace, stream, decls)
    _relations(report, trace, decls, rules)
    return report


# -- one stream ----------------------------------------------------------------------------


def _replay(
    report: Report, trace: TraceSet, stream: Stream, decls: Mapping[str, Declaration[Any]]
) -> None:
    complete = trace.writers[stream.writer].complete and not any(
        what.startswith("lines ") for what, _ in trace.problems
    )
    live: dict[tuple[str, str, str], _Live] = {}
    unknown: set[str] = set()
    where = f"{stream.proc}/{stream.bus}"
    for record in stream.records:
        decl = decls.get(record.kind)
        if decl is None:
            if record.kind not in unknown:
                unknown.add(record.kind)
                report.add(
                    "undeclared", f"{where}: no declared machine {record.kind!r}", [record.ref]
                )
            continue
        name = f"{record.kind} {record.key!r} on {where}"
        ident = record.instance()
        inst = live.get(ident)
        if record.type in ("create", "live"):
            report.instances += 1
            state = str(record.data.get("state"))
            if inst is not None and not inst.ended:
                report.add("sequence", f"{name} created again while live", [inst.last, record.ref])
            if record.type == "live" and state not in decl.state_names:
                report.add("undeclared", f"{name} found live in undeclared {state!r}", [record.ref])
            elif record.type == "create" and state != decl.initial_state:
                report.add(
                    "undeclared",
                    f"{name} created in {state!r}; the declared initial state is "
                    f"{decl.initial_state!r}",
                    [record.ref],
                )
            armed = _arm(stream, decl, state, record.t) if record.type == "create" else None
            live[ident] = _Live(state, armed, record.ref)
            continue
        report.transitions += 1
        source, dest, event = str(record.data.get("from")), str(record.data.get("to")), record.event
        if inst is None:
            report.instances += 1
            if complete:
                report.add(
                    "sequence", f"{name}: {event!r} for an instance never created", [record.ref]
                )
            inst = live[ident] = _Live(source, None, record.ref)
        elif inst.ended:
            report.add(
                "sequence",
                f"{name}: {event!r} after the instance ended in {inst.state!r}",
                [inst.last, record.ref],
            )
            continue
        elif inst.state != source:
            report.add(
                "sequence",
                f"{name}: the line says {event!r} from {source!r}, but the instance was in "
                f"{inst.state!r} (a line lost, or lines swapped)",
                [inst.last, record.ref],
            )
        if (source, event, dest) not in decl.edges():
            report.add(
                "undeclared",
                f"{name}: {source} --{event}--> {dest} is not a declared transition",
                [record.ref],
            )
        inst.deadline = _next_deadline(stream, decl, inst.deadline, record)
        inst.state, inst.last = dest, record.ref
        inst.ended = dest in decl.final_states
    _stuck(report, stream, live, where)


def _timeout_of(stream: Stream, decl: Declaration[Any], state: str) -> float | None:
    compiled = stream.timeouts.get(decl.name)
    if compiled is not None:
        return compiled.get(state)
    if state not in decl.state_names:
        return None
    timeout = decl.state(state).timeout
    return None if timeout is None else decl.timeout_seconds(timeout, {})


def _arm(stream: Stream, decl: Declaration[Any], state: str, now: float) -> float | None:
    seconds = _timeout_of(stream, decl, state)
    return None if seconds is None else now + seconds


def _next_deadline(
    stream: Stream, decl: Declaration[Any], deadline: float | None, record: Record
) -> float | None:
    """The armed deadline after `record`, as the bus keeps it (see `compiled.Route`)."""
    source, dest, event, now = (
        str(record.data.get("from")),
        str(record.data.get("to")),
        record.event,
        record.t,
    )
    known = set(decl.state_names)
    if source not in known or dest not in known:
        return None
    internal = source == dest and any(
        t.internal and t.source == source and t.trigger == event for t in decl.transition_decls
    )
    before, after = decl.state(source).timeout, decl.state(dest).timeout
    if not internal and not (before is not None and before == after):
        deadline = _arm(stream, decl, dest, now)
    for effect in record.data.get("effects") or ():
        extends = isinstance(effect, dict) and effect.get("effect") == "ExtendDeadline"
        if extends and deadline is not None:
            deadline = max(deadline, now + float(effect.get("seconds", 0.0)))
    return deadline


def _stuck(
    report: Report, stream: Stream, live: Mapping[tuple[str, str, str], _Live], where: str
) -> None:
    if not stream.records:
        return
    end = max(r.t for r in stream.records)
    for (_, kind, key), inst in sorted(live.items()):
        if inst.ended or inst.deadline is None or inst.deadline + EPSILON >= end:
            continue
        report.add(
            "stuck",
            f"{kind} {key} on {where} left in {inst.state!r} past its timeout: due at "
            f"t={inst.deadline:.6f}, the stream ran until t={end:.6f}",
            [inst.last],
        )


# -- across processes ------------------------------------------------------------------------


def _relations(
    report: Report,
    trace: TraceSet,
    decls: Mapping[str, Declaration[Any]],
    rules: Sequence[Rule],
) -> None:
    runs: dict[str, list[Record]] = defaultdict(list)
    for record in trace.records:
        runs[record.run].append(record)
    for rule in rules:
        why = inactive(rule, decls)
        if why is not None:
            report.notes.append(f"rule {rule.name!r} skipped: {why}")
            continue
        checked = False
        for run, records in sorted(runs.items()):
            traced = {r.kind for r in records}
            if isinstance(rule, Requires):
                if rule.effect.kind not in traced:
                    continue
                if rule.cause.kind not in traced:
                    report.notes.append(
                        f"rule {rule.name!r} skipped in run {run!r}: no trace holds "
                        f"{rule.cause.kind} (the other side was not given)"
                    )
                    continue
                checked = True
                _requires(report, records, decls, rule)
            elif rule.kind in traced:
                checked = True
                _once(report, records, decls[rule.kind], rule)
        report.rules_checked += checked


def _requires(
    report: Report,
    records: Sequence[Record],
    decls: Mapping[str, Declaration[Any]],
    rule: Requires,
) -> None:
    cause_decl, effect_decl = decls[rule.cause.kind], decls[rule.effect.kind]
    causes = {
        correlate(rule.cause.corr, r.data)
        for r in records
        if step_matches(rule.cause, r.data, cause_decl)
    }
    orphans: dict[str, list[Ref]] = defaultdict(list)
    for record in records:
        if step_matches(rule.effect, record.data, effect_decl):
            corr = correlate(rule.effect.corr, record.data)
            if corr is not None and corr not in causes:
                orphans[corr].append(record.ref)
    for corr, refs in sorted(orphans.items()):
        report.add(
            "disagree",
            f"{rule.name}: {rule.effect.describe()} for {corr!r}, but no "
            f"{rule.cause.describe()} for it in any trace",
            refs,
        )


def _once(report: Report, records: Sequence[Record], decl: Declaration[Any], rule: Once) -> None:
    ends: dict[str, list[Ref]] = defaultdict(list)
    finals = decl.final_states
    for record in records:
        ended = record.type == "transition" and record.data.get("to") in finals
        if record.kind == rule.kind and ended:
            corr = correlate(rule.corr, record.data)
            if corr is not None:
                ends[corr].append(record.ref)
    for corr, refs in sorted(ends.items()):
        if len(refs) > 1:
            report.add(
                "disagree", f"{rule.name}: {rule.kind} {corr!r} ended {len(refs)} times", refs
            )
