"""Transition traces of simulated runs: one file per seeded run, on the virtual clock.

With `KVHANDOFF_TRACE` naming a directory (`kvhandoff simulate --trace DIR`), each run
writes `DIR/<protocol>-seed<seed>.jsonl` in the trace format of
`kvhandoff.adapters.trace`; every engine's bus is one stream, named after the recording
source the world gives it (`prefill.main`, `consumer-1`...). `kvhandoff check-trace`
reads these files as it reads a real deployment's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, MutableSequence, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvhandoff.adapters.trace import ENV, TraceConfig, TraceWriter
from kvhandoff.machines.runtime.recording import (
    CREATE,
    RecordSink,
    event_fields,
    record_line,
)

if TYPE_CHECKING:
    from kvhandoff.machines.runtime.compiled import Instance
    from kvhandoff.machines.runtime.effects import Effect
    from kvhandoff.machines.runtime.events import Event

__all__ = ["SimTrace", "sim_trace"]


def sim_trace(protocol: str, seed: int, clock: Callable[[], float]) -> SimTrace | None:
    """The trace of one run when `KVHANDOFF_TRACE` names a directory, else None."""
    target = os.environ.get(ENV, "").strip()
    if not target or target.endswith(".jsonl") or target.startswith("log"):
        return None
    path = Path(target) / f"{protocol}-seed{seed:06d}.jsonl"
    writer = TraceWriter(
        TraceConfig(target), clock_kind="virtual", clock=clock, path=path, run=path.stem
    )
    return SimTrace(writer)


class SimTrace:
    def __init__(self, writer: TraceWriter) -> None:
        self.writer = writer

    def sink(self, source: str, log: MutableSequence[str]) -> _WorldSink:
        """A recording sink for the bus the world calls `source`: into the trace, and
        into the world's log as the plain sink would write it."""
        proc, _, bus = source.partition(".")
        role = proc.rstrip("0123456789").rstrip("-") or proc
        stream = self.writer.stream(proc=proc, role=role, bus_name=bus or "scheduler")
        return _WorldSink(stream, source, log)

    def close(self) -> None:
        self.writer.close()


class _WorldSink(RecordSink):
    __slots__ = ("log", "source", "trace")

    def __init__(self, trace: RecordSink, source: str, log: MutableSequence[str]) -> None:
        self.trace = trace
        self.source = source
        self.log = log

    def created(self, now: float, inst: Instance[Any]) -> None:
        self.trace.created(now, inst)
        state = inst.node.name
        self.log.append(f"{self.source} {record_line(now, inst, CREATE, {}, state, state, None)}")

    def transition(
        self,
        now: float,
        inst: Instance[Any],
        event: Event,
        edge: tuple[str, str, str],
        effects: Sequence[Effect] | None,
    ) -> None:
        self.trace.transition(now, inst, event, edge, effects)
        line = record_line(now, inst, event.trigger, event_fields(event), edge[0], edge[2], effects)
        self.log.append(f"{self.source} {line}")
