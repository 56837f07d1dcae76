"""The shape of a simulated encoder-cache run and its clients (simulation only).

`ECSimSettings` sizes a run (requests, encodings, regions, retry bound, pacing);
`ECClient` is one client request as the world's proxy sees it, in a `Phase` of its own
bookkeeping (not a declared machine: the world resolves it when the consumer answers).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.protocol.ec_config import (
    DEFAULT_CONSUMER_ACK_TIMEOUT_S,
    DEFAULT_NIXL_READ_TIMEOUT_S,
    DEFAULT_READ_QUARANTINE_S,
)
from kvhandoff.protocol.ec_status import NACKS, RETRYABLE_NACKS

__all__ = [
    "EPS",
    "META",
    "QUARANTINE_REASONS",
    "READ_FALLBACKS",
    "ECClient",
    "ECSimSettings",
    "Phase",
]

META = {"grid": [1, 2, 2]}
EPS = 1e-6
READ_FALLBACKS = frozenset(
    {str(s) for s in NACKS - RETRYABLE_NACKS} | {"ack_timeout", "peer_disconnected", "read_failed"}
)
"""Why a read may fall back to local encoding (NACK_NOT_READY only once its retries are spent,
by count or by time)."""
QUARANTINE_REASONS = frozenset({"read_timeout", "peer_disconnected"})
"""Why a read may quarantine its destination."""


class Phase(StrEnum):
    """Where a client request is, as the simulated proxy tracks it."""

    RELAYING = "relaying"  # its publication is on the way to the consumer
    WAITING = "waiting"  # the consumer has its leg and has not answered yet
    COMPLETED = "completed"
    FAILED = "failed"
    LOST = "lost"  # the consumer crashed with it
    ABORTED = "aborted"

    @property
    def final(self) -> bool:
        return self not in (Phase.RELAYING, Phase.WAITING)


@dataclass(frozen=True, slots=True)
class ECSimSettings:
    """The shape of a simulated encoder-cache run; timeouts are the connector defaults."""

    requests: int = 16
    encodings: int = 10  # distinct mm_hashes the clients draw from
    max_tokens: int = 4  # blocks per encoding
    producer_blocks: int = 20
    consumer_blocks: int = 12
    max_not_ready: int = 20  # consumer_max_not_ready_retries (the default is 1000)
    max_pins_per_peer: int = 3  # producer_max_grants_per_peer (the default is 256)
    max_pins: int = 12  # producer_max_grants (the default is 4096)
    rewrite_share: float = 0.25  # consumer legs whose media was rewritten (B-05)
    mean_interarrival_s: float = 0.25
    relay_s: tuple[float, float] = (0.0, 0.3)  # the proxy relays a publication
    max_actions: int = 40_000
    probes: int = 3
    tp_size: int = 2  # worker ranks per engine: every load is reported by each (R-T02)
    pcp_every: int = 4  # every 4th seed runs PCP=2 as well (0: never)

    def pcp_size(self, seed: int) -> int:
        return 2 if self.pcp_every and seed % self.pcp_every == self.pcp_every - 1 else 1

    @property
    def settle_span_s(self) -> float:
        reads = (self.max_not_ready + 1) * DEFAULT_CONSUMER_ACK_TIMEOUT_S
        return reads + DEFAULT_NIXL_READ_TIMEOUT_S + DEFAULT_READ_QUARANTINE_S + 100.0

    def tokens(self, mm_hash: str) -> int:
        """An encoding's size is a property of the media: the same on every leg."""
        return 1 + sum(map(ord, mm_hash)) % self.max_tokens


@dataclass(slots=True)
class ECClient:
    client_id: str
    mm_hashes: tuple[str, ...]
    probe: bool = False
    request: ECRequestInfo | None = None  # the consumer leg, once relayed
    relay_at: float = 0.0
    consumer_epoch: int = 0
    phase: Phase = Phase.RELAYING
    reason: str = ""

    @property
    def resolved(self) -> bool:
        return self.phase.final

    @property
    def completed(self) -> bool:
        return self.phase is Phase.COMPLETED
