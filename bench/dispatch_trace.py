"""`kvhandoff bench dispatch --trace PATH`: the dispatch bench with the transition trace on.

The same two-step machine and instance count as the untraced `kvhandoff` runner, its bus
recording into a real trace file (`kvhandoff.adapters.trace`, rotated at 16 MiB with one
old part kept, so the bench stays bounded on disk). Reported beside the untraced number,
never asserted: the trace turns the bus's fast path off and encodes one JSON line per
transition.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvhandoff.adapters.trace import TraceConfig, TraceWriter

TRACE_MAX_BYTES = 16 * 2**20


def traced_pass(
    make_pass: Callable[[int, int], tuple[object, Callable[[], int]]],
    target: str,
    instances: int,
    passes: int,
) -> tuple[TraceWriter, Callable[[], int]]:
    """`make_pass(instances, passes)`'s runner with its bus traced into `target` (a
    `.jsonl` file, or a directory for `dispatch-bench.jsonl`)."""
    path = Path(target)
    if path.suffix != ".jsonl":
        path = path / "dispatch-bench.jsonl"
    writer = TraceWriter(TraceConfig(str(path), TRACE_MAX_BYTES, 1), path=path)
    bus, run = make_pass(instances, passes)
    writer.attach(bus, proc="bench", role="bench", bus_name="main")  # type: ignore[arg-type]
    return writer, run
