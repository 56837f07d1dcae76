"""Transfer: one load or save of one encoding, across the worker ranks (R-T02, R-T06, R-E05).

Keyed by the transfer id the scheduler mints when it plans the copy (a fresh id for
every load and save, so two loads of one `mm_hash` in different steps are two
transfers, and a late report of the first can never release the second). The
participants are fixed when it is planned: a load is done by every TP/PCP rank (each
fills its own GPU encoder cache); a save only by the writer (TP 0 / PCP 0, R-E03).

- `dispatch`: `staged -> copying` when `build_connector_meta` hands the copy to the
  workers (the meta is built from the transfers tagged `staged`).
- `rank_reported(rank, ok)`: one participating rank's end event fired (or its copy
  failed). While other ranks are still copying the transfer stays `copying`; the last
  report takes it to `done` (every rank ok) or `failed` (any rank failed):
  - a load unpins its entry only then: no eviction can reuse blocks a slower rank is
    still reading; a failed load also tells the scheduler (`LoadLost`), which fails the
    request that depended on it (B-05);
  - a save makes its entry ready (`saved`) or discards it.

A report from a rank that is not a participant, or a second report from one rank, is
refused by the guards (`RankReported` is a peer event: refused means a
`RemoteProtocolError` that changes nothing); the scheduler validates a whole report
before it applies any of it and counts such items instead of dispatching them.

Tags: `staged` (planned, not yet in a meta), `in_flight` (handed to the workers, some
report outstanding); on the final states: `landed`, `failed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.events import Discard, Saved, Unpin
from kvhandoff.machines.ec.meta import CopyDirection
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Emit, Metric
from kvhandoff.machines.runtime.events import Event, PeerEvent

__all__ = [
    "EC_TRANSFER",
    "Dispatch",
    "LoadLost",
    "RankReported",
    "TransferCtx",
]


@dataclass(slots=True)
class TransferCtx:
    key: int
    """The transfer id."""
    mm_hash: str = ""
    direction: CopyDirection = "load"
    blocks: tuple[int, ...] = ()
    num_tokens: int = 0
    request_id: str = ""
    """The request a load serves (its failure fails that request, B-05)."""
    participants: frozenset[int] = frozenset()
    """The ranks that copy it (`pcp_rank * tp_size + tp_rank`)."""
    pending: set[int] = field(default_factory=set)
    """Participating ranks that have not reported yet."""
    failed_ranks: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class Dispatch(Event):
    """The copy went into this step's connector meta."""


@dataclass(frozen=True, slots=True)
class RankReported(PeerEvent):
    """Rank `rank` (`pcp_rank * tp_size + tp_rank`) reported the copy: `ok` or failed."""

    rank: int
    ok: bool = True


@dataclass(frozen=True, slots=True)
class LoadLost(Effect):
    """The scheduler: the load `request_id` depended on failed on some rank (B-05)."""

    request_id: str
    mm_hash: str


def _last(ctx: TransferCtx, event: RankReported) -> bool:
    return ctx.pending == {event.rank}


def _all_ok(ctx: TransferCtx, event: RankReported) -> bool:
    return event.ok and not ctx.failed_ranks


def _pending_rank(ctx: TransferCtx, event: RankReported) -> bool:
    return event.rank in ctx.pending


def _note(ctx: TransferCtx, event: RankReported) -> None:
    ctx.pending.discard(event.rank)
    if not event.ok:
        ctx.failed_ranks.add(event.rank)


def _complete(ctx: TransferCtx, event: RankReported) -> list[Effect]:
    _note(ctx, event)
    landed = Saved() if ctx.direction == "save" else Unpin()
    return [Emit(EC_CACHE_ENTRY, ctx.mm_hash, landed), Metric(f"ec.{ctx.direction}.landed")]


def _fail(ctx: TransferCtx, event: RankReported) -> list[Effect]:
    _note(ctx, event)
    metric = Metric(f"ec.{ctx.direction}.failed")
    if ctx.direction == "save":
        return [Emit(EC_CACHE_ENTRY, ctx.mm_hash, Discard()), metric]
    return [
        Emit(EC_CACHE_ENTRY, ctx.mm_hash, Unpin()),
        LoadLost(ctx.request_id, ctx.mm_hash),
        metric,
    ]


EC_TRANSFER: Declaration[TransferCtx] = Declaration(
    name="ec.transfer",
    context=TransferCtx,
    description=(
        "One load or save of one encoding under its own transfer id (R-T06): staged, then "
        "copying on every participating rank; it lands (the entry becomes ready, or is "
        "unpinned) or fails only when the last participating rank reported (R-T02)."
    ),
    states=[
        {"name": "staged", "tags": ("staged",)},
        {"name": "copying", "tags": ("in_flight",)},
        {"name": "done", "final": True, "tags": ("landed",)},
        {"name": "failed", "final": True, "tags": ("failed",)},
    ],
    initial="staged",
    transitions=[
        {"trigger": Dispatch, "source": "staged", "dest": "copying"},
        {
            "trigger": RankReported,
            "source": "copying",
            "dest": "done",
            "conditions": ["last", "all_ok"],
            "after": "complete",
        },
        {
            "trigger": RankReported,
            "source": "copying",
            "dest": "failed",
            "conditions": "last",
            "after": "fail",
        },
        {
            "trigger": RankReported,
            "source": "copying",
            "dest": None,
            "conditions": "pending_rank",
            "after": "note",
        },
    ],
    callbacks={
        "last": _last,
        "all_ok": _all_ok,
        "pending_rank": _pending_rank,
        "note": _note,
        "complete": _complete,
        "fail": _fail,
    },
)
