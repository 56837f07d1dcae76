"""`kvhandoff diagrams --journey FILE... --request ID`: one request across the processes.

A mermaid sequence diagram built from transition traces: one participant per traced bus
(P's and D's scheduler/worker bus and writer bus, or the producer's and the consumer's
scheduler and worker), each transition of the request's lifecycles as a message on its
bus in merged time order, and an arrow between processes wherever a rule of
`relations.py` ties a step on one side to its cause on the other (P's WRITE post and D's
completion, the consumer's XferReq and the producer's grant...).

A record belongs to the request when its key (or a key element, or an id in its fields)
is the request id, with the engines' random suffixes ignored; then once more for the
ids those records name (`mm_hash`, `transfer_id`), so an encoder-cache request brings its
reads and grants along.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import Any

from kvhandoff.machines.catalog import DECLARATIONS
from kvhandoff.protocol.request_ids import get_base_request_id
from kvhandoff.tracecheck.read import Record, Stream, TraceSet, load
from kvhandoff.tracecheck.relations import RULES, Requires, correlate, inactive, matches

_LINKS = ("mm_hash", "transfer_id")
_ROLE_ORDER = ("prefill", "producer", "decode", "consumer")
_BUS_NAMES = {"main": "scheduler+worker"}


def journey_command(files: Sequence[str], request: str | None) -> int:
    if not request:
        print("--journey needs --request ID", file=sys.stderr)
        return 2
    trace = load(files)
    text = journey(trace, request)
    if text is None:
        print(f"no transition of request {request!r} in {len(files)} files", file=sys.stderr)
        return 1
    print(text, end="")
    return 0


def journey(trace: TraceSet, request: str) -> str | None:
    """The `sequenceDiagram` text of `request`, or None when no record names it."""
    wanted = {request, get_base_request_id(request)}
    chosen = [r for r in trace.records if _names(r, wanted)]
    if not chosen:
        return None
    linked = {v for r in chosen for v in _linked(r.data)} - wanted
    if linked:
        chosen = [
            r for r in trace.records if _names(r, wanted) or _names(r, linked, keys_only=True)
        ]
    streams = _participants(trace, chosen)
    alias = {s.id: f"s{i}" for i, s in enumerate(streams)}
    lines = ["sequenceDiagram", f"  title {request}"]
    for stream in streams:
        bus = _BUS_NAMES.get(stream.bus, stream.bus)
        lines.append(f"  participant {alias[stream.id]} as {stream.proc} {bus}")
    causes = _causes(chosen)
    start = chosen[0].tm
    for record in chosen:
        me = alias[record.stream]
        for cause, label in causes.get(id(record), ()):
            lines.append(f"  {alias[cause.stream]}-){me}: {label}")
        kind = record.kind.split(".")[-1]
        at = f"+{(record.tm - start) * 1000:.1f} ms"
        if record.type == "create":
            state = record.data.get("state")
            lines.append(f"  Note over {me}: {kind} {_short(record.key)} created in {state} {at}")
        else:
            move = f"{record.data.get('from')} → {record.data.get('to')}"
            lines.append(f"  {me}->>{me}: {kind} {record.event}: {move} {at}")
    return "\n".join(lines) + "\n"


def _atoms(value: Any, keys_only: bool = False) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _atoms(item)
    elif isinstance(value, dict) and not keys_only:
        for item in value.values():
            yield from _atoms(item)


def _names(record: Record, ids: set[str], keys_only: bool = False) -> bool:
    atoms = list(_atoms(record.key))
    if not keys_only:
        atoms += _atoms(record.data.get("fields"))
    return any(a in ids or get_base_request_id(a) in ids for a in atoms)


def _linked(data: dict[str, Any]) -> Iterable[str]:
    def walk(value: Any) -> Iterable[str]:
        if isinstance(value, dict):
            for k, v in value.items():
                if k in _LINKS and isinstance(v, str):
                    yield v
                else:
                    yield from walk(v)
        elif isinstance(value, list):
            for item in value:
                yield from walk(item)

    yield from walk(data.get("fields"))
    yield from walk(data.get("effects"))


def _participants(trace: TraceSet, records: Sequence[Record]) -> list[Stream]:
    used = {r.stream for r in records}
    first: dict[str, float] = {}
    for record in records:
        first.setdefault(record.stream, record.tm)

    def rank(stream: Stream) -> tuple[int, str, int, float]:
        role = stream.role or stream.proc
        order = next((i for i, r in enumerate(_ROLE_ORDER) if role.startswith(r)), 9)
        bus = 0 if stream.bus in ("main", "scheduler") else 1
        return (order, stream.proc, bus, first[stream.id])

    return sorted((trace.streams[s] for s in used), key=rank)


def _causes(records: Sequence[Record]) -> dict[int, list[tuple[Record, str]]]:
    """For each effect record (by id), the records on another stream that caused it."""
    decls = {d.name: d for d in DECLARATIONS}
    out: dict[int, list[tuple[Record, str]]] = {}
    for rule in RULES:
        if not isinstance(rule, Requires) or inactive(rule, decls) is not None:
            continue
        first_cause: dict[str, Record] = {}
        for record in records:
            if matches(rule.cause, record.data, decls[rule.cause.kind]):
                corr = correlate(rule.cause.corr, record.data)
                if corr is not None:
                    first_cause.setdefault(corr, record)
        for record in records:
            if matches(rule.effect, record.data, decls[rule.effect.kind]):
                cause = first_cause.get(correlate(rule.effect.corr, record.data) or "")
                if cause is not None and cause.stream != record.stream:
                    label = f"{cause.event or 'created'} ⇒ {record.event}"
                    out.setdefault(id(record), []).append((cause, label))
    return out


def _short(key: Any) -> str:
    text = key if isinstance(key, str) else "/".join(map(str, _atoms(key)))
    return text if len(text) <= 40 else text[:37] + "..."
