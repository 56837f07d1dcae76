"""The shape of a simulated push run (deterministic simulation only)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvhandoff.protocol.push_config import PushConfig

if TYPE_CHECKING:
    from kvhandoff.sim.push.engine import SimEngine

__all__ = [
    "CLUSTER_KEY",
    "MEMBERS",
    "SIM_PUSH_CONFIG",
    "TOPOLOGIES",
    "SimSettings",
    "Topology",
    "Variant",
]

MEMBERS = ("layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v")
"""Every layer of the simulated model; a PP stage owns a contiguous slice."""

CLUSTER_KEY = "sim-cluster-key-0123456789abcdef"

SIM_PUSH_CONFIG = PushConfig(
    kv_lease_duration=30.0,
    kv_lease_extension=20.0,
    heartbeat_interval=5.0,
    push_registration_timeout=60.0,
    handshake_timeout=10.0,
    push_write_timeout=30.0,
    engine_ttl=100.0,
    tombstone_ttl=120.0,
    nixl_backend="SIM",
)

Variant = Callable[["SimEngine"], None]


@dataclass(frozen=True, slots=True)
class Topology:
    """P's TP x PP and D's TP of one simulated world (R-T03, R-T04)."""

    p_tp: int = 1
    p_pp: int = 1
    d_tp: int = 1

    def __str__(self) -> str:
        return f"P tp{self.p_tp} pp{self.p_pp} -> D tp{self.d_tp}"


TOPOLOGIES = (
    Topology(1, 1, 1),
    Topology(2, 1, 1),
    Topology(1, 1, 2),
    Topology(1, 2, 1),
    Topology(2, 1, 2),
    Topology(2, 2, 1),
)
"""What a seed draws its world from: equal TP, TP 2->1, 1->2, a PP-2 producer, both."""


@dataclass(frozen=True, slots=True)
class SimSettings:
    """The shape of a simulated run; the push timeouts are the real machines' config."""

    requests: int = 16
    max_blocks: int = 6
    block_len: int = 16  # bytes of one physical block of the whole model (every TP rank)
    ratio: int = 2  # physical blocks per logical block, on both sides (R-P06)
    capacity: int = 192  # logical blocks per engine
    push: PushConfig = SIM_PUSH_CONFIG
    topologies: tuple[Topology, ...] = TOPOLOGIES
    prefix_hit: float = 0.2  # share of decode legs that find part of their prefix cached
    keyed: float = 0.5  # share of worlds whose engines share a cluster key (S-05)
    retry: float = 0.5  # share of failed requests the proxy retries under the same id
    idle_timeout_s: float = 1.0  # the writer thread's wait when nothing wakes it
    leg_spread_s: float = 0.05  # how far apart the proxy's two legs may arrive
    mean_interarrival_s: float = 0.25  # client requests arrive as a Poisson process
    max_actions: int = 80_000
    probes: int = 3

    def config(self, topology: Topology, role: str, *, keyed: bool) -> PushConfig:
        tp, pp = (topology.p_tp, topology.p_pp) if role == "prefill" else (topology.d_tp, 1)
        return replace(
            self.push, tp_size=tp, pp_size=pp, cluster_key=CLUSTER_KEY if keyed else None
        )

    @property
    def retry_delay_s(self) -> float:
        """A retry waits until no registration of the failed attempt can still be held."""
        return self.push.pending_ttl + 5.0

    @property
    def quarantine_s(self) -> float:
        """How long D keeps blocks of a failed receive out of reuse: P's longest WRITE
        window after D gave up (lease, handshake, write timeout) and some."""
        p = self.push
        return max(p.kv_lease_duration, p.lease_extension) + (
            p.handshake_timeout + p.push_write_timeout + 5.0
        )

    @property
    def hang_bound_s(self) -> float:
        """The longest a lease or registration can last: the watchdog, the lease and its
        last extension, a handshake and a WRITE, the longest clock jump and stall."""
        p = self.push
        return (
            p.registration_timeout
            + p.kv_lease_duration
            + p.lease_extension
            + p.handshake_timeout
            + p.push_write_timeout
            + 150.0
        )

    @property
    def settle_span_s(self) -> float:
        p = self.push
        return (
            max(p.registration_timeout, p.engine_ttl, p.tombstone_ttl)
            + max(p.kv_lease_duration, p.lease_extension)
            + p.handshake_timeout
            + p.push_write_timeout
            + self.quarantine_s
            + 100.0
        )
