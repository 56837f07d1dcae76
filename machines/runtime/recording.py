"""Transition records as JSON lines, and their replay onto a fresh bus.

Recording is off by default; when on, every creation and every transition becomes one
line: the injected time, kind, key, event (its trigger name and fields), from, to and the
effects it returned. A log can be read back with `read_log` and replayed with `replay`,
which re-creates the instances, re-delivers the events at their recorded times, and
reports any instance whose replayed state differs from the recorded one.

`bus.record(sink)` takes a plain `sink(line)`; a `RecordSink` subclass receives each
record as structured values instead (the instance itself, the event, the effects), so a
transition trace (`kvhandoff.adapters.trace`) can add its own identity, read the
compiled machine's timeouts and encode once, without parsing lines back.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event

if TYPE_CHECKING:
    from kvhandoff.machines.runtime.bus import EventBus
    from kvhandoff.machines.runtime.compiled import Instance
    from kvhandoff.machines.runtime.effects import Effect

CREATE = "__create__"

MAX_ITEMS = 256
"""Sequences longer than this are cut in records (a registration may name 65,536 blocks)."""
MAX_TEXT = 512
"""Strings (and the repr of anything richer) longer than this are cut in records."""
MAX_BYTES_SHOWN = 32
"""Byte strings up to this length are shown as hex; longer ones by their length only."""


class RecordSink:
    """A recording sink that takes structured records instead of JSON lines.

    Pass an instance to `bus.record`; the bus's recorder calls `created` and
    `transition` (on the thread that owns the bus) instead of `__call__`.
    """

    __slots__ = ()

    def __call__(self, line: str) -> None:
        raise NotImplementedError("a RecordSink takes structured records")

    def created(self, now: float, inst: Instance[Any]) -> None:
        raise NotImplementedError

    def transition(
        self,
        now: float,
        inst: Instance[Any],
        event: Event,
        edge: tuple[str, str, str],
        effects: Sequence[Effect] | None,
    ) -> None:
        raise NotImplementedError


class TransitionRecorder:
    __slots__ = ("sink", "structured")

    def __init__(self, sink: Callable[[str], None]) -> None:
        self.sink = sink
        self.structured = sink if isinstance(sink, RecordSink) else None

    def created(self, now: float, inst: Instance[Any]) -> None:
        if self.structured is not None:
            self.structured.created(now, inst)
            return
        self.sink(record_line(now, inst, CREATE, {}, inst.node.name, inst.node.name, None))

    def transition(
        self,
        now: float,
        inst: Instance[Any],
        event: Event,
        edge: tuple[str, str, str],
        effects: Sequence[Effect] | None,
    ) -> None:
        if self.structured is not None:
            self.structured.transition(now, inst, event, edge, effects)
            return
        self.sink(
            record_line(now, inst, event.trigger, event_fields(event), edge[0], edge[2], effects)
        )


def record_line(
    now: float,
    inst: Instance[Any],
    event: str,
    fields: dict[str, Any],
    source: str,
    dest: str,
    effects: Sequence[Effect] | None,
) -> str:
    """The JSON line of one record in `bus.record`'s plain format."""
    record = {
        "t": now,
        "kind": inst.machine.name,
        "key": jsonable(inst.key),
        "event": event,
        "fields": fields,
        "from": source,
        "to": dest,
        "effects": [repr(e) for e in effects] if effects else [],
    }
    return json.dumps(record, sort_keys=True)


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def event_fields(event: Event) -> dict[str, Any]:
    """The event's payload as JSON-able values (see `jsonable`)."""
    cls = type(event)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        fields: tuple[dataclasses.Field[Any], ...] = (
            dataclasses.fields(event) if dataclasses.is_dataclass(event) else ()
        )
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields)
    return {name: jsonable(getattr(event, name)) for name in names} if names else {}


def effect_record(effect: Effect) -> dict[str, Any]:
    """`{"effect": <class name>, <field>: <value>...}` for one effect."""
    out: dict[str, Any] = {"effect": type(effect).__name__}
    if dataclasses.is_dataclass(effect):
        for f in dataclasses.fields(effect):
            out[f.name] = jsonable(getattr(effect, f.name))
    return out


def jsonable(value: Any, depth: int = 0) -> Any:
    """`value` as JSON: records (dataclasses, msgspec structs) become objects, sequences
    lists, bytes hex (or their length when long); long sequences and strings are cut and
    anything else is its repr."""
    if isinstance(value, str):
        return value if len(value) <= MAX_TEXT else value[:MAX_TEXT] + "..."
    if isinstance(value, bool | int | float) or value is None:
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        return raw.hex() if len(raw) <= MAX_BYTES_SHOWN else f"<{len(raw)} bytes>"
    if depth < 4:
        if isinstance(value, Declaration):
            return value.name
        if isinstance(value, Event):
            return {"event": value.trigger, **event_fields(value)}
        if isinstance(value, tuple | list | frozenset | set):
            items = sorted(value, key=repr) if isinstance(value, set | frozenset) else value
            out = [jsonable(v, depth + 1) for v in list(items)[:MAX_ITEMS]]
            if len(value) > MAX_ITEMS:
                out.append(f"... {len(value) - MAX_ITEMS} more")
            return out
        if isinstance(value, Mapping):
            return {str(k): jsonable(v, depth + 1) for k, v in list(value.items())[:MAX_ITEMS]}
        names = _record_fields(value)
        if names is not None:
            return {name: jsonable(getattr(value, name), depth + 1) for name in names}
    text = repr(value)
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT] + "..."


def _record_fields(value: Any) -> tuple[str, ...] | None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple(f.name for f in dataclasses.fields(value))
    struct_fields = getattr(type(value), "__struct_fields__", None)  # a msgspec Struct
    if isinstance(struct_fields, tuple):
        return tuple(str(name) for name in struct_fields)
    return None


def read_log(lines: Iterable[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line.strip()]


def replay(
    records: Iterable[dict[str, Any]], bus: EventBus, declarations: Iterable[Declaration[Any]]
) -> list[str]:
    """Re-run `records` on `bus`, where `declarations` are registered and their contexts
    can be built from a key alone.

    Returns one message per record whose replayed destination differs from the log (or
    whose event cannot be rebuilt from its recorded fields); an empty list means the run
    replayed exactly.
    """
    by_name = {decl.name: decl for decl in declarations}
    mismatches: list[str] = []
    for record in records:
        decl, key, now = by_name[record["kind"]], _key(record["key"]), float(record["t"])
        if record["event"] == CREATE:
            bus.create(decl, decl.new_context(key, {}), now)
            continue
        inst = bus.get(decl, key)
        event_cls = {e.trigger: e for e in decl.events}.get(record["event"])
        if inst is None or event_cls is None:
            mismatches.append(f"{decl.name} {key!r}: cannot deliver {record['event']!r}")
            continue
        timeout = inst.node.timeout
        if timeout is not None and event_cls is timeout.event:
            bus.fire_due(now)  # a recorded timeout fires from the clock, not a dispatch
        else:
            try:
                event = event_cls(**record.get("fields", {}))
            except TypeError as exc:
                mismatches.append(f"{decl.name} {key!r}: cannot rebuild {record['event']}: {exc}")
                continue
            bus.dispatch(decl, key, event, now)
        state = inst.node.name
        if state != record["to"]:
            mismatches.append(
                f"{decl.name} {key!r}: {record['event']!r} led to {state}, log says {record['to']}"
            )
    return mismatches


def _key(raw: Any) -> Any:
    return tuple(_key(k) for k in raw) if isinstance(raw, list) else raw
