"""Push-mode settings (R-P07, R-P10, R-P11, R-P15, B-11, S-03, S-05), validated.

Timeouts are in seconds. Where vLLM 0.33 derives one setting from another, so does this:
the heartbeat extension is 2/3 of the lease and the heartbeat interval 1/6 of it unless
configured (30 s lease: 20 s extension, a heartbeat every 5 s); the registration watchdog
defaults to `decoder_kv_blocks_ttl`; idle remote engines are evicted after `engine_ttl`
(vLLM's 3600 s). The cluster key (S-05) is configured, never defaulted, and never shown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvhandoff.protocol.errors import LocalProtocolError

_COUNTS = frozenset(
    {
        "tp_size",
        "pp_size",
        "max_pending_registrations_per_peer",
        "max_pending_registrations",
        "max_pending_block_ids",
        "max_pending_block_ids_per_peer",
    }
)
_TEXT = frozenset({"nixl_backend", "cluster_key"})
_FLAGS = frozenset({"nixl_progress_thread", "cuda_ipc"})


@dataclass(frozen=True, slots=True)
class PushConfig:
    """Push-mode settings of one engine (its scheduler and every worker rank)."""

    kv_lease_duration: float = 30.0
    kv_lease_extension: float | None = None
    """Heartbeats extend a lease to at least now + this; 2/3 of the lease by default."""
    heartbeat_interval: float | None = None
    """D sends heartbeats this often; 1/6 of the lease by default."""
    decoder_kv_blocks_ttl: float = 480.0
    push_registration_timeout: float | None = None
    push_writer_poll_interval_ms: float = 1.0
    handshake_timeout: float = 10.0
    push_write_timeout: float = 30.0
    engine_ttl: float = 3600.0
    """A connected remote engine unused this long is evicted (B-11, vLLM's engine TTL)."""
    pending_registration_ttl: float | None = None
    """How long P keeps a `PUSH_REG` that waits for its blocks; the watchdog by default."""
    tombstone_ttl: float = 60.0
    """How long P remembers the D ids it served, to drop late duplicates of their
    `PUSH_REG`s."""
    max_pending_registrations_per_peer: int = 1024
    max_pending_registrations: int = 8192
    max_pending_block_ids: int = 1 << 21
    """Block ids held by every waiting `PUSH_REG` together (S-03). Agents of no engine this
    rank is connected to (first contact, or names nobody handshaked) share at most half
    of this and of `max_pending_registrations`, so a flood of invented agent names never
    refuses a connected D."""
    max_pending_block_ids_per_peer: int = 1 << 18
    """Block ids held by the waiting `PUSH_REG`s of one agent (S-03)."""
    tp_size: int = 1
    pp_size: int = 1
    nixl_backend: str = "UCX"
    nixl_progress_thread: bool = False
    """NIXL's own progress thread spins a core; by default the writer's passes and the
    engine steps drive UCX progress instead (measured faster on small hosts)."""
    cuda_ipc: bool = True
    """With KV in VRAM, push mode: WRITE to a D on the same host through CUDA IPC when both
    engines are kvhandoff (D exports its KV to a P advertising ``cuda_ipc``; any refusal
    keeps that rank on NIXL). Off: NIXL only."""
    cluster_key: str | None = field(default=None, repr=False)
    """The shared secret that seals control notifs between kvhandoff peers (S-05)."""
    sealed_notif_ttl: float = 120.0
    """How long a sealed notif stays fresh after it was sealed (S-05): longer than a WRITE
    may take, since a completion notif is sealed when its WRITE is posted. Sealing peers'
    wall clocks must agree within `sealed_notif_skew`."""
    sealed_notif_skew: float = 5.0
    """How far peers' wall clocks may disagree: for sealed notifs, and in pull mode for the
    lease deadline P puts on its params (a READ D sees done later than it, less this,
    fails: P may have reused the blocks, B-09)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in _FLAGS:
                if not isinstance(value, bool):
                    raise LocalProtocolError(f"{f.name} must be a bool, got {value!r}")
            elif f.name in _TEXT:
                if value is None and f.name == "cluster_key":
                    continue
                if not isinstance(value, str) or not value:
                    raise LocalProtocolError(f"{f.name} must be a non-empty string")
            elif f.name in _COUNTS:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise LocalProtocolError(f"{f.name} must be a positive integer, got {value!r}")
            elif value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise LocalProtocolError(
                    f"{f.name} must be a positive number of seconds, got {value!r}"
                )
        if self.cluster_key is not None and len(self.cluster_key.encode()) < 16:
            raise LocalProtocolError("cluster_key needs at least 16 bytes")
        if self.sealed_notif_ttl <= self.push_write_timeout:
            raise LocalProtocolError(
                f"sealed_notif_ttl ({self.sealed_notif_ttl:g} s) must outlast a WRITE"
                f" (push_write_timeout {self.push_write_timeout:g} s): its completion notif is"
                " sealed when the WRITE is posted"
            )
        if self.engine_ttl <= self.registration_timeout:
            raise LocalProtocolError(
                f"engine_ttl ({self.engine_ttl:g} s) must outlast the registration watchdog"
                f" ({self.registration_timeout:g} s)"
            )

    @property
    def lease_extension(self) -> float:
        if self.kv_lease_extension is None:
            return self.kv_lease_duration * 2.0 / 3.0
        return self.kv_lease_extension

    @property
    def heartbeat_every(self) -> float:
        if self.heartbeat_interval is None:
            return self.kv_lease_duration / 6.0
        return self.heartbeat_interval

    @property
    def registration_timeout(self) -> float:
        if self.push_registration_timeout is None:
            return self.decoder_kv_blocks_ttl
        return self.push_registration_timeout

    @property
    def pending_ttl(self) -> float:
        if self.pending_registration_ttl is None:
            return self.registration_timeout
        return self.pending_registration_ttl

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def machine_config(self) -> dict[str, float]:
        """The config keys the push machines' declared timeouts read."""
        return {
            "kv_lease_duration": self.kv_lease_duration,
            "push_registration_timeout": self.registration_timeout,
            "handshake_timeout": self.handshake_timeout,
            "push_write_timeout": self.push_write_timeout,
            "engine_ttl": self.engine_ttl,
            "pending_registration_ttl": self.pending_ttl,
            "tombstone_ttl": self.tombstone_ttl,
        }

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> PushConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise LocalProtocolError(
                f"unknown push config keys {unknown}; accepted: {sorted(known)}"
            )
        return cls(**dict(raw))
