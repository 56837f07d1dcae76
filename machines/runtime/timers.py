"""Timers: one FIFO of deadlines per timeout duration, on the bus's injected time.

`now` never goes backwards, so deadlines armed with one duration are already in order:
arming is an append (no heap), and the earliest deadline is the smallest head among the
few queues. An entry `(deadline, instance)` is live while its instance still holds that
very tuple as its `timer`; replacing or clearing `instance.timer` cancels it. Cancelled
entries are dropped lazily, and the queues are compacted when they could hold more dead
entries than live ones.

`EventBus` derives from `TimerQueues`; the hot path in `EventBus.dispatch` inlines `_arm`
for speed, so the two must keep to the same entry format.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from kvhandoff.machines.runtime.compiled import Instance, TimerEntry

_MIN_COMPACT = 1024


class TimerQueues:
    """The bus's time and its per-duration timer queues."""

    def __init__(self) -> None:
        self._now = -math.inf
        self._next_due = math.inf  # never later than the earliest live deadline
        self._delivering = False
        self._timer_queues: dict[float, deque[TimerEntry]] = {}  # by duration, in order
        self._compact_at = _MIN_COMPACT

    def _timer_queue(self, seconds: float) -> deque[TimerEntry]:
        queue = self._timer_queues.get(seconds)
        if queue is None:
            queue = self._timer_queues[seconds] = deque()
        return queue

    def _arm(self, inst: Instance[Any], seconds: float) -> None:
        queue = self._timer_queue(seconds)
        deadline = self._now + seconds
        inst.timer = entry = (deadline, inst)
        queue.append(entry)
        if deadline < self._next_due:
            self._next_due = deadline
        if len(queue) > self._compact_at:
            self._compact()

    def _cancel(self, inst: Instance[Any], timer: TimerEntry) -> None:
        inst.timer = None

    def _compact(self) -> None:
        """Drop cancelled entries once they could outnumber the live ones (in place: the
        nodes hold their queues)."""
        longest = 0
        for queue in self._timer_queues.values():
            live = [entry for entry in queue if entry[1].timer is entry]
            queue.clear()
            queue.extend(live)
            longest = max(longest, len(live))
        self._compact_at = max(_MIN_COMPACT, 2 * longest)

    def _earliest(self) -> deque[TimerEntry] | None:
        """The queue whose head is the earliest live deadline (dead heads dropped)."""
        best: deque[TimerEntry] | None = None
        for queue in self._timer_queues.values():
            while queue and queue[0][1].timer is not queue[0]:
                queue.popleft()
            if queue and (best is None or queue[0][0] < best[0][0]):
                best = queue
        return best

    def next_deadline(self) -> float | None:
        """The earliest armed deadline, or None when no timer is armed (aioquic's
        `get_timer`): the caller comes back with `fire_due(now)` by then."""
        queue = self._earliest()
        return None if queue is None else float(queue[0][0])
