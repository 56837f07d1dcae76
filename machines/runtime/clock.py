"""Injected clocks. Machines never read time; the runtime asks the clock it was given."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Seconds as a float, never going backwards (the bus keeps its timers in per-duration
    queues that rely on it): `time.monotonic`, or a `VirtualClock`."""

    def __call__(self) -> float: ...


real_clock: Clock = time.monotonic
"""Monotonic seconds: the clock of production runs (the C function itself, no wrapper)."""


class VirtualClock:
    """A clock that moves only when told to, for tests and simulation."""

    __slots__ = ("now",)

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError(f"a virtual clock only moves forward, got {seconds}")
        self.now += seconds
        return self.now

    def jump_to(self, when: float) -> float:
        """Jump forward to `when` (a clock jump); never backwards."""
        if when < self.now:
            raise ValueError(f"cannot jump back from {self.now} to {when}")
        self.now = when
        return self.now
