"""Consumer read: pulling one encoding from a producer's CPU tier (R-E07, R-E08, R-E12, B-04).

Keyed by `mm_hash`: every request of this consumer that waits for the same encoding
waits on the same read, as one of its `waiters` (`ec.settlement` keys; `join` and
`leave` while it is in flight). Before the read is created the consumer reserved
destination blocks for it (an `allocated` `ec.cache_entry` of origin `"read"`), after
checking the announced size against the request and the layout (S-04).

- `send(transfer_id, at)`: `needed -> xfer_req_sent`, a `SendXferReq` over the consumer's
  one ZMQ DEALER per producer peer. Each attempt carries a fresh, random transfer id the
  scheduler drew (S-02: nobody can guess it); the ids of earlier attempts are kept, so
  their late answers are recognised as stale.
- `ack` with `OK`: `xfer_req_sent -> reading`, an `IssueRead` of the granted source
  blocks into the reserved destination with NIXL READ (consumer-initiated; the producer
  never pushes, R-E11). The ack carries the producer's NIXL agent metadata, so a
  restarted producer is read without another handshake. (The scheduler only delivers an
  ack from the peer the request went to, for the current transfer id.)
- `ack` with a NACK in `RETRYABLE_NACKS` (only `NACK_NOT_READY`): `-> retry_next_step`;
  no failure is recorded and the destination blocks stay reserved (B-04: the seed
  released them and reallocated next step, evicting a ready entry per step). The next
  scheduler step `send`s again. Beyond the seed the retries are bounded by count
  (`consumer_max_not_ready_retries`) and by time (`consumer_not_ready_timeout_s` since
  the first `XferReq`); past either the last NACK_NOT_READY falls back. The time budget is
  checked at each step too: a retry due after it falls back (`not_ready_timeout`) instead
  of asking again.
- any other NACK, `ack_timeout` (after `consumer_ack_timeout_s`, 2 s), or
  `peer_disconnected` before the READ: `-> fallback_local`; the destination is discarded
  and every waiter encodes locally (`read_fell_back`).
- `read_done`: `reading -> done`; the entry becomes ready, the waiters hold it, and
  `SendXferDone(ok=True)` lets the producer unpin at once. `read_failed`: `->
  fallback_local` with `SendXferDone(ok=False)`. `XferDone` is sent only to a producer
  that advertised it in its ack (C-04).
- `read_timeout` (after `nixl_read_timeout_s`, 20 s) or `peer_disconnected` while
  reading: `-> quarantined`. The waiters fall back at once, but a DMA in flight cannot
  be interrupted, so the destination stays reserved, never evicted:
  - as soon as the READ completes or fails (`read_done`/`read_failed`, reported once the
    adapter released its handle) the destination is freed (`-> released`);
  - after `read_quarantine_s` (60 s) the read asks the adapter to release the READ's
    handle (`ReleaseRead`, which cancels the DMA) and frees the destination only when
    the adapter confirms (`read_released`): never before the handle is released.

No state waits on anything but a declared timeout, the next scheduler step, or the
adapter's answer to `ReleaseRead`, so P2P failure never blocks a request indefinitely.

The acks, READ completions and disconnects are peer events: one that a state does not
declare is a `RemoteProtocolError` that changes nothing. Tags: `in_flight` (requests wait
for the read), `awaiting_ack` (an ack of the current attempt is expected),
`retry_pending` (the next step sends again), `read_posted` (a READ may still complete),
`read_awaited` (a READ is posted and still wanted), `timed_wait` (the state waits on a
declared timeout); on the final states: `landed`, `fell_back`, `quarantine_ended`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.consumer_read_effects import (
    Ack,
    AckTimeout,
    IssueRead,
    QuarantineOver,
    ReadDone,
    ReadFailed,
    ReadReleased,
    ReadTimeout,
    ReleaseRead,
    SendXferDone,
    SendXferReq,
)
from kvhandoff.machines.ec.events import (
    Discard,
    PeerDisconnected,
    ReadFellBack,
    ReadLanded,
    Saved,
)
from kvhandoff.machines.ec.settlement import EC_SETTLEMENT, SettlementKey
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Emit, Metric
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.ec_config import (
    DEFAULT_CONSUMER_ACK_TIMEOUT_S,
    DEFAULT_NIXL_READ_TIMEOUT_S,
    DEFAULT_NOT_READY_TIMEOUT_S,
    DEFAULT_READ_QUARANTINE_S,
)
from kvhandoff.protocol.ec_status import (
    EC_CONNECTOR_VERSION,
    EXTENSIONS,
    XFER_DONE,
    XferStatus,
    is_retryable,
)
from kvhandoff.protocol.ec_wire import XferAck, XferDone, XferReq, read_notif

__all__ = [
    "DEFAULT_MAX_NOT_READY_RETRIES",
    "EC_CONSUMER_READ",
    "Ack",
    "AckTimeout",
    "IssueRead",
    "Join",
    "Leave",
    "QuarantineOver",
    "ReadCtx",
    "ReadDone",
    "ReadFailed",
    "ReadReleased",
    "ReadTimeout",
    "ReleaseRead",
    "Send",
    "SendXferDone",
    "SendXferReq",
]

DEFAULT_MAX_NOT_READY_RETRIES = 1000.0

MAX_PAST_IDS = 64
"""Transfer ids of earlier attempts remembered (their late acks are stale, not foreign)."""


@dataclass(slots=True)
class ReadCtx:
    """Where to read from, where to read into, who is asking, and who waits."""

    key: str
    """The `mm_hash` read."""
    peer_host: str = ""
    peer_port: int = 0
    size_bytes: int = 0
    dest_blocks: tuple[int, ...] = ()
    compat_hash: str = ""
    engine_id: str = ""
    agent_name: str = ""
    session_id: str = ""
    """This consumer's session: names the grant on the producer and the READ's notif."""
    max_not_ready: float = DEFAULT_MAX_NOT_READY_RETRIES
    """How many NACK_NOT_READY answers are retried (`consumer_max_not_ready_retries`)."""
    not_ready_s: float = DEFAULT_NOT_READY_TIMEOUT_S
    """For how long after the first `XferReq` they are (`consumer_not_ready_timeout_s`)."""
    waiters: set[SettlementKey] = field(default_factory=set)
    attempt: int = 0
    not_ready: int = 0
    first_sent_at: float = 0.0
    transfer_id: str = ""
    past_ids: list[str] = field(default_factory=list)
    grant: XferAck | None = None
    xfer_done: bool = False
    """The producer advertised `xfer_done` in its grant (C-04)."""
    reason: str = ""

    @property
    def peer(self) -> str:
        """The producer's side channel, `host:port`: the only peer whose acks count."""
        return f"{self.peer_host}:{self.peer_port}"

    def request(self) -> XferReq:
        """The `XferReq` of the current attempt."""
        return XferReq(
            mm_hash=self.key,
            compat_hash=self.compat_hash,
            session_id=self.session_id,
            version=EC_CONNECTOR_VERSION,
            transfer_id=self.transfer_id,
            consumer_engine_id=self.engine_id,
            consumer_agent_name=self.agent_name,
            num_blocks=len(self.dest_blocks),
            size_bytes=self.size_bytes,
            extensions=EXTENSIONS,
        )


