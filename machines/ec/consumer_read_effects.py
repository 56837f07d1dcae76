"""What the consumer-read machine (`ec.consumer_read`) asks its adapters to do: the ZMQ
messages to the producer and the NIXL READ and its release (R-E07, R-E11, R-E12)."""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.protocol.ec_wire import XferDone, XferReq

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
