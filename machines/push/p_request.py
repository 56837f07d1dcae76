"""P request lifecycle on the scheduler: the engine's view of one push (R-P03, R-T02).

One instance per prefill request that finished normally holding blocks, keyed by P's
request id, on the scheduler's bus. `request_finished` delays freeing the blocks and
stashes them (`finished`); `build_connector_meta` hands them to every worker rank
(`leased`). Each rank holds its own lease over its share of the KV (TP/PP shard) and
reports when it is done with it: its WRITEs ended, or its lease ran out. The blocks are
freed (`finished_sending`) only when every rank reported (R-T02); a rank that reports
twice is counted and ignored.

Tags: `drainable` (the next metadata carries the blocks), `awaiting_ranks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.kv.effects import ReportTransferred
from kvhandoff.machines.kv.events import Drained, RankSent
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Metric


@dataclass(slots=True)
class PRequestCtx:
    key: str
    block_ids: tuple[int, ...]
    ranks: int = 1
    reported: set[int] = field(default_factory=set)
    since: float = 0.0
    """When the prefill finished (the scheduler's `now`): the push is timed from it (B-14)."""


def repeated(ctx: PRequestCtx, event: RankSent) -> bool:
    return event.rank in ctx.reported


def last(ctx: PRequestCtx, event: RankSent) -> bool:
    """The last rank to report (a repeated report is told apart first)."""
    return len(ctx.reported) + 1 >= ctx.ranks


def record(ctx: PRequestCtx, event: RankSent) -> None:
    ctx.reported.add(event.rank)


def count_repeat(ctx: PRequestCtx, event: RankSent) -> list[Effect]:
    return [Metric("push.scheduler.duplicate_reports")]


def free(ctx: PRequestCtx, event: RankSent) -> list[Effect]:
    ctx.reported.add(event.rank)
    return [ReportTransferred(ctx.key, ctx.since, len(ctx.block_ids))]


P_REQUEST: Declaration[PRequestCtx] = Declaration(
    name="push.p_request",
    description=__doc__ or "",
    states=[
        {"name": "finished", "tags": ("drainable",)},
        {"name": "leased", "tags": ("awaiting_ranks",)},
        {"name": "sent", "final": True},
    ],
    initial="finished",
    transitions=[
        {"trigger": Drained, "source": "finished", "dest": "leased"},
        {
            "trigger": RankSent,
            "source": "leased",
            "dest": "sent",
            "conditions": "last",
            "unless": "repeated",
            "after": "free",
        },
        {
            "trigger": RankSent,
            "source": "leased",
            "dest": None,
            "conditions": "repeated",
            "after": "count_repeat",
        },
        {"trigger": RankSent, "source": "leased", "dest": None, "after": "record"},
    ],
    callbacks={
        "repeated": repeated,
        "last": last,
        "record": record,
        "count_repeat": count_repeat,
        "free": free,
    },
    context=PRequestCtx,
)
