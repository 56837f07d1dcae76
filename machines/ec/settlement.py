"""Settlement: how one request gets one of its encodings (R-E07, R-E08, B-04, B-05, S-04).

Keyed by (request id, `mm_hash`), on the consumer side. Every decision about where an
encoding comes from is a guarded transition here, taken on `Consider`: a snapshot of the
facts the scheduler sees at `now` (is the entry in the tier, is a read of it in flight,
is our own save landing, what did the producer publish). The guards are tried in order:

0. `computed`: the engine computed the positions of this input already
   (`num_computed_tokens` past it, as vLLM 0.33 checks): nothing is read or loaded ->
   `computed` (settled).
1. `loadable`: the bytes are in the tier -> `held` (the entry is pinned until the
   request's load is planned, so no eviction takes it in between).
2. `read_in_flight`: another request's read of it is on the way -> `awaiting_read`
   (joins that read as a waiter).
3. `own_save_pending`: our own encoder's save lands within a step or two ->
   `awaiting_save` (considered again at the next call).
4. `quarantined`: its blocks hold a timed-out READ's destination -> `local`.
5. `bad_size`: the size the publication announces does not match the request's own
   token count and the layout (S-04: checked before any reservation or eviction) ->
   `local`.
6. `readable`: published and P2P is on -> `awaiting_read`; the scheduler reserves a
   destination and starts a read with this settlement as its first waiter (`StartRead`),
   or answers `no_room`.
7. `published` without P2P, 8. `params_broken`, 9. `unservable`, 10. otherwise (not
   cached, not published): -> `local`, each with its reason.

From `awaiting_read` the read answers: `read_landed` -> `held`; `read_fell_back(reason)`
-> `local` (its reason: a NACK, an ack or READ timeout, a disconnect; a NACK_NOT_READY
only once its retries are spent, R-E08). `local` tells the request, which fails cleanly
instead when the media was rewritten to a metadata-only reference (B-05). `load` hands
the pin of `held` over to the load's transfer (`loading`). `release` (the request
finished or failed) lets go of whatever is held: the pin, or the place among a read's
waiters.

Tags: `unsettled` (not settled yet), `waiting` (the request must wait for it),
`settled`, `holds_pin` (held: this settlement owns a pin of the entry),
`encode_locally`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.events import Pin, ReadFellBack, ReadLanded, Unpin
from kvhandoff.machines.ec.request import EC_REQUEST, FallBack, Settled
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Emit
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.ec_publication import PublishedEncoding

__all__ = [
    "EC_SETTLEMENT",
    "Consider",
    "JoinRead",
    "LeaveRead",
    "Load",
    "NoRoom",
    "Release",
    "SettlementCtx",
    "SettlementKey",
    "StartRead",
]

SettlementKey = tuple[str, str]
"""(request id, `mm_hash`)."""


@dataclass(slots=True)
class SettlementCtx:
    key: SettlementKey
    reason: str = ""
    """Why it is encoded locally, once `local`."""
    transfer_id: int = 0
    """The load it was handed to, once `loading`."""

    @property
    def request_id(self) -> str:
        return self.key[0]

    @property
    def mm_hash(self) -> str:
        return self.key[1]


@dataclass(frozen=True, slots=True)
class Consider(Event):
    """What the scheduler sees of `mm_hash` at `now` (see the module docstring)."""

    computed: bool = False
    """The engine's computed tokens are past this input: it needs no encoding."""
    loadable: bool = False
    read_in_flight: bool = False
    own_save_pending: bool = False
    quarantined: bool = False
    size_problem: str = ""
    """Why the announced size is refused (S-04), or empty."""
    published: PublishedEncoding | None = None
    p2p: bool = False
    unservable: bool = False
    params_error: str = ""


@dataclass(frozen=True, slots=True)
class NoRoom(Event):
    """The tier could not reserve a destination for the read."""


@dataclass(frozen=True, slots=True)
class Load(Event):
    """The load of the held entry was planned: its transfer takes over the pin."""

    transfer_id: int


@dataclass(frozen=True, slots=True)
class Release(Event):
    """The request finished or failed: let go of what this settlement holds."""


@dataclass(frozen=True, slots=True)
class StartRead(Effect):
    """The scheduler: reserve a destination for `published` and start a consumer read of
    `mm_hash` whose first waiter is `waiter`; `NoRoom` to the waiter if it cannot."""

    waiter: SettlementKey
    mm_hash: str
    published: PublishedEncoding


