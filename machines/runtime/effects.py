"""Effects the runtime itself executes. Protocol effects are declared beside their machines.

A transition's action returns effects as data; the bus runs the ones it owns (below),
hands the rest to handlers that adapters registered, and leaves any effect nobody
handles in its outbox for the caller to drain (the sans-IO way). Every effect derives
from `Effect`, so an action's return type is `list[Effect]`.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvhandoff.machines.runtime.events import Event

if TYPE_CHECKING:
    from kvhandoff.machines.runtime.declaration import Declaration


class Effect:
    """Base class of every effect an action returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Emit(Effect):
    """Deliver `event` to the instance (`kind`, `key`), queued if it is busy."""

    kind: Declaration[Any]
    key: Hashable
    event: Event


@dataclass(frozen=True, slots=True)
class ExtendDeadline(Effect):
    """Move the emitting instance's armed timeout to max(current, now + seconds)."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Metric(Effect):
    """Count `value` under `name` in the bus metrics."""

    name: str
    value: float = 1.0
