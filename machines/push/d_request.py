"""D request lifecycle on the scheduler: the engine's view of one receive (R-P02, R-P10,
R-T02).

One instance per decode request, keyed by D's request id, on the scheduler's bus. The
scheduler shares no object with the worker ranks (R-T01): it hands the registration down
in the step's metadata and learns each rank's outcome from the rank's output.

- `update_state_after_alloc` stashes the registration and arms the watchdog (R-P02,
  R-P10); `build_connector_meta` drains it (`awaiting`): from then on the request gets
  heartbeats (vLLM 0.33: they start when D enqueues it).
- Every participating rank reports its part: received, or failed. The request is
  reported only when every rank reported (R-T02): received if they all received, failed
  with its blocks invalid if any failed. A rank that reports twice is counted and ignored.
- Pull mode (B-09): a rank that posted its READ stops the watchdog (`transferring`): the
  READ runs to its end under its own timeout, so the engine never frees blocks a READ
  writes into.
- The watchdog or the engine's abort path (`Abort`, vLLM ending a request it waits for)
  drops the request in two steps: the next metadata tells every rank to drop it
  (`dropping`, `ending`), and it moves on once every rank let go of it (dropped it, or
  finished its part before it heard: vLLM ends a failed load before it hands over the
  ranks' outputs).
- Given up by the watchdog, it is `expired`: never re-sent, and it stays awaiting its
  receive until the engine's abort path ends it (R-P10), as vLLM keeps it in
  `WAITING_FOR_REMOTE_KVS`. Ended by the engine (before, while the ranks drop it, or
  once expired), it is reported `released` (`ReportReleased`, with why): its blocks are
  the engine's again. The engine hears of every request it waits for exactly once:
  received, failed or released.

Tags: `drainable` (the next metadata carries it), `needs_heartbeat` (D keeps P's lease
alive for it), `awaiting_ranks` (ranks' reports are expected), `abortable` (the abort
path ends it), `ending` (the metadata tells the ranks to drop it), `given_up` (the
watchdog dropped it; only the abort path ends it now).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.kv.effects import (
    ReportFailedRecving,
    ReportReleased,
    ReportTransferred,
    Warn,
)
from kvhandoff.machines.kv.events import (
    Abort,
    Drained,
    RankEnded,
    RankPosted,
    RankReceived,
    RankRecvFailed,
    WatchdogExpired,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.protocol.legs import PullSource
from kvhandoff.protocol.push_wire import PushRegistration


@dataclass(slots=True)
class DRequestCtx:
    key: str
    block_ids: tuple[int, ...]
    ranks: int = 1
    heartbeat_engine: str = ""
    """The P engine whose lease this request keeps alive."""
    heartbeat_id: str = ""
    """The id P knows the request by in heartbeats (D's own in push, P's in pull)."""
    registration: PushRegistration | None = None
    """Push: the registration every rank sends (each with its own rank)."""
    source: PullSource | None = None
    """Pull: where the ranks read from."""
    reported: set[int] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)
    expired: bool = False
    """The watchdog gave up on it before the engine ended it."""
    engine_ended: bool = False
    """The engine's abort path ended it: release it once no rank holds it."""
    since: float = 0.0
    """When the engine allocated its blocks (the scheduler's `now`): the receive's wait is
    timed from it (B-14)."""


WATCHDOG = Timeout("push_registration_timeout", "dropping", WatchdogExpired, action="give_up")

RankReport = RankReceived | RankRecvFailed


def repeated(ctx: DRequestCtx, event: RankReport | RankEnded) -> bool:
    return event.rank in ctx.reported


def last(ctx: DRequestCtx, event: RankReport | RankEnded) -> bool:
    """The last rank to report (every route asking it tells a repeated report apart)."""
    return len(ctx.reported) + 1 >= ctx.ranks


def all_received(ctx: DRequestCtx, event: RankReceived) -> bool:
    return not ctx.failures


def record(ctx: DRequestCtx, event: RankReport | RankEnded) -> None:
    ctx.reported.add(event.rank)
    if isinstance(event, RankRecvFailed):
        ctx.failures.append(event.reason or "push receive failed")


def count_repeat(ctx: DRequestCtx, event: RankReport | RankEnded) -> list[Effect]:
    return [Metric("push.scheduler.duplicate_reports")]


def finish(ctx: DRequestCtx, event: RankReceived) -> list[Effect]:
    record(ctx, event)
    return [ReportTransferred(ctx.key, ctx.since, len(ctx.block_ids))]


def fail(ctx: DRequestCtx, event: RankReport) -> list[Effect]:
    record(ctx, event)
    reason = "; ".join(dict.fromkeys(ctx.failures))
    return [ReportFailedRecving(ctx.key, ctx.block_ids, reason), Metric("push.d.failed_recv")]


def give_up(ctx: DRequestCtx, event: WatchdogExpired) -> list[Effect]:
    ctx.reported.clear()
    ctx.expired = True
    return [
        Warn(ctx.key, "push registration watchdog expired; dropped, not re-sent"),
        Metric("push.d.watchdog_expired"),
    ]


