"""The simulated handshake executor (deterministic simulation ONLY).

`SimHandshakeExecutor` stands in for the handshake thread pool: jobs queue up and run
when the simulator chooses (`run_next`, `run_at`); a `handshake_stall` fault makes a job
ready late.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhandoff.sim.push.fabric import SimNetwork

__all__ = ["SimHandshakeExecutor"]


@dataclass(eq=False, slots=True)
class _Job:
    run: Callable[[], None]
    ready_at: float
    seq: int


@dataclass(slots=True)
class SimHandshakeExecutor:
    """Handshake jobs held until the simulator runs them (never a thread)."""

    network: SimNetwork
    jobs: list[_Job] = field(default_factory=list)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def submit(self, job: Callable[[], None]) -> None:
        ready = self.network.clock.now
        if self.network.roll("handshake_stall"):
            ready += self.network.rng.uniform(*self.network.stall_s) / 4
        self.jobs.append(_Job(job, ready, next(self._seq)))

    def ready(self) -> list[int]:
        now = self.network.clock.now
        return [i for i, job in enumerate(self.jobs) if job.ready_at <= now]

    def next_ready(self) -> float | None:
        return min((job.ready_at for job in self.jobs), default=None)

    def run_at(self, index: int) -> None:
        """Run the job at `index` now, whatever its ready time."""
        self.jobs.pop(index).run()

    def run_next(self) -> bool:
        ready = self.ready()
        if not ready:
            return False
        self.run_at(min(ready, key=lambda i: self.jobs[i].seq))
        return True

    def discard(self) -> None:
        """The process died: queued jobs never run."""
        self.jobs.clear()
