"""The shape of a simulated push run (deterministic simulation only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhandoff.protocol.push_config import PushConfig

if TYPE_CHECKING:
    from kvhandoff.sim.push.engine import SimEngine

__all__ = ["MEMBERS", "SIM_PUSH_CONFIG", "SimSettings", "Variant"]

MEMBERS = ("layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v")

SIM_PUSH_CONFIG = PushConfig(
    kv_lease_duration=30.0,
    kv_lease_extension=20.0,
    heartbeat_interval=5.0,
    push_registration_timeout=60.0,
    handshake_timeout=10.0,
    push_write_timeout=30.0,
    nixl_backend="SIM",
)

Variant = Callable[["SimEngine"], None]


@dataclass(frozen=True, slots=True)
class SimSettings:
    """The shape of a simulated run; the push timeouts are the real machines' config."""

    requests: int = 16
    max_blocks: int = 6
    block_len: int = 16
    ratio: int = 2  # physical blocks per logical block, on both sides (R-P06)
    capacity: int = 192  # logical blocks per engine
    push: PushConfig = SIM_PUSH_CONFIG
    idle_timeout_s: float = 1.0  # the writer thread's wait when nothing wakes it
    leg_spread_s: float = 0.05  # how far apart the proxy's two legs may arrive
    mean_interarrival_s: float = 0.25  # client requests arrive as a Poisson process
    max_actions: int = 60_000
    probes: int = 3

    @property
    def quarantine_s(self) -> float:
        """How long D keeps blocks of a failed receive out of reuse: P's longest WRITE
        window after D gave up (lease, handshake, write timeout) and some."""
        p = self.push
        return max(p.kv_lease_duration, p.kv_lease_extension) + (
            p.handshake_timeout + p.push_write_timeout + 5.0
        )

    @property
    def settle_span_s(self) -> float:
        p = self.push
        return (
            p.registration_timeout
            + max(p.kv_lease_duration, p.kv_lease_extension)
            + p.handshake_timeout
            + p.push_write_timeout
            + self.quarantine_s
            + 100.0
        )