@dataclass(frozen=True, slots=True)
class JoinRead(Effect):
    """The scheduler's P2P half: `waiter` waits for the read of `mm_hash` in flight."""

    mm_hash: str
    waiter: SettlementKey


@dataclass(frozen=True, slots=True)
class LeaveRead(Effect):
    """The scheduler's P2P half: `waiter` no longer waits for the read of `mm_hash`."""

    mm_hash: str
    waiter: SettlementKey


# -- guards ------------------------------------------------------------------------------


def _computed(ctx: SettlementCtx, event: Consider) -> bool:
    return event.computed


def _loadable(ctx: SettlementCtx, event: Consider) -> bool:
    return event.loadable


def _read_in_flight(ctx: SettlementCtx, event: Consider) -> bool:
    return event.read_in_flight


def _own_save_pending(ctx: SettlementCtx, event: Consider) -> bool:
    return event.own_save_pending


def _quarantined(ctx: SettlementCtx, event: Consider) -> bool:
    return event.quarantined


def _bad_size(ctx: SettlementCtx, event: Consider) -> bool:
    return event.published is not None and event.p2p and bool(event.size_problem)


def _readable(ctx: SettlementCtx, event: Consider) -> bool:
    return event.published is not None and event.p2p


def _published(ctx: SettlementCtx, event: Consider) -> bool:
    return event.published is not None


def _params_broken(ctx: SettlementCtx, event: Consider) -> bool:
    return bool(event.params_error)


def _unservable(ctx: SettlementCtx, event: Consider) -> bool:
    return event.unservable


# -- actions -----------------------------------------------------------------------------


def _hold(ctx: SettlementCtx, event: Consider | ReadLanded) -> list[Effect]:
    return [
        Emit(EC_CACHE_ENTRY, ctx.mm_hash, Pin()),
        Emit(EC_REQUEST, ctx.request_id, Settled(ctx.mm_hash)),
    ]


def _not_needed(ctx: SettlementCtx, event: Consider) -> list[Effect]:
    return [Emit(EC_REQUEST, ctx.request_id, Settled(ctx.mm_hash))]


def _join(ctx: SettlementCtx, event: Consider) -> list[Effect]:
    return [JoinRead(ctx.mm_hash, ctx.key)]


def _start_read(ctx: SettlementCtx, event: Consider) -> list[Effect]:
    assert event.published is not None  # the guard `readable`
    return [StartRead(ctx.key, ctx.mm_hash, event.published)]


def _local(ctx: SettlementCtx, reason: str) -> list[Effect]:
    ctx.reason = reason
    return [Emit(EC_REQUEST, ctx.request_id, FallBack(ctx.mm_hash, reason))]


def _local_quarantined(ctx: SettlementCtx, event: Consider) -> list[Effect]:
    return _local(ctx, "destination quarantined")


def _local_bad_size(ctx: SettlementCtx, event: Consider) -> list[Effect]:
    return _local(ctx, event.size_problem)


def _local_no_p2p(ctx: SettlementCtx, event: Consider) -> list[Effect]:
    return _local(ctx, "published, but P2P is off (ec_enable_nixl)")


def _local_bad_params(ctx: SettlementCtx, event: Consider) -> list[Effect]:
    return _local(ctx, event.params_error)


def _local_unservable(ctx: SettlementCtx, event: Consider) -> list[Effect]:
    return _local(ctx, "published as unservable")


def _local_unknown(ctx: SettlementCtx, event: Consider) -> list[Effect]:
    return _local(ctx, "not cached and not published")


def _local_no_room(ctx: SettlementCtx, event: NoRoom) -> list[Effect]:
    return _local(ctx, "no room in the CPU tier for the read destination")


def _local_read_fell_back(ctx: SettlementCtx, event: ReadFellBack) -> list[Effect]:
    return _local(ctx, event.reason)


def _hand_over(ctx: SettlementCtx, event: Load) -> None:
    ctx.transfer_id = event.transfer_id


def _unpin(ctx: SettlementCtx, event: Release) -> list[Effect]:
    return [Emit(EC_CACHE_ENTRY, ctx.mm_hash, Unpin())]


def _leave(ctx: SettlementCtx, event: Release) -> list[Effect]:
    return [LeaveRead(ctx.mm_hash, ctx.key)]


_CONSIDER = ("new", "awaiting_save")