# -- events ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send(Event):
    """Ask the producer (again) at `at`: a fresh attempt under `transfer_id`."""

    transfer_id: str
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Join(Event):
    """Settlement `waiter` waits for this read too."""

    waiter: SettlementKey


@dataclass(frozen=True, slots=True)
class Leave(Event):
    """Settlement `waiter` no longer waits (its request finished)."""

    waiter: SettlementKey


# -- guards --------------------------------------------------------------------------


def _granted(ctx: ReadCtx, event: Ack) -> bool:
    return event.ack.status is XferStatus.OK


def _may_retry(ctx: ReadCtx, event: Ack) -> bool:
    return (
        is_retryable(event.ack.status)
        and ctx.not_ready < ctx.max_not_ready
        and event.at - ctx.first_sent_at < ctx.not_ready_s
    )


def _not_ready_budget_spent(ctx: ReadCtx, event: Send) -> bool:
    return event.at - ctx.first_sent_at >= ctx.not_ready_s


# -- actions -------------------------------------------------------------------------


def _send(ctx: ReadCtx, event: Send) -> list[Effect]:
    if ctx.attempt == 0:
        ctx.first_sent_at = event.at
    elif ctx.transfer_id:
        ctx.past_ids.append(ctx.transfer_id)
        del ctx.past_ids[:-MAX_PAST_IDS]
    ctx.attempt += 1
    ctx.transfer_id = event.transfer_id
    return [SendXferReq(ctx.peer_host, ctx.peer_port, ctx.request())]