def abort(ctx: DRequestCtx, event: Abort) -> None:
    ctx.reported.clear()
    ctx.engine_ended = True


def engine_ends(ctx: DRequestCtx, event: Abort) -> None:
    """The engine ended it while the ranks drop it for the watchdog: their acks count."""
    ctx.engine_ended = True


def engine_ended(ctx: DRequestCtx, event: RankReport | RankEnded) -> bool:
    return ctx.engine_ended


def release(ctx: DRequestCtx, event: Abort | RankReport | RankEnded) -> list[Effect]:
    reason = "push registration watchdog expired" if ctx.expired else "aborted"
    failed = bool(ctx.failures) or isinstance(event, RankRecvFailed)
    return [ReportReleased(ctx.key, reason, failed), Metric("push.d.released")]


_WAITING = ["awaiting", "transferring"]


def _reports(trigger: type[RankReport]) -> list[dict[str, object]]:
    """A rank's report: a duplicate changes nothing; the last one ends the request,
    received only if no rank failed."""
    # The rows exclude each other (each later one is `unless repeated`): the common case,
    # the last rank's clean report, is tried first and costs three guards.
    rows: list[dict[str, object]] = []
    if trigger is RankReceived:
        rows.append(
            {
                "conditions": ["last", "all_received"],
                "unless": "repeated",
                "dest": "received",
                "after": "finish",
            }
        )
        rows.append(
            {
                "conditions": "last",
                "unless": ["repeated", "all_received"],
                "dest": "failed",
                "after": "fail",
            }
        )
    else:
        rows.append({"conditions": "last", "unless": "repeated", "dest": "failed", "after": "fail"})
    rows.append({"conditions": "repeated", "dest": None, "after": "count_repeat"})
    rows.append({"dest": None, "after": "record"})
    return [{"trigger": trigger, "source": _WAITING, **row} for row in rows]


def _acks() -> list[dict[str, object]]:
    """A rank let go of the request being dropped (it dropped it, or finished its part
    before it heard); when every rank did, it is released if the engine ended it, else
    it waits for the engine's abort path (`expired`)."""
    rows: list[dict[str, object]] = []
    for trigger in (RankEnded, RankReceived, RankRecvFailed):
        rows += [
            {"conditions": "repeated", "dest": None, "after": "count_repeat"},
            {
                "conditions": ["last", "engine_ended"],
                "unless": "repeated",
                "dest": "released",
                "after": "release",
            },
            {"conditions": "last", "unless": ["repeated", "engine_ended"], "dest": "expired"},
            {"dest": None, "after": "record"},
        ]
        for row in rows[-4:]:
            row.update(trigger=trigger, source="dropping")
    return rows


D_REQUEST: Declaration[DRequestCtx] = Declaration(
    name="push.d_request",
    description=__doc__ or "",
    states=[
        {"name": "stashed", "timeout": WATCHDOG, "tags": ("drainable", "abortable")},
        {
            "name": "awaiting",
            "timeout": WATCHDOG,
            "tags": ("needs_heartbeat", "awaiting_ranks", "abortable"),
        },
        {"name": "transferring", "tags": ("needs_heartbeat", "awaiting_ranks")},
        {"name": "dropping", "tags": ("ending", "abortable")},
        {"name": "expired", "tags": ("given_up", "abortable")},
        {"name": "received", "final": True},
        {"name": "failed", "final": True},
        {"name": "released", "final": True},
    ],
    initial="stashed",
    transitions=[
        {"trigger": Drained, "source": "stashed", "dest": "awaiting"},
        {"trigger": RankPosted, "source": "awaiting", "dest": "transferring"},
        *_reports(RankReceived),
        *_reports(RankRecvFailed),
        {"trigger": Abort, "source": ["stashed", "awaiting"], "dest": "dropping", "after": "abort"},
        {"trigger": Abort, "source": "dropping", "dest": None, "after": "engine_ends"},
        {"trigger": Abort, "source": "expired", "dest": "released", "after": "release"},
        *_acks(),
    ],
    ignore=[
        # Every rank let go already; a late report changes nothing (a rank that no
        # longer held the request answers each step's `ended` with one: found by
        # `kvhandoff simulate pull`, two ranks' answers in one step's outputs).
        *(("expired", e) for e in (RankReceived, RankRecvFailed, RankEnded)),
        *((s, RankPosted) for s in ("transferring", "dropping", "expired")),
    ],
    callbacks={
        "repeated": repeated,
        "last": last,
        "all_received": all_received,
        "record": record,
        "count_repeat": count_repeat,
        "finish": finish,
        "fail": fail,
        "give_up": give_up,
        "abort": abort,
        "engine_ends": engine_ends,
        "engine_ended": engine_ended,
        "release": release,
    },
    config_defaults={"push_registration_timeout": 480.0},
    context=DRequestCtx,
)
