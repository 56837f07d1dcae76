"""Match slot lifecycle: D's `PUSH_REG`s meet P's finished blocks (R-P04, R-P07, R-P09,
R-T03, R-T05, S-03).

One instance per base request id (the id without its engine's random suffix, which keeps
the completion index, R-P04), on a P worker rank's writer bus. Either side may arrive
first; the slot pairs them by exact D id within the base id, and pairs one attempt at a
time:

- `registering`: `PUSH_REG`s of D ranks wait for P's blocks, at most
  `pending_registration_ttl` (then `dropped`). Each D rank that this P rank writes into
  registers its own blocks (R-T03); a second `PUSH_REG` from a rank is a duplicate, one
  for another D request id of the same base replaces the waiting attempt (`superseded`).
- `staged`: P's blocks wait for the `PUSH_REG`s of every D rank they go to; meanwhile the
  writer self-polls (R-P07). A revoked lease (`Revoke`) ends the slot (`gone`).
- `matched`: every registration is in: the push goes to D's remote engine (handshake,
  then one WRITE per target rank) and the slot waits until it was issued; a revoked lease
  cancels a push still waiting for its handshake.
- `served`: a tombstone for `tombstone_ttl`, remembering the exact D ids it served, so a
  late duplicate `PUSH_REG` (network duplicate, slow D rank) is dropped instead of waiting
  to pair with a later attempt. A `PUSH_REG` with a new D id, or new P blocks, is a new
  attempt (a retry that reuses the base id after a failure is never swallowed).

Why this is its own machine and not a state of P's request (`push.p_lease`): it is keyed
differently, and it lives where its inputs do. A `PUSH_REG` names D's request id, and
may arrive before P's engine has the request at all (D registers while P prefills):
there is no P request id, no lease and no blocks to attach it to yet, only the base id
both engines' ids share (R-P04). One base id also sees several P attempts and D ids over
its life (a retry after a failure, a late duplicate after a push: the tombstone), while
a lease lives for one P request. And the slot is fed by `get_new_notifs`, which only the
writer thread calls (R-P08), while the lease is the main thread's (heartbeats, the
reaper, `finished_sending`, R-P11): the two talk through typed commands and reports.

Every registration held waiting is accounted (`HoldPending`) for the per-peer and total
caps (S-03); every drop is reported (`DroppedRegistration`). `RegArrived` comes from a
peer: one the slot's guards refuse (a registration that contradicts the other ranks' of
the same D request) is a `RemoteProtocolError` that changes nothing. Tags:
`pending_registration`, `awaiting_registration` (self-poll), `write_pending`, `tombstone`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.kv.effects import (
    CancelDeferred,
    DroppedRegistration,
    HoldPending,
    RankRegistration,
    ReplayPush,
    ReportToMain,
)
from kvhandoff.machines.kv.events import Matched, Revoked
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.machines.runtime.events import Event, PeerEvent
from kvhandoff.protocol.tp_mapping import target_ranks

_SERVED_KEPT = 8  # exact D ids a tombstone remembers


@dataclass(slots=True)
class MatchCtx:
    key: str
    p_tp: int = 1
    p_tp_rank: int = 0
    p_id: str = ""
    blocks: tuple[int, ...] = ()
    d_id: str = ""
    engine: str = ""
    """The D engine a matched push goes to."""
    push: ReplayPush | None = None
    """The push of the attempt, kept to tell D if its WRITEs fail later (B-10)."""
    regs: dict[int, RankRegistration] = field(default_factory=dict)
    served: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RegArrived(PeerEvent):
    """A D rank's `PUSH_REG` (validated against this engine) arrived."""

    reg: RankRegistration


@dataclass(frozen=True, slots=True)
class BlocksArrived(Event):
    """P's finished blocks of request `p_id` (`StageBlocks`)."""

    p_id: str
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Revoke(Event):
    """P's lease on `p_id` ran out: post nothing from it any more."""

    p_id: str


@dataclass(frozen=True, slots=True)
class Issued(Event):
    """The push of `p_id` was posted, failed to post, or failed its handshake."""

    p_id: str


@dataclass(frozen=True, slots=True)
class PendingExpired(Event):
    """The waiting `PUSH_REG`s outlived `pending_registration_ttl`."""


@dataclass(frozen=True, slots=True)
class TombstoneExpired(Event):
    """The tombstone outlived `tombstone_ttl`."""


def needed(ctx: MatchCtx, decode_tp_size: int) -> frozenset[int]:
    """The D ranks this P rank writes into (R-T03)."""
    return target_ranks(ctx.p_tp, ctx.p_tp_rank, decode_tp_size)


# -- guards ----------------------------------------------------------------------------


def held(ctx: MatchCtx, event: RegArrived) -> bool:
    reg = event.reg
    return reg.registration.request_id == ctx.d_id and reg.d_rank in ctx.regs


def seen(ctx: MatchCtx, event: RegArrived) -> bool:
    return event.reg.registration.request_id in ctx.served