def _join(ctx: ReadCtx, event: Join) -> None:
    ctx.waiters.add(event.waiter)


def _leave(ctx: ReadCtx, event: Leave) -> None:
    ctx.waiters.discard(event.waiter)


def _start_read(ctx: ReadCtx, event: Ack) -> list[Effect]:
    ack = ctx.grant = event.ack
    ctx.xfer_done = XFER_DONE in ack.extensions
    # C-03 / C-04: a producer that speaks XferDone is told with it; any other (a stock
    # vLLM producer) learns of the READ from its notif, which releases the grant there.
    notif = b"" if ctx.xfer_done or not ctx.session_id else read_notif(ctx.session_id, ctx.key)
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
            size_bytes=ack.size_bytes or ctx.size_bytes,
            notif=notif,
        )
    ]


def _retry(ctx: ReadCtx, event: Ack) -> list[Effect]:
    ctx.not_ready += 1
    return [Metric("ec.consumer.not_ready")]


def _done_msg(ctx: ReadCtx, ok: bool) -> list[Effect]:
    if not ctx.xfer_done:
        return []  # the producer does not speak XferDone: its pin lease ends the grant
    done = XferDone(mm_hash=ctx.key, transfer_id=ctx.transfer_id, ok=ok, session_id=ctx.session_id)
    return [SendXferDone(ctx.peer_host, ctx.peer_port, done)]


def _tell_waiters(ctx: ReadCtx, event: Event) -> list[Effect]:
    waiters, ctx.waiters = sorted(ctx.waiters), set()
    return [Emit(EC_SETTLEMENT, waiter, event) for waiter in waiters]


def _fall_back(ctx: ReadCtx, reason: str, *, keep_blocks: bool = False) -> list[Effect]:
    ctx.reason = reason
    effects: list[Effect] = [] if keep_blocks else [Emit(EC_CACHE_ENTRY, ctx.key, Discard())]
    effects += _tell_waiters(ctx, ReadFellBack(reason))
    effects.append(Metric(f"ec.consumer.{reason}"))
    return effects


def _nacked(ctx: ReadCtx, event: Ack) -> list[Effect]:
    return _fall_back(ctx, str(event.ack.status))


def _not_ready_expired(ctx: ReadCtx, event: Send) -> list[Effect]:
    return _fall_back(ctx, "not_ready_timeout")


def _ack_timed_out(ctx: ReadCtx, event: AckTimeout) -> list[Effect]:
    return _fall_back(ctx, "ack_timeout")


def _disconnected(ctx: ReadCtx, event: PeerDisconnected) -> list[Effect]:
    return _fall_back(ctx, "peer_disconnected")


def _read_done(ctx: ReadCtx, event: ReadDone) -> list[Effect]:
    return [
        Emit(EC_CACHE_ENTRY, ctx.key, Saved()),
        *_tell_waiters(ctx, ReadLanded()),
        *_done_msg(ctx, True),
        Metric("ec.consumer.read"),
    ]


def _read_failed(ctx: ReadCtx, event: ReadFailed) -> list[Effect]:
    return [*_done_msg(ctx, False), *_fall_back(ctx, "read_failed")]


def quarantine(ctx: ReadCtx, reason: str) -> list[Effect]:
    """The READ may still land: fall back, but keep the destination reserved."""
    return [*_done_msg(ctx, False), *_fall_back(ctx, reason, keep_blocks=True)]


