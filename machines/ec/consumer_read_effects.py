"""What the consumer-read machine (`ec.consumer_read`) asks its adapters to do: the ZMQ
messages to the producer and the NIXL READ and its release (R-E07, R-E11, R-E12); and
what the adapters and the timeouts tell it back (the peer events and timeout events)."""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event, PeerEvent
from kvhandoff.protocol.ec_wire import XferAck, XferDone, XferReq

# -- effects ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendXferReq(Effect):
    """ZMQ adapter: send `req` on the DEALER of producer `peer_host:peer_port`; report
    `on_xfer_ack` for its answer and `on_peer_disconnected` if the peer goes away."""

    peer_host: str
    peer_port: int
    req: XferReq


@dataclass(frozen=True, slots=True)
class IssueRead(Effect):
    """NIXL adapter: load `producer_agent_metadata` if this agent is new or changed (a
    stock vLLM producer names no agent: `producer_agent_name` is '' and the metadata says
    it), READ
    `src_blocks` of the producer's region into `dst_blocks` of ours, release the handle
    when it ends and then report `on_read_done(mm_hash, transfer_id, now)` or
    `on_read_failed(...)`."""

    mm_hash: str
    transfer_id: str
    peer_host: str
    peer_port: int
    producer_agent_name: str
    producer_agent_metadata: bytes
    remote_base_addr: int
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    block_size_bytes: int
    size_bytes: int
    notif: bytes = b""
    """The notif the READ carries (`<session_id>:<mm_hash>` for a producer that releases
    grants on it, C-03; empty when it speaks `XferDone`)."""


@dataclass(frozen=True, slots=True)
class SendXferDone(Effect):
    """ZMQ adapter: tell the producer a grant is finished with (`done.ok`)."""

    peer_host: str
    peer_port: int
    done: XferDone


@dataclass(frozen=True, slots=True)
class ReleaseRead(Effect):
    """NIXL adapter: release the handle of the READ `transfer_id` of `mm_hash` (which
    cancels a DMA still running), then report `on_read_released(mm_hash, now)`."""

    mm_hash: str
    transfer_id: str


# -- events from the adapters and the timeouts -------------------------------------------


@dataclass(frozen=True, slots=True)
class Ack(PeerEvent):
    """The producer's answer to the current attempt, received at `at` (checked against it
    and against the peer it came from by the scheduler)."""

    ack: XferAck
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class ReadDone(PeerEvent):
    """NIXL: the READ of the current attempt completed (its handle is released)."""


@dataclass(frozen=True, slots=True)
class ReadFailed(PeerEvent):
    """NIXL: the READ of the current attempt failed (its handle is released)."""


@dataclass(frozen=True, slots=True)
class ReadReleased(Event):
    """The adapter released the quarantined READ's handle (`ReleaseRead`)."""


@dataclass(frozen=True, slots=True)
class AckTimeout(Event):
    """No ack within `consumer_ack_timeout_s`."""


@dataclass(frozen=True, slots=True)
class ReadTimeout(Event):
    """The READ did not complete within `nixl_read_timeout_s`."""


@dataclass(frozen=True, slots=True)
class QuarantineOver(Event):
    """`read_quarantine_s` passed: time to cancel the DMA and free the destination."""
