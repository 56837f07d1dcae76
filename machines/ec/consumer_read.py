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
  (machine config, copied into each read's `max_not_ready`) bounds the retries; the last
  NACK_NOT_READY then falls back.
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

The acks, READ completions and disconnects are peer events: one that a state does not
declare is a `RemoteProtocolError` that changes nothing. Tags: `in_flight` (requests wait
for the read), `awaiting_ack` (an ack of the current attempt is expected),
`retry_pending` (the next step sends again), `read_posted` (a READ may still complete),
`read_awaited` (a READ is posted and still wanted), `timed_wait` (the state waits on a
declared timeout); on the final states: `landed`, `fell_back`, `quarantine_ended`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.events import Discard, PeerDisconnected, Saved
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Emit, Metric
from kvhandoff.machines.runtime.events import Event, PeerEvent
from kvhandoff.protocol.ec_config import (
    DEFAULT_CONSUMER_ACK_TIMEOUT_S,
    DEFAULT_NIXL_READ_TIMEOUT_S,
    DEFAULT_READ_QUARANTINE_S,
)
from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, XferStatus, is_retryable
from kvhandoff.protocol.ec_wire import XferAck, XferDone, XferReq

__all__ = [
    "DEFAULT_MAX_NOT_READY_RETRIES",
    "EC_CONSUMER_READ",
    "Ack",
    "AckTimeout",
    "FallBackLocal",
    "IssueRead",
    "QuarantineOver",
    "ReadCtx",
    "ReadDone",
    "ReadFailed",
    "ReadTimeout",
    "RetryNextStep",
    "Send",
    "SendXferDone",
    "SendXferReq",
]

DEFAULT_MAX_NOT_READY_RETRIES = 1000.0


@dataclass(slots=True)
class ReadCtx:
    """Where to read from, where to read into, and who is asking."""

    key: str
    """The `mm_hash` read."""
    peer_host: str = ""
    peer_port: int = 0
    size_bytes: int = 0
    dest_blocks: tuple[int, ...] = ()
    compat_hash: str = ""
    engine_id: str = ""
    agent_name: str = ""
    id_prefix: str = ""
    max_not_ready: float = DEFAULT_MAX_NOT_READY_RETRIES
    """How many NACK_NOT_READY answers are retried (`consumer_max_not_ready_retries`)."""
    attempt: int = 0
    not_ready: int = 0
    transfer_id: str = ""
    grant: XferAck | None = None
    reason: str = ""

    def request(self) -> XferReq:
        """The `XferReq` of the current attempt."""
        return XferReq(
            version=EC_CONNECTOR_VERSION,
            transfer_id=self.transfer_id,
            mm_hash=self.key,
            compat_hash=self.compat_hash,
            consumer_engine_id=self.engine_id,
            consumer_agent_name=self.agent_name,
            num_blocks=len(self.dest_blocks),
            size_bytes=self.size_bytes,
        )


# -- events ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send(Event):
    """Ask the producer (again): a fresh attempt with a fresh `transfer_id`."""


@dataclass(frozen=True, slots=True)
class Ack(PeerEvent):
    """The producer's answer to the current attempt (already checked against it)."""

    ack: XferAck


@dataclass(frozen=True, slots=True)
class ReadDone(PeerEvent):
    """NIXL: the READ of the current attempt completed."""


@dataclass(frozen=True, slots=True)
class ReadFailed(PeerEvent):
    """NIXL: the READ of the current attempt failed."""


@dataclass(frozen=True, slots=True)
class AckTimeout(Event):
    """No ack within `consumer_ack_timeout_s`."""


@dataclass(frozen=True, slots=True)
class ReadTimeout(Event):
    """The READ did not complete within `nixl_read_timeout_s`."""


@dataclass(frozen=True, slots=True)
class QuarantineOver(Event):
    """`read_quarantine_s` passed: no DMA can land in the destination any more."""


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
    """NIXL adapter: load `producer_agent_metadata` if this agent is new or changed, READ
    `src_blocks` of the producer's region into `dst_blocks` of ours, then report
    `on_read_done(mm_hash, transfer_id, now)` or `on_read_failed(...)`."""

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
class SendXferDone(Effect):
    """ZMQ adapter: tell the producer a grant is finished with (`done.ok`)."""

    peer_host: str
    peer_port: int
    done: XferDone


@dataclass(frozen=True, slots=True)
class FallBackLocal(Effect):
    """The scheduler itself: requests waiting for `mm_hash` encode it locally."""

    mm_hash: str
    reason: str


@dataclass(frozen=True, slots=True)
class RetryNextStep(Effect):
    """The scheduler itself: `send` again at the next scheduler step."""

    mm_hash: str


# -- guards --------------------------------------------------------------------------


def _granted(ctx: ReadCtx, event: Ack) -> bool:
    return event.ack.status is XferStatus.OK


def _may_retry(ctx: ReadCtx, event: Ack) -> bool:
    return is_retryable(event.ack.status) and ctx.not_ready < ctx.max_not_ready


# -- actions -------------------------------------------------------------------------


def _send(ctx: ReadCtx, event: Send) -> list[Effect]:
    ctx.attempt += 1
    ctx.transfer_id = f"{ctx.id_prefix}{ctx.attempt}"
    return [SendXferReq(ctx.peer_host, ctx.peer_port, ctx.request())]


def _start_read(ctx: ReadCtx, event: Ack) -> list[Effect]:
    ack = ctx.grant = event.ack
    return [
        IssueRead(
            mm_hash=ctx.key,
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


def _retry(ctx: ReadCtx, event: Ack) -> list[Effect]:
    ctx.not_ready += 1
    return [RetryNextStep(ctx.key), Metric("ec.consumer.not_ready")]


def _done_msg(ctx: ReadCtx, ok: bool) -> SendXferDone:
    done = XferDone(
        version=EC_CONNECTOR_VERSION, transfer_id=ctx.transfer_id, mm_hash=ctx.key, ok=ok
    )
    return SendXferDone(ctx.peer_host, ctx.peer_port, done)


def _fall_back(ctx: ReadCtx, reason: str, *, keep_blocks: bool = False) -> list[Effect]:
    ctx.reason = reason
    effects: list[Effect] = [FallBackLocal(ctx.key, reason), Metric(f"ec.consumer.{reason}")]
    if not keep_blocks:
        effects.insert(0, Emit(EC_CACHE_ENTRY, ctx.key, Discard()))
    return effects


def _nacked(ctx: ReadCtx, event: Ack) -> list[Effect]:
    return _fall_back(ctx, str(event.ack.status))


def _ack_timed_out(ctx: ReadCtx, event: AckTimeout) -> list[Effect]:
    return _fall_back(ctx, "ack_timeout")


def _disconnected(ctx: ReadCtx, event: PeerDisconnected) -> list[Effect]:
    return _fall_back(ctx, "peer_disconnected")


def _read_done(ctx: ReadCtx, event: ReadDone) -> list[Effect]:
    return [
        Emit(EC_CACHE_ENTRY, ctx.key, Saved()),
        _done_msg(ctx, True),
        Metric("ec.consumer.read"),
    ]


def _read_failed(ctx: ReadCtx, event: ReadFailed) -> list[Effect]:
    return [_done_msg(ctx, False), *_fall_back(ctx, "read_failed")]


def quarantine(ctx: ReadCtx, reason: str) -> list[Effect]:
    """The READ may still land: fall back, but keep the destination reserved."""
    return [_done_msg(ctx, False), *_fall_back(ctx, reason, keep_blocks=True)]


def _read_timed_out(ctx: ReadCtx, event: ReadTimeout) -> list[Effect]:
    return quarantine(ctx, "read_timeout")


def _disconnected_reading(ctx: ReadCtx, event: PeerDisconnected) -> list[Effect]:
    return quarantine(ctx, "peer_disconnected")


def _release(ctx: ReadCtx, event: QuarantineOver) -> list[Effect]:
    return [Emit(EC_CACHE_ENTRY, ctx.key, Discard())]


EC_CONSUMER_READ: Declaration[ReadCtx] = Declaration(
    name="ec.consumer_read",
    context=ReadCtx,
    description=(
        "Consumer pull of one encoding (R-E07, R-E08, R-E12, B-04): XferReq, then NIXL "
        "READ on OK. NACK_NOT_READY retries next step keeping the destination reserved; "
        "any other NACK, ack timeout or disconnect falls back to local encoding; a READ "
        "timeout quarantines the destination (not evicted) while the request falls back."
    ),
    states=[
        {"name": "needed", "tags": ("in_flight",)},
        {
            "name": "xfer_req_sent",
            "tags": ("in_flight", "awaiting_ack", "timed_wait"),
            "timeout": Timeout(
                "consumer_ack_timeout_s", "fallback_local", AckTimeout, action="ack_timed_out"
            ),
        },
        {"name": "retry_next_step", "tags": ("in_flight", "retry_pending")},
        {
            "name": "reading",
            "tags": ("in_flight", "read_posted", "read_awaited", "timed_wait"),
            "timeout": Timeout(
                "nixl_read_timeout_s", "quarantined", ReadTimeout, action="read_timed_out"
            ),
        },
        {
            "name": "quarantined",
            "tags": ("read_posted", "timed_wait"),
            "timeout": Timeout("read_quarantine_s", "released", QuarantineOver, action="release"),
        },
        {"name": "done", "final": True, "tags": ("landed",)},
        {"name": "fallback_local", "final": True, "tags": ("fell_back",)},
        {"name": "released", "final": True, "tags": ("quarantine_ended",)},
    ],
    initial="needed",
    transitions=[
        {
            "trigger": Send,
            "source": ["needed", "retry_next_step"],
            "dest": "xfer_req_sent",
            "after": "send",
        },
        {
            "trigger": Ack,
            "source": "xfer_req_sent",
            "dest": "reading",
            "conditions": "granted",
            "after": "start_read",
        },
        {
            "trigger": Ack,
            "source": "xfer_req_sent",
            "dest": "retry_next_step",
            "conditions": "may_retry",
            "after": "retry",
        },
        {"trigger": Ack, "source": "xfer_req_sent", "dest": "fallback_local", "after": "nacked"},
        {
            "trigger": PeerDisconnected,
            "source": ["needed", "xfer_req_sent", "retry_next_step"],
            "dest": "fallback_local",
            "after": "disconnected",
        },
        {"trigger": ReadDone, "source": "reading", "dest": "done", "after": "read_done"},
        {
            "trigger": ReadFailed,
            "source": "reading",
            "dest": "fallback_local",
            "after": "read_failed",
        },
        {
            "trigger": PeerDisconnected,
            "source": "reading",
            "dest": "quarantined",
            "after": "disconnected_reading",
        },
    ],
    ignore=[
        ("quarantined", ReadDone),
        ("quarantined", ReadFailed),
        ("quarantined", PeerDisconnected),
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
)
