"""The production clock: the one place that reads time for the machines."""

from __future__ import annotations

import time

from kvhandoff.machines.runtime.clock import Clock

real_clock: Clock = time.monotonic
"""Monotonic seconds (the C function itself, no wrapper)."""

wall_clock: Clock = time.time
"""Wall-clock seconds: only where peers compare times (sealed notifs' freshness, S-05)."""