def fits(ctx: MatchCtx, event: RegArrived) -> bool:
    return not ctx.d_id or event.reg.registration.request_id == ctx.d_id


def consistent(ctx: MatchCtx, event: RegArrived) -> bool:
    """Every D rank of one request registers the same engine, blocks and TP size."""
    new = event.reg.registration
    return all(
        (r.registration.decode_engine_id, r.registration.block_ids, r.registration.decode_tp_size)
        == (new.decode_engine_id, new.block_ids, new.decode_tp_size)
        for r in ctx.regs.values()
    )


def completes(ctx: MatchCtx, event: RegArrived) -> bool:
    reg = event.reg
    have = {*ctx.regs, reg.d_rank}
    return bool(ctx.p_id) and needed(ctx, reg.registration.decode_tp_size) <= have


def registered(ctx: MatchCtx, event: BlocksArrived) -> bool:
    if not ctx.regs:
        return False
    first = next(iter(ctx.regs.values()))
    return needed(ctx, first.registration.decode_tp_size) <= set(ctx.regs)


def own_attempt(ctx: MatchCtx, event: Revoke | Issued) -> bool:
    return event.p_id == ctx.p_id


# -- actions -------------------------------------------------------------------------------


def _hold(ctx: MatchCtx, reg: RankRegistration) -> list[Effect]:
    ctx.d_id = reg.registration.request_id
    ctx.regs[reg.d_rank] = reg
    return [HoldPending(reg.sender, len(reg.registration.block_ids), 1, reg.known)]


def _release(ctx: MatchCtx) -> list[Effect]:
    effects: list[Effect] = [
        HoldPending(r.sender, len(r.registration.block_ids), -1, r.known) for r in ctx.regs.values()
    ]
    ctx.regs = {}
    return effects


def _remember(ctx: MatchCtx) -> None:
    if ctx.d_id and ctx.d_id not in ctx.served:
        ctx.served = [*ctx.served[-(_SERVED_KEPT - 1) :], ctx.d_id]


def _push(ctx: MatchCtx) -> list[Effect]:
    regs = tuple(ctx.regs[rank] for rank in sorted(ctx.regs))
    engine = ctx.engine = regs[0].registration.decode_engine_id
    op = ctx.push = ReplayPush(ctx.p_id, ctx.blocks, engine, regs)
    agents = tuple(sorted({r.sender for r in regs}))
    report = ReportToMain(ctx.p_id, Matched(engine=engine, agents=agents), peer=regs[0].sender)
    return [report, *_release(ctx), op, Metric("push.p.matched")]


def add_reg(ctx: MatchCtx, event: RegArrived) -> list[Effect]:
    return _hold(ctx, event.reg)


def duplicate(ctx: MatchCtx, event: RegArrived) -> list[Effect]:
    reg = event.reg
    return [DroppedRegistration(reg.registration.request_id, "duplicate", reg.d_rank)]


def supersede(ctx: MatchCtx, event: RegArrived) -> list[Effect]:
    old = ctx.d_id
    return [*_release(ctx), DroppedRegistration(old, "superseded"), *_hold(ctx, event.reg)]


def drop_busy(ctx: MatchCtx, event: RegArrived) -> list[Effect]:
    reg = event.reg
    return [DroppedRegistration(reg.registration.request_id, "busy", reg.d_rank)]


def match_reg(ctx: MatchCtx, event: RegArrived) -> list[Effect]:
    return [*_hold(ctx, event.reg), *_push(ctx)]


def stage(ctx: MatchCtx, event: BlocksArrived) -> None:
    ctx.p_id, ctx.blocks = event.p_id, event.blocks


def match_blocks(ctx: MatchCtx, event: BlocksArrived) -> list[Effect]:
    stage(ctx, event)
    return _push(ctx)


def drop_blocks(ctx: MatchCtx, event: BlocksArrived) -> list[Effect]:
    # A new P attempt while the old one is still being pushed: its lease runs out.
    return [Metric("push.p.blocks_while_busy")]


def new_attempt_reg(ctx: MatchCtx, event: RegArrived) -> list[Effect]:
    ctx.p_id, ctx.blocks, ctx.d_id, ctx.push = "", (), "", None
    return _hold(ctx, event.reg)


def new_attempt_blocks(ctx: MatchCtx, event: BlocksArrived) -> None:
    ctx.d_id, ctx.push = "", None
    stage(ctx, event)


def answer(ctx: MatchCtx, event: Revoke) -> list[Effect]:
    return [ReportToMain(event.p_id, Revoked())]


def give_back(ctx: MatchCtx, event: Revoke) -> list[Effect]:
    return [*_release(ctx), ReportToMain(event.p_id, Revoked())]


def cancel(ctx: MatchCtx, event: Revoke) -> list[Effect]:
    _remember(ctx)
    # The push may still wait for D's handshake: it must never run.
    return [CancelDeferred(ctx.engine, event.p_id), ReportToMain(event.p_id, Revoked())]


