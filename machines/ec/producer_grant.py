"""Producer grant: the producer's answer to one `XferReq` and the pin it holds (R-E09..R-E12).

Keyed by (peer, transfer_id): the consumer's ZMQ identity and the id it chose, so one
consumer can never release another's pin. The producer's scheduler creates a grant for
each decoded `XferReq` and delivers `Check`: the request and a snapshot of the local
entry it names. The guards are tried in order:

1. `wrong_version`: the request's connector version is not ours -> `NACK_VERSION`.
2. `incompatible`: its compatibility hash (engine version, model, dtype,
   block_size_bytes) differs from ours -> `NACK_INCOMPAT`.
2b. `anonymous`: it names neither a session nor a transfer id, so its grant could not be
   told from another consumer's -> `NACK_INTERNAL` (as vLLM 0.33).
3. `absent`: no entry for the `mm_hash`, or one of another size than the request says
   (a stock vLLM consumer says none) -> `NACK_MISSING`.
4. `not_ready`: the entry is allocated but its GPU->mmap save has not landed ->
   `NACK_NOT_READY` (the consumer retries next step).
5. `over_cap`: granting would make the asking consumer hold more than
   `producer_max_grants_per_peer` pins, the consumers of its host (its TCP peer address)
   more than `producer_max_grants_per_host`, or this producer more than
   `producer_max_grants` in all -> `NACK_INTERNAL` (S-03: one consumer cannot pin every
   entry, nor one host by opening many ZMQ identities; the consumer encodes locally).
6. `no_agent`: this producer has no NIXL agent registered yet -> `NACK_INTERNAL`.
7. otherwise `OK`: the entry is pinned and the ack names the source block indices, the
   region base address and the producer's NIXL agent metadata (R-E11).

Every answer is a `SendXferAck(peer, ack)` effect for the ZMQ ROUTER adapter. A granted
pin is held for `pin_lease_s` (30 s): `xfer_done` (a kvhandoff consumer's `XferDone`),
`read_notified` (the NIXL notif `<session_id>:<mm_hash>` a stock vLLM consumer's READ
carries, C-03) or `lease_expired` unpins it, whichever comes first, once. A disconnect
does not end a grant early (the peer's READ may still be in flight); the lease does. The
pins a consumer holds are its grants tagged `leased` (a declared query, no count kept
beside the machine), which the next `Check` carries (S-03).

`Check`, `XferDone` and `PeerDisconnected` are peer events: one a state does not declare
is a `RemoteProtocolError` that changes nothing. Tags: `leased` (granted: the entry is
pinned for the consumer until `XferDone` or the lease ends), `refused` (a NACK was sent).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.events import PeerDisconnected, Pin, Unpin
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Emit, Metric
from kvhandoff.machines.runtime.events import Event, PeerEvent
from kvhandoff.protocol.ec_config import DEFAULT_PIN_LEASE_S
from kvhandoff.protocol.ec_grants import grant_ack, nack
from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, XferStatus
from kvhandoff.protocol.ec_wire import XferAck, XferReq

__all__ = [
    "EC_PRODUCER_GRANT",
    "Check",
    "GrantCtx",
    "GrantKey",
    "LeaseExpired",
    "ReadNotified",
    "SendXferAck",
    "XferDone",
]

DEFAULT_MAX_GRANTS_PER_PEER = 256.0
"""Pins one consumer may hold on this producer at once (S-03)."""
DEFAULT_MAX_GRANTS_PER_HOST = 1024.0
"""Pins all consumers of one host (one peer address) may hold on this producer at once:
ZMQ identities are free, so one host cannot take the total cap with many (S-03)."""
DEFAULT_MAX_GRANTS = 4096.0
"""Pins all consumers together may hold on this producer at once (S-03)."""

GrantKey = tuple[bytes | str, str]
"""(the consumer's ZMQ identity, its `transfer_id`)."""


@dataclass(slots=True)
class GrantCtx:
    """Who asked, for what, and this producer's identity for the ack."""

    key: GrantKey
    peer: bytes | str = b""
    host: str = ""
    """The consumer's address as its TCP connection says ('' when unknown)."""
    mm_hash: str = ""
    agent_name: str = ""
    agent_metadata: bytes = b""
    region_base_addr: int = 0
    block_size_bytes: int = 0
    mem_descriptor: bytes = b""
    """The region as vLLM's per-block descriptor list, for stock consumers (C-03)."""
    notif_key: str = ""
    """`<session_id>:<mm_hash>`: the READ notif that releases this grant ('' without a
    session, and for a consumer that advertised `xfer_done`: it releases with `XferDone`
    only, S-02)."""
    notif_sender: str = ""
    """The NIXL agent the consumer announced (`consumer_agent_name`): its READ notif
    counts only from that agent ('' from a stock vLLM consumer, which announces none)."""
    lease_s: float = DEFAULT_PIN_LEASE_S
    """How long a granted pin is held (`pin_lease_s`), announced in the ack."""
    max_per_peer: float = DEFAULT_MAX_GRANTS_PER_PEER
    """`producer_max_grants_per_peer` (S-03)."""
    max_per_host: float = DEFAULT_MAX_GRANTS_PER_HOST
    """`producer_max_grants_per_host` (S-03)."""
    max_total: float = DEFAULT_MAX_GRANTS
    """`producer_max_grants` (S-03)."""


@dataclass(frozen=True, slots=True)
class Check(PeerEvent):
    """A decoded `XferReq` and a snapshot of the local entry it names."""

    req: XferReq
    expected_hash: str
    entry_present: bool = False
    entry_loadable: bool = False
    """The entry's bytes are in the tier (its save has landed)."""
    entry_blocks: tuple[int, ...] = ()
    entry_size_bytes: int = 0
    peer_grants: int = 0
    """Pins the asking consumer holds now."""
    host_grants: int = 0
    """Pins the consumers of the asking consumer's host hold now."""
    total_grants: int = 0
    """Pins every consumer holds now."""


@dataclass(frozen=True, slots=True)
class XferDone(PeerEvent):
    """The consumer is finished with the grant (`ok`: its READ completed)."""

    ok: bool = False


@dataclass(frozen=True, slots=True)
class ReadNotified(PeerEvent):
    """The consumer's READ of the grant arrived with its notif (a stock vLLM consumer's
    release, C-03)."""


@dataclass(frozen=True, slots=True)
class LeaseExpired(Event):
    """`pin_lease_s` passed without an `XferDone`."""


@dataclass(frozen=True, slots=True)
class SendXferAck(Effect):
    """ZMQ ROUTER adapter: send `ack` to the consumer identity `peer`."""

    peer: bytes | str
    ack: XferAck


def _wrong_version(ctx: GrantCtx, event: Check) -> bool:
    return event.req.version != EC_CONNECTOR_VERSION


def _incompatible(ctx: GrantCtx, event: Check) -> bool:
    return event.req.compat_hash != event.expected_hash


def _anonymous(ctx: GrantCtx, event: Check) -> bool:
    return not (event.req.session_id or event.req.transfer_id)


def _absent(ctx: GrantCtx, event: Check) -> bool:
    req = event.req
    if not event.entry_present:
        return True
    if req.size_bytes == 0:  # a stock consumer says no size: the entry is what it gets
        return False
    return event.entry_size_bytes != req.size_bytes or len(event.entry_blocks) != req.num_blocks


def _not_ready(ctx: GrantCtx, event: Check) -> bool:
    return not event.entry_loadable


def _over_cap(ctx: GrantCtx, event: Check) -> bool:
    return (
        event.peer_grants >= ctx.max_per_peer
        or event.host_grants >= ctx.max_per_host
        or event.total_grants >= ctx.max_total
    )


def _no_agent(ctx: GrantCtx, event: Check) -> bool:
    return not (ctx.agent_name and ctx.agent_metadata)


def _refuse(ctx: GrantCtx, event: Check, status: XferStatus) -> list[Effect]:
    ack = nack(event.req, status, producer_agent_name=ctx.agent_name)
    return [SendXferAck(ctx.peer, ack), Metric(f"ec.producer.{status}")]


def _nack_version(ctx: GrantCtx, event: Check) -> list[Effect]:
    return _refuse(ctx, event, XferStatus.NACK_VERSION)


def _nack_incompat(ctx: GrantCtx, event: Check) -> list[Effect]:
    return _refuse(ctx, event, XferStatus.NACK_INCOMPAT)


def _nack_missing(ctx: GrantCtx, event: Check) -> list[Effect]:
    return _refuse(ctx, event, XferStatus.NACK_MISSING)


def _nack_not_ready(ctx: GrantCtx, event: Check) -> list[Effect]:
    return _refuse(ctx, event, XferStatus.NACK_NOT_READY)


def _nack_internal(ctx: GrantCtx, event: Check) -> list[Effect]:
    return _refuse(ctx, event, XferStatus.NACK_INTERNAL)


def _nack_busy(ctx: GrantCtx, event: Check) -> list[Effect]:
    return [*_refuse(ctx, event, XferStatus.NACK_INTERNAL), Metric("ec.producer.over_cap")]


def _grant(ctx: GrantCtx, event: Check) -> list[Effect]:
    ack = grant_ack(
        event.req,
        producer_agent_name=ctx.agent_name,
        producer_agent_metadata=ctx.agent_metadata,
        block_indices=list(event.entry_blocks),
        block_size_bytes=ctx.block_size_bytes,
        size_bytes=event.entry_size_bytes,
        region_base_addr=ctx.region_base_addr,
        lease_s=ctx.lease_s,
        mem_descriptor=ctx.mem_descriptor,
    )
    return [
        Emit(EC_CACHE_ENTRY, ctx.mm_hash, Pin()),
        SendXferAck(ctx.peer, ack),
        Metric("ec.producer.OK"),
    ]


def _consumed(ctx: GrantCtx, event: XferDone) -> list[Effect]:
    return [Emit(EC_CACHE_ENTRY, ctx.mm_hash, Unpin(consumed=event.ok))]


def _notified(ctx: GrantCtx, event: ReadNotified) -> list[Effect]:
    return [Emit(EC_CACHE_ENTRY, ctx.mm_hash, Unpin(consumed=True)), Metric("ec.producer.notif")]


def _lease_expired(ctx: GrantCtx, event: LeaseExpired) -> list[Effect]:
    return [
        Emit(EC_CACHE_ENTRY, ctx.mm_hash, Unpin()),
        Metric("ec.producer.lease_expired"),
    ]


_REFUSALS = (
    ("wrong_version", "refused_version", "nack_version"),
    ("incompatible", "refused_incompat", "nack_incompat"),
    ("anonymous", "refused_internal", "nack_internal"),
    ("absent", "refused_missing", "nack_missing"),
    ("not_ready", "refused_not_ready", "nack_not_ready"),
    ("over_cap", "refused_busy", "nack_busy"),
    ("no_agent", "refused_internal", "nack_internal"),
)

EC_PRODUCER_GRANT: Declaration[GrantCtx] = Declaration(
    name="ec.producer_grant",
    context=GrantCtx,
    description=(
        "Producer answer to one XferReq (R-E09, R-E10, R-E12, S-03): version, then "
        "compatibility hash, then a session, then presence, then readiness, then the per-peer "
        "and total pin caps; OK pins the entry for a 30 s lease that XferDone, the READ's "
        "notif (C-03) or the lease expiry ends."
    ),
    states=[
        "received",
        {
            "name": "granted",
            "tags": ("leased",),
            "timeout": Timeout("pin_lease_s", "expired", LeaseExpired, action="unpin_expired"),
        },
        *(
            {"name": dest, "final": True, "tags": ("refused",)}
            for dest in dict.fromkeys(dest for _, dest, _ in _REFUSALS)
        ),
        {"name": "released", "final": True},
        {"name": "expired", "final": True},
    ],
    initial="received",
    transitions=[
        *(
            {
                "trigger": Check,
                "source": "received",
                "dest": dest,
                "conditions": guard,
                "after": action,
            }
            for guard, dest, action in _REFUSALS
        ),
        {"trigger": Check, "source": "received", "dest": "granted", "after": "grant"},
        {"trigger": XferDone, "source": "granted", "dest": "released", "after": "consumed"},
        {"trigger": ReadNotified, "source": "granted", "dest": "released", "after": "notified"},
    ],
    ignore=[("granted", PeerDisconnected)],
    callbacks={
        "wrong_version": _wrong_version,
        "incompatible": _incompatible,
        "anonymous": _anonymous,
        "absent": _absent,
        "not_ready": _not_ready,
        "over_cap": _over_cap,
        "no_agent": _no_agent,
        "nack_version": _nack_version,
        "nack_incompat": _nack_incompat,
        "nack_missing": _nack_missing,
        "nack_not_ready": _nack_not_ready,
        "nack_internal": _nack_internal,
        "nack_busy": _nack_busy,
        "grant": _grant,
        "consumed": _consumed,
        "notified": _notified,
        "unpin_expired": _lease_expired,
    },
    config_defaults={
        "pin_lease_s": DEFAULT_PIN_LEASE_S,
        "producer_max_grants_per_peer": DEFAULT_MAX_GRANTS_PER_PEER,
        "producer_max_grants_per_host": DEFAULT_MAX_GRANTS_PER_HOST,
        "producer_max_grants": DEFAULT_MAX_GRANTS,
    },
)
