"""Effects the runtime itself executes. Protocol effects are declared beside their machines.

A transition's action returns effects as data; the bus runs the ones it owns (below),
hands the rest to handlers that adapters registered, and leaves any effect nobody
handles in its outbox for the caller to drain (the sans-IO way).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Emit:
    """Deliver `event` to the instance (`kind`, `key`), queued if it is busy."""

    kind: str
    key: Any
    event: str
    payload: Any = None


@dataclass(frozen=True, slots=True)
class ExtendDeadline:
    """Move the emitting instance's armed timeout to max(current, now + seconds)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Metric:
    """Count `value` under `name` in the bus metrics."""

    name: str
    value: float = 1.0
