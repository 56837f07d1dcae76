"""Time as an input. Machines never read a clock: every entry point takes `now`.

`Clock` is what the edges (adapters, the simulator, tests) read `now` from; the
production clock lives in `kvhandoff.adapters.clock`. The bus only ever sees the numbers.
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    """Seconds as a float, never going backwards (the bus keeps its timers in
    per-duration queues that rely on it): the system's monotonic clock, or a
    `VirtualClock`."""

    def __call__(self) -> float: ...


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
