"""Consumer read: pulling one encoding from a producer's CPU tier (R-E07, R-E08, R-E12, B-04).

Keyed by `mm_hash`: every request of this consumer that waits for the same encoding
waits on the same read. Before the read is created the consumer reserved destination
blocks for it (an `allocated` `ec.cache_entry` of origin `"read"`).

- `send`: `needed -> xfer_req_sent`, a `SendXferReq` over the consumer's one ZMQ DEALER
  per producer peer. Each attempt has a fresh `transfer_id`; an ack of an earlier attempt
  is stale and never reaches the machine.
- `ack` with `OK`: `xfer_req_sent -> reading`, an `IssueRead` of the granted source
  blocks into the reserved destination with NIXL READ (consumer-initiated; the producer
  never pushes, R-E11). The ack carries the producer's NIXL agent metadata, so a
  restarted producer is read without another handshake.
- `ack` with a NACK in `RETRYABLE_NACKS` (only `NACK_NOT_READY`): `-> retry_next_step`;
  no failure is recorded and the destination blocks stay reserved (B-04: the seed
  released them and reallocated next step, evicting a ready entry per step). The next
  scheduler step `send`s again. Beyond the seed, `consumer_max_not_ready_retries`
  (machine config) bounds the retries; the last NACK_NOT_READY then falls back.
- any other NACK, `ack_timeout` (after `consumer_ack_timeout_s`, 2 s), or
  `peer_disconnected` before the READ: `-> fallback_local`; the destination is discarded
  and every waiting request encodes locally (`FallBackLocal`).
- `read_done`: `reading -> done`; the entry becomes ready and `SendXferDone(ok=True)`
  lets the producer unpin at once. `read_failed` (NIXL reported the transfer failed):
  `-> fallback_local` with `SendXferDone(ok=False)`.
- `read_timeout` (after `nixl_read_timeout_s`, 20 s) or `peer_disconnected` while
  reading: `-> quarantined`. The request falls back at once, but a DMA in flight cannot
  be interrupted, so the destination blocks stay reserved, not evicted, until
  `quarantine_over` (after `read_quarantine_s`, 60 s) takes it to `released`.

No state waits on anything but a declared timeout or the next scheduler step, so P2P
failure never blocks a request indefinitely.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.ec.cache_entry import ENTRY_KIND
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Emit, Metric
from kvhandoff.protocol.ec_config import (
    DEFAULT_CONSUMER_ACK_TIMEOUT_S,
    DEFAULT_NIXL_READ_TIMEOUT_S,
    DEFAULT_READ_QUARANTINE_S,
)
from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, XferStatus, is_retryable
from kvhandoff.protocol.ec_wire import XferAck, XferDone, XferReq

__all__ = [
    "CONSUMER_READ_KIND",
    "DEFAULT_MAX_NOT_READY_RETRIES",
    "EC_CONSUMER_READ",
    "IN_FLIGHT_STATES",
    "FallBackLocal",
    "IssueRead",
    "ReadCtx",
    "RetryNextStep",
    "SendXferDone",
    "SendXferReq",
]

CONSUMER_READ_KIND = "ec.consumer_read"
DEFAULT_MAX_NOT_READY_RETRIES = 1000.0
IN_FLIGHT_STATES = frozenset({"needed", "xfer_req_sent", "retry_next_step", "reading"})
"""States in which requests wait for the read."""


@dataclass(slots=True)
class ReadCtx:
    """Where to read from, where to read into, and who is asking."""

    peer_host: str = ""
    peer_port: int = 0
    size_bytes: int = 0
    dest_blocks: tuple[int, ...] = ()
    compat_hash: str = ""
    engine_id: str = ""
    agent_name: str = ""
    id_prefix: str = ""
    attempt: int = 0
    not_ready: int = 0
    transfer_id: str = ""
    grant: XferAck | None = None
    reason: str = ""

    def request(self, mm_hash: str) -> XferReq:
        """The `XferReq` of the current attempt."""
        return XferReq(
            version=EC_CONNECTOR_VERSION,
            transfer_id=self.transfer_id,
            mm_hash=mm_hash,
            compat_hash=self.compat_hash,
            consumer_engine_id=self.engine_id,
            consumer_agent_name=self.agent_name,
            num_blocks=len(self.dest_blocks),
            size_bytes=self.size_bytes,
        )


@dataclass(frozen=True, slots=True)
class SendXferReq:
    """ZMQ adapter: send `req` on the DEALER of producer `peer_host:peer_port`; report
    `on_xfer_ack` for its answer and `on_peer_disconnected` if the peer goes away."""

    peer_host: str
    peer_port: int
    req: XferReq


@dataclass(frozen=True, slots=True)
class IssueRead:
    """NIXL adapter: load `producer_agent_metadata` if this agent is new or changed, READ
    `src_blocks` of the producer's region into `dst_blocks` of ours, then report
    `on_read_done(mm_hash, transfer_id)` or `on_read_failed(mm_hash, transfer_id)`."""

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


@dataclass(frozen=True, slots=True)
class SendXferDone:
    """ZMQ adapter: tell the producer a grant is finished with (`done.ok`)."""

    peer_host: str
    peer_port: int
    done: XferDone


@dataclass(frozen=True, slots=True)
class FallBackLocal:
    """The scheduler itself: requests waiting for `mm_hash` encode it locally."""

    mm_hash: str
    reason: str


@dataclass(frozen=True, slots=True)
class RetryNextStep:
    """The scheduler itself: `send` again at the next scheduler step."""

    mm_hash: str


# -- guards --------------------------------------------------------------------------


def _granted(inst: Any, ack: XferAck) -> bool:
    return ack.status is XferStatus.OK


def _may_retry(inst: Any, ack: XferAck) -> bool:
    limit = inst.machine.config["consumer_max_not_ready_retries"]
    return is_retryable(ack.status) and inst.ctx.not_ready < limit


# -- actions -------------------------------------------------------------------------


def _send(inst: Any, payload: Any) -> list[object]:
    ctx = inst.ctx
    ctx.attempt += 1
    ctx.transfer_id = f"{ctx.id_prefix}{ctx.attempt}"
    return [SendXferReq(ctx.peer_host, ctx.peer_port, ctx.request(inst.key))]


def _start_read(inst: Any, ack: XferAck) -> list[object]:
    ctx = inst.ctx
    ctx.grant = ack
    return [
        IssueRead(
            mm_hash=inst.key,
            transfer_id=ctx.transfer_id,
            peer_host=ctx.peer_host,
            peer_port=ctx.peer_port,
            producer_agent_name=ack.producer_agent_name,
            producer_agent_metadata=ack.producer_agent_metadata,
            remote_base_addr=ack.region_base_addr,
            src_blocks=tuple(ack.block_indices),
            dst_blocks=ctx.dest_blocks,
            block_size_bytes=ack.block_size_bytes,
            size_bytes=ack.size_bytes,
        )
    ]


def _retry(inst: Any, ack: XferAck) -> list[object]:
    inst.ctx.not_ready += 1
    return [RetryNextStep(inst.key), Metric("ec.consumer.not_ready")]


def _done_msg(inst: Any, ok: bool) -> SendXferDone:
    ctx = inst.ctx
    done = XferDone(
        version=EC_CONNECTOR_VERSION, transfer_id=ctx.transfer_id, mm_hash=inst.key, ok=ok
    )
    return SendXferDone(ctx.peer_host, ctx.peer_port, done)


def _fall_back(inst: Any, reason: str, *, keep_blocks: bool = False) -> list[object]:
    inst.ctx.reason = reason
    effects: list[object] = [FallBackLocal(inst.key, reason), Metric(f"ec.consumer.{reason}")]
    if not keep_blocks:
        effects.insert(0, Emit(ENTRY_KIND, inst.key, "discard"))
    return effects


def _nacked(inst: Any, ack: XferAck) -> list[object]:
    return _fall_back(inst, str(ack.status))


def _ack_timed_out(inst: Any, payload: Any) -> list[object]:
    return _fall_back(inst, "ack_timeout")


def _disconnected(inst: Any, payload: Any) -> list[object]:
    return _fall_back(inst, "peer_disconnected")


def _read_done(inst: Any, payload: Any) -> list[object]:
    return [Emit(ENTRY_KIND, inst.key, "saved"), _done_msg(inst, True), Metric("ec.consumer.read")]


def _read_failed(inst: Any, payload: Any) -> list[object]:
    return [_done_msg(inst, False), *_fall_back(inst, "read_failed")]


def _quarantine(inst: Any, reason: str) -> list[object]:
    return [_done_msg(inst, False), *_fall_back(inst, reason, keep_blocks=True)]


def _read_timed_out(inst: Any, payload: Any) -> list[object]:
    return _quarantine(inst, "read_timeout")


def _disconnected_reading(inst: Any, payload: Any) -> list[object]:
    return _quarantine(inst, "peer_disconnected")


def _release(inst: Any, payload: Any) -> list[object]:
    return [Emit(ENTRY_KIND, inst.key, "discard")]


EC_CONSUMER_READ = Declaration(
    name=CONSUMER_READ_KIND,
    description=(
        "Consumer pull of one encoding (R-E07, R-E08, R-E12, B-04): XferReq, then NIXL "
        "READ on OK. NACK_NOT_READY retries next step keeping the destination reserved; "
        "any other NACK, ack timeout or disconnect falls back to local encoding; a READ "
        "timeout quarantines the destination (not evicted) while the request falls back."
    ),
    states=[
        "needed",
        {
            "name": "xfer_req_sent",
            "timeout": Timeout(
                "consumer_ack_timeout_s", "fallback_local", "ack_timeout", action="ack_timed_out"
            ),
        },
        "retry_next_step",
        {
            "name": "reading",
            "timeout": Timeout(
                "nixl_read_timeout_s", "quarantined", "read_timeout", action="read_timed_out"
            ),
        },
        {
            "name": "quarantined",
            "timeout": Timeout(
                "read_quarantine_s", "released", "quarantine_over", action="release"
            ),
        },
        {"name": "done", "final": True},
        {"name": "fallback_local", "final": True},
        {"name": "released", "final": True},
    ],
    initial="needed",
    transitions=[
        {
            "trigger": "send",
            "source": ["needed", "retry_next_step"],
            "dest": "xfer_req_sent",
            "after": "send",
        },
        {
            "trigger": "ack",
            "source": "xfer_req_sent",
            "dest": "reading",
            "conditions": "granted",
            "after": "start_read",
        },
        {
            "trigger": "ack",
            "source": "xfer_req_sent",
            "dest": "retry_next_step",
            "conditions": "may_retry",
            "after": "retry",
        },
        {"trigger": "ack", "source": "xfer_req_sent", "dest": "fallback_local", "after": "nacked"},
        {
            "trigger": "peer_disconnected",
            "source": ["needed", "xfer_req_sent", "retry_next_step"],
            "dest": "fallback_local",
            "after": "disconnected",
        },
        {"trigger": "read_done", "source": "reading", "dest": "done", "after": "read_done"},
        {
            "trigger": "read_failed",
            "source": "reading",
            "dest": "fallback_local",
            "after": "read_failed",
        },
        {
            "trigger": "peer_disconnected",
            "source": "reading",
            "dest": "quarantined",
            "after": "disconnected_reading",
        },
    ],
    ignore=[
        ("quarantined", "read_done"),
        ("quarantined", "read_failed"),
        ("quarantined", "peer_disconnected"),
    ],
    callbacks={
        "granted": _granted,
        "may_retry": _may_retry,
        "send": _send,
        "start_read": _start_read,
        "retry": _retry,
        "nacked": _nacked,
        "ack_timed_out": _ack_timed_out,
        "disconnected": _disconnected,
        "read_done": _read_done,
        "read_failed": _read_failed,
        "read_timed_out": _read_timed_out,
        "disconnected_reading": _disconnected_reading,
        "release": _release,
    },
    config_defaults={
        "consumer_ack_timeout_s": DEFAULT_CONSUMER_ACK_TIMEOUT_S,
        "nixl_read_timeout_s": DEFAULT_NIXL_READ_TIMEOUT_S,
        "read_quarantine_s": DEFAULT_READ_QUARANTINE_S,
        "consumer_max_not_ready_retries": DEFAULT_MAX_NOT_READY_RETRIES,
    },
    context=ReadCtx,
)