_LOCAL_ALTERNATIVES = (
    ("quarantined", "local_quarantined"),
    ("bad_size", "local_bad_size"),
)
_LATE_LOCAL_ALTERNATIVES = (
    ("published", "local_no_p2p"),
    ("params_broken", "local_bad_params"),
    ("unservable", "local_unservable"),
)

EC_SETTLEMENT: Declaration[SettlementCtx] = Declaration(
    name="ec.settlement",
    context=SettlementCtx,
    description=(
        "How one request gets one encoding (R-E07, R-E08, B-05, S-04): held in the tier, "
        "awaiting a read or its own save, or encoded locally with a reason; every choice "
        "a guarded transition on a snapshot of what the scheduler sees."
    ),
    states=[
        {"name": "new", "tags": ("unsettled",)},
        {"name": "awaiting_read", "tags": ("unsettled", "waiting")},
        {"name": "awaiting_save", "tags": ("unsettled", "waiting")},
        {"name": "computed", "tags": ("settled",)},
        {"name": "held", "tags": ("settled", "holds_pin")},
        {"name": "loading", "tags": ("settled",)},
        {"name": "local", "tags": ("settled", "encode_locally")},
        {"name": "released", "final": True},
    ],
    initial="new",
    transitions=[
        {
            "trigger": Consider,
            "source": _CONSIDER,
            "dest": "computed",
            "conditions": "computed",
            "after": "not_needed",
        },
        {
            "trigger": Consider,
            "source": _CONSIDER,
            "dest": "held",
            "conditions": "loadable",
            "after": "hold",
        },
        {
            "trigger": Consider,
            "source": _CONSIDER,
            "dest": "awaiting_read",
            "conditions": "read_in_flight",
            "after": "join",
        },
        {
            "trigger": Consider,
            "source": _CONSIDER,
            "dest": "awaiting_save",
            "conditions": "own_save_pending",
        },
        *(
            {
                "trigger": Consider,
                "source": _CONSIDER,
                "dest": "local",
                "conditions": guard,
                "after": action,
            }
            for guard, action in _LOCAL_ALTERNATIVES
        ),
        {
            "trigger": Consider,
            "source": _CONSIDER,
            "dest": "awaiting_read",
            "conditions": "readable",
            "after": "start_read",
        },
        *(
            {
                "trigger": Consider,
                "source": _CONSIDER,
                "dest": "local",
                "conditions": guard,
                "after": action,
            }
            for guard, action in _LATE_LOCAL_ALTERNATIVES
        ),
        {"trigger": Consider, "source": _CONSIDER, "dest": "local", "after": "local_unknown"},
        {"trigger": ReadLanded, "source": "awaiting_read", "dest": "held", "after": "hold"},
        {
            "trigger": ReadFellBack,
            "source": "awaiting_read",
            "dest": "local",
            "after": "local_read_fell_back",
        },
        {"trigger": NoRoom, "source": "awaiting_read", "dest": "local", "after": "local_no_room"},
        {"trigger": Load, "source": "held", "dest": "loading", "after": "hand_over"},
        {"trigger": Release, "source": "held", "dest": "released", "after": "unpin"},
        {"trigger": Release, "source": "awaiting_read", "dest": "released", "after": "leave"},
        {
            "trigger": Release,
            "source": ["new", "awaiting_save", "computed", "loading", "local"],
            "dest": "released",
        },
    ],
    ignore=[
        ("awaiting_read", Consider),
        ("computed", Consider),
        ("held", Consider),
        ("loading", Consider),
        ("local", Consider),
    ],
    callbacks={
        "computed": _computed,
        "not_needed": _not_needed,
        "loadable": _loadable,
        "read_in_flight": _read_in_flight,
        "own_save_pending": _own_save_pending,
        "quarantined": _quarantined,
        "bad_size": _bad_size,
        "readable": _readable,
        "published": _published,
        "params_broken": _params_broken,
        "unservable": _unservable,
        "hold": _hold,
        "join": _join,
        "start_read": _start_read,
        "local_quarantined": _local_quarantined,
        "local_bad_size": _local_bad_size,
        "local_no_p2p": _local_no_p2p,
        "local_bad_params": _local_bad_params,
        "local_unservable": _local_unservable,
        "local_unknown": _local_unknown,
        "local_no_room": _local_no_room,
        "local_read_fell_back": _local_read_fell_back,
        "hand_over": _hand_over,
        "unpin": _unpin,
        "leave": _leave,
    },
)
