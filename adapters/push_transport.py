"""The transport interface the push edges are written against: one interface, two
implementations — the real NIXL agent plus ZMQ side channel (`nixl_push_transport`) and
the in-memory fabric for deterministic simulation (`sim_fabric`).

Peers are named by engine id. `connect` runs on the handshake executor; everything else
on the writer thread, except `send_notif` for heartbeats (main thread) and `poll` /
`release` (main thread, in get_finished), as the seed prescribes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvhandoff.protocol.handshake import HandshakePayload

XferState = Literal["DONE", "PROC", "ERR"]


def peer_gone(exc: BaseException) -> bool:
    """Whether a transport error says the peer itself is gone (its agent must be forgotten
    and re-handshaked, B-08), as opposed to a failure of one operation."""
    return bool(getattr(exc, "peer_gone", False))


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """What a completed handshake taught us about a remote engine."""

    engine_id: str
    agent_name: str
    tp_size: int
    physical_blocks_per_logical: int
    capacity: int  # the smallest block count of the peer's routed regions


class TransferHandle(Protocol):
    """An opaque posted transfer."""


class PushTransport(Protocol):
    engine_id: str

    def handshake_payload(self) -> HandshakePayload:
        """What this engine serves on its side channel."""
        ...

    def fetch_handshake(self, host: str, port: int, timeout_s: float) -> bytes:
        """The peer's encoded handshake payload (runs on the handshake executor)."""
        ...

    def connect(self, payload: HandshakePayload) -> PeerInfo:
        """Check compatibility, load the peer's agent, prepare its descriptors (executor)."""
        ...

    def forget(self, engine_id: str) -> None:
        """Drop a peer's agent and descriptors; the next use re-handshakes (B-08)."""
        ...

    def peer(self, engine_id: str) -> PeerInfo | None: ...

    def send_notif(self, engine_id: str, message: bytes) -> None: ...

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        """(sender agent name, message) pairs that arrived since the last call."""
        ...

    def write_blocks(
        self,
        engine_id: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> TransferHandle:
        """WRITE local physical blocks into the peer's, in every routed region."""
        ...

    def read_blocks(
        self,
        engine_id: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> TransferHandle:
        """READ the peer's physical blocks into local ones, in every routed region (pull mode,
        B-09); `notif` reaches the peer when the READ is done."""
        ...

    def poll(self, handle: TransferHandle) -> XferState: ...

    def release(self, handle: TransferHandle) -> None: ...