def issued(ctx: MatchCtx, event: Issued) -> None:
    _remember(ctx)


def expire(ctx: MatchCtx, event: PendingExpired) -> list[Effect]:
    old = ctx.d_id
    return [*_release(ctx), DroppedRegistration(old, "expired")]


# -- the table ----------------------------------------------------------------------------


def _reg_rows(source: str, *, can_complete: bool) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = [
        {"conditions": "held", "dest": None, "after": "duplicate"},
        {"conditions": "seen", "unless": "held", "dest": None, "after": "duplicate"},
    ]
    if can_complete:
        rows.append(
            {
                "conditions": ["fits", "consistent", "completes"],
                "unless": ["held", "seen"],
                "dest": "matched",
                "after": "match_reg",
            }
        )
    rows += [
        {
            "conditions": ["fits", "consistent"],
            "unless": ["held", "seen", "completes"] if can_complete else ["held", "seen"],
            "dest": None,
            "after": "add_reg",
        },
        {"unless": ["fits", "held", "seen"], "dest": None, "after": "supersede"},
    ]
    return [{"trigger": RegArrived, "source": source, **row} for row in rows]


MATCH: Declaration[MatchCtx] = Declaration(
    name="push.match",
    description=__doc__ or "",
    states=[
        "empty",
        {
            "name": "registering",
            "tags": ("pending_registration",),
            "timeout": Timeout("pending_registration_ttl", "dropped", PendingExpired, "expire"),
        },
        {"name": "staged", "tags": ("awaiting_registration",)},
        {"name": "matched", "tags": ("write_pending",)},
        {
            "name": "served",
            "tags": ("tombstone",),
            "timeout": Timeout("tombstone_ttl", "forgotten", TombstoneExpired),
        },
        {"name": "dropped", "final": True},
        {"name": "gone", "final": True},
        {"name": "forgotten", "final": True},
    ],
    initial="empty",
    transitions=[
        {"trigger": RegArrived, "source": "empty", "dest": "registering", "after": "add_reg"},
        {"trigger": BlocksArrived, "source": "empty", "dest": "staged", "after": "stage"},
        *_reg_rows("registering", can_complete=False),
        {
            "trigger": BlocksArrived,
            "source": "registering",
            "dest": "matched",
            "conditions": "registered",
            "after": "match_blocks",
        },
        {"trigger": BlocksArrived, "source": "registering", "dest": "staged", "after": "stage"},
        *_reg_rows("staged", can_complete=True),
        {"trigger": BlocksArrived, "source": "staged", "dest": None, "after": "stage"},
        {
            "trigger": Revoke,
            "source": "staged",
            "dest": "gone",
            "conditions": "own_attempt",
            "after": "give_back",
        },
        {
            "trigger": RegArrived,
            "source": "matched",
            "dest": None,
            "conditions": "fits",
            "after": "duplicate",
        },
        {"trigger": RegArrived, "source": "matched", "dest": None, "after": "drop_busy"},
        {"trigger": BlocksArrived, "source": "matched", "dest": None, "after": "drop_blocks"},
        {
            "trigger": Issued,
            "source": "matched",
            "dest": "served",
            "conditions": "own_attempt",
            "after": "issued",
        },
        {"trigger": Issued, "source": "matched", "dest": None},
        {
            "trigger": Revoke,
            "source": "matched",
            "dest": "served",
            "conditions": "own_attempt",
            "after": "cancel",
        },
        {
            "trigger": RegArrived,
            "source": "served",
            "dest": None,
            "conditions": "seen",
            "after": "duplicate",
        },
        {
            "trigger": RegArrived,
            "source": "served",
            "dest": "registering",
            "after": "new_attempt_reg",
        },
        {
            "trigger": BlocksArrived,
            "source": "served",
            "dest": "staged",
            "after": "new_attempt_blocks",
        },
        # A revoked lease of an attempt this slot no longer holds: nothing to stop.
        *(
            {"trigger": Revoke, "source": source, "dest": None, "after": "answer"}
            for source in ("empty", "registering", "staged", "matched", "served")
        ),
    ],
    ignore=[
        ("empty", Issued),
        ("registering", Issued),
        ("staged", Issued),
        ("served", Issued),
    ],
    callbacks={
        "held": held,
        "seen": seen,
        "fits": fits,
        "consistent": consistent,
        "completes": completes,
        "registered": registered,
        "own_attempt": own_attempt,
        "add_reg": add_reg,
        "duplicate": duplicate,
        "supersede": supersede,
        "drop_busy": drop_busy,
        "match_reg": match_reg,
        "stage": stage,
        "match_blocks": match_blocks,
        "drop_blocks": drop_blocks,
        "new_attempt_reg": new_attempt_reg,
        "new_attempt_blocks": new_attempt_blocks,
        "answer": answer,
        "give_back": give_back,
        "cancel": cancel,
        "issued": issued,
        "expire": expire,
    },
    config_defaults={"pending_registration_ttl": 480.0, "tombstone_ttl": 60.0},
    context=MatchCtx,
)