def _read_timed_out(ctx: ReadCtx, event: ReadTimeout) -> list[Effect]:
    return quarantine(ctx, "read_timeout")


def _disconnected_reading(ctx: ReadCtx, event: PeerDisconnected) -> list[Effect]:
    return quarantine(ctx, "peer_disconnected")


def _release_handle(ctx: ReadCtx, event: QuarantineOver) -> list[Effect]:
    return [ReleaseRead(ctx.key, ctx.transfer_id)]


def _free_destination(ctx: ReadCtx, event: ReadDone | ReadFailed | ReadReleased) -> list[Effect]:
    return [Emit(EC_CACHE_ENTRY, ctx.key, Discard()), Metric("ec.consumer.quarantine_freed")]


_IN_FLIGHT = ["needed", "xfer_req_sent", "retry_next_step", "reading"]

EC_CONSUMER_READ: Declaration[ReadCtx] = Declaration(
    name="ec.consumer_read",
    context=ReadCtx,
    description=(
        "Consumer pull of one encoding (R-E07, R-E08, R-E12, B-04): XferReq under a random "
        "transfer id, then NIXL READ on OK. NACK_NOT_READY retries next step keeping the "
        "destination reserved, bounded by count and time; any other NACK, ack timeout or "
        "disconnect falls back to local encoding; a READ timeout quarantines the "
        "destination until the DMA ends or its handle is released."
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
            "timeout": Timeout(
                "read_quarantine_s", "releasing", QuarantineOver, action="release_handle"
            ),
        },
        {"name": "releasing", "tags": ("read_posted",)},
        {"name": "done", "final": True, "tags": ("landed",)},
        {"name": "fallback_local", "final": True, "tags": ("fell_back",)},
        {"name": "released", "final": True, "tags": ("quarantine_ended",)},
    ],
    initial="needed",
    transitions=[
        {
            "trigger": Send,
            "source": "retry_next_step",
            "dest": "fallback_local",
            "conditions": "not_ready_budget_spent",
            "after": "not_ready_expired",
        },
        {
            "trigger": Send,
            "source": ["needed", "retry_next_step"],
            "dest": "xfer_req_sent",
            "after": "send",
        },
        {"trigger": Join, "source": _IN_FLIGHT, "dest": None, "after": "join"},
        {"trigger": Leave, "source": _IN_FLIGHT, "dest": None, "after": "leave"},
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
        {
            "trigger": ReadDone,
            "source": ["quarantined", "releasing"],
            "dest": "released",
            "after": "free_destination",
        },
        {
            "trigger": ReadFailed,
            "source": ["quarantined", "releasing"],
            "dest": "released",
            "after": "free_destination",
        },
        {
            "trigger": ReadReleased,
            "source": "releasing",
            "dest": "released",
            "after": "free_destination",
        },
    ],
    ignore=[("quarantined", PeerDisconnected), ("releasing", PeerDisconnected)],
    callbacks={
        "granted": _granted,
        "may_retry": _may_retry,
        "not_ready_budget_spent": _not_ready_budget_spent,
        "not_ready_expired": _not_ready_expired,
        "send": _send,
        "join": _join,
        "leave": _leave,
        "start_read": _start_read,
        "retry": _retry,
        "nacked": _nacked,
        "ack_timed_out": _ack_timed_out,
        "disconnected": _disconnected,
        "read_done": _read_done,
        "read_failed": _read_failed,
        "read_timed_out": _read_timed_out,
        "disconnected_reading": _disconnected_reading,
        "release_handle": _release_handle,
        "free_destination": _free_destination,
    },
    config_defaults={
        "consumer_ack_timeout_s": DEFAULT_CONSUMER_ACK_TIMEOUT_S,
        "nixl_read_timeout_s": DEFAULT_NIXL_READ_TIMEOUT_S,
        "read_quarantine_s": DEFAULT_READ_QUARANTINE_S,
        "consumer_max_not_ready_retries": DEFAULT_MAX_NOT_READY_RETRIES,
        "consumer_not_ready_timeout_s": DEFAULT_NOT_READY_TIMEOUT_S,
    },
)
