"""Transition records as JSON lines, and their replay onto a fresh bus.

Recording is off by default; when on, every creation and every transition becomes one
line: the injected time, kind, key, event (its trigger name and fields), from, to and the
effects it returned. A log can be read back with `read_log` and replayed with `replay`,
which re-creates the instances, re-delivers the events at their recorded times, and
reports any instance whose replayed state differs from the recorded one.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvhandoff.machines.runtime.events import Event

if TYPE_CHECKING:
    from kvhandoff.machines.runtime.bus import EventBus
    from kvhandoff.machines.runtime.compiled import Instance
    from kvhandoff.machines.runtime.declaration import Declaration
    from kvhandoff.machines.runtime.effects import Effect

CREATE = "__create__"


class TransitionRecorder:
    __slots__ = ("sink",)

    def __init__(self, sink: Callable[[str], None]) -> None:
        self.sink = sink

    def created(self, now: float, inst: Instance[Any]) -> None:
        state = inst.node.name
        self._write(now, inst, CREATE, {}, state, state, None)

    def transition(
        self,
        now: float,
        inst: Instance[Any],
        event: Event,
        edge: tuple[str, str, str],
        effects: Sequence[Effect] | None,
    ) -> None:
        self._write(now, inst, event.trigger, event_fields(event), edge[0], edge[2], effects)

    def _write(
        self,
        now: float,
        inst: Instance[Any],
        event: str,
        fields: dict[str, Any],
        source: str,
        dest: str,
        effects: Sequence[Effect] | None,
    ) -> None:
        record = {
            "t": now,
            "kind": inst.machine.name,
            "key": _jsonable(inst.key),
            "event": event,
            "fields": fields,
            "from": source,
            "to": dest,
            "effects": [repr(e) for e in effects] if effects else [],
        }
        self.sink(json.dumps(record, sort_keys=True))


def event_fields(event: Event) -> dict[str, Any]:
    """The event's payload as JSON-able values (repr for anything richer)."""
    if not dataclasses.is_dataclass(event):
        return {}
    return {f.name: _jsonable(getattr(event, f.name)) for f in dataclasses.fields(event)}


def _jsonable(value: Any) -> Any:
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, tuple | list | frozenset | set):
        return [_jsonable(v) for v in value]
    return repr(value)


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
