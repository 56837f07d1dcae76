"""Transition records as JSON lines, and their replay onto a fresh bus.

Recording is off by default; when on, every creation and every transition becomes one
line: time, kind, key, event, from, to and the effects it returned. A log can be read
back with `read_log` and replayed with `replay`, which re-creates the instances,
re-delivers the events at their recorded times on a virtual clock, and reports any
instance whose replayed state differs from the recorded one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvhandoff.machines.runtime.bus import EventBus
    from kvhandoff.machines.runtime.clock import VirtualClock
    from kvhandoff.machines.runtime.compiled import Instance

CREATE = "__create__"


class TransitionRecorder:
    __slots__ = ("sink",)

    def __init__(self, sink: Callable[[str], None]) -> None:
        self.sink = sink

    def created(self, now: float, inst: Instance) -> None:
        state = inst.node.name
        self._write(now, inst, CREATE, state, state, None)

    def transition(
        self,
        now: float,
        inst: Instance,
        event: str,
        edge: tuple[str, str, str],
        effects: Iterable[object] | None,
    ) -> None:
        self._write(now, inst, event, edge[0], edge[2], effects)

    def _write(
        self,
        now: float,
        inst: Instance,
        event: str,
        source: str,
        dest: str,
        effects: Iterable[object] | None,
    ) -> None:
        record = {
            "t": now,
            "kind": inst.machine.name,
            "key": _jsonable(inst.key),
            "event": event,
            "from": source,
            "to": dest,
            "effects": [repr(e) for e in effects] if effects else [],
        }
        self.sink(json.dumps(record, sort_keys=True))


def _jsonable(key: Any) -> Any:
    if isinstance(key, str | int | float | bool) or key is None:
        return key
    if isinstance(key, tuple | list):
        return [_jsonable(k) for k in key]
    return repr(key)


def read_log(lines: Iterable[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line.strip()]


def replay(records: Iterable[dict[str, Any]], bus: EventBus, clock: VirtualClock) -> list[str]:
    """Re-run `records` on `bus` (kinds registered, contexts default-constructible).

    Returns one message per record whose replayed destination differs from the log;
    an empty list means the run replayed exactly.
    """
    mismatches: list[str] = []
    for record in records:
        if record["t"] > clock.now:
            clock.jump_to(record["t"])
        kind, key = record["kind"], _key(record["key"])
        if record["event"] == CREATE:
            bus.create(kind, key)
            continue
        inst = bus.get(kind, key)
        if inst is None:
            mismatches.append(f"{kind} {key!r}: no live instance for {record['event']!r}")
            continue
        bus.dispatch(kind, key, record["event"])
        state = inst.node.name
        if state != record["to"]:
            mismatches.append(
                f"{kind} {key!r}: {record['event']!r} led to {state}, log says {record['to']}"
            )
    return mismatches


def _key(raw: Any) -> Any:
    return tuple(_key(k) for k in raw) if isinstance(raw, list) else raw
