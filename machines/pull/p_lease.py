"""Pull-mode P lease lifecycle of one worker rank (B-09): P's finished blocks, held until
D has read them.

One instance per prefill request, keyed by P's request id, on the rank's main-thread
bus, created from the step's metadata. `request_finished` returned the pull params (P's
coordinates, request id and block ids) for the proxy to put on the decode leg. Each D
rank that reads from this rank carries the completion notif `<P request id>:<D tp_size>`
on its READ; when as many have arrived as D ranks read from this one (`max(1, D.tp /
P.tp)`, `reads_per_producer`, vLLM 0.33's count), the lease ends and the rank reports
the blocks free. D's heartbeats extend the lease meanwhile; an
unclaimed lease is reaped at expiry, in deadline order, exactly as in push mode (R-P11,
B-07). P never connects to D in pull mode, so it cannot tell D's agents from others:
any completion or heartbeat naming the request is taken (the threat model says so).

Tags: `heartbeat_extends`.

Each reading D rank is its own NIXL agent, so completions are counted by sender: a second
one from the same agent (a duplicate, or a replay that no cluster key refused) is counted
as such and frees nothing, where vLLM 0.33 would count it. A completion naming a TP size
that does not divide this engine's, or the other way round, is a peer's error (refused,
the lease keeps running).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.kv.effects import ReportFinishedSending
from kvhandoff.machines.kv.events import Completion, Heartbeat, LeaseExpired
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, ExtendDeadline, Metric
from kvhandoff.protocol.tp_mapping import reads_per_producer


@dataclass(slots=True)
class PullLeaseCtx:
    key: str
    block_ids: tuple[int, ...]
    lease_extension: float = 20.0
    p_tp: int = 1
    """This engine's TP size: with D's, from the notif, it says how many READs to await."""
    readers: set[str] = field(default_factory=set)
    """The agents whose completion notifs were taken."""


LEASE = Timeout("kv_lease_duration", "expired", LeaseExpired, action="reap")


def extend_lease(ctx: PullLeaseCtx, event: Heartbeat) -> list[Effect]:
    return [ExtendDeadline(ctx.lease_extension)]


def repeated(ctx: PullLeaseCtx, event: Completion) -> bool:
    return event.sender in ctx.readers


def last_read(ctx: PullLeaseCtx, event: Completion) -> bool:
    """This completion is the last awaited (a D TP that does not map onto P's raises)."""
    return len(ctx.readers) + 1 >= reads_per_producer(ctx.p_tp, event.tp_size)


def count_read(ctx: PullLeaseCtx, event: Completion) -> None:
    ctx.readers.add(event.sender)


def count_repeat(ctx: PullLeaseCtx, event: Completion) -> list[Effect]:
    return [Metric("pull.p.duplicate_completions")]


def done_sending(ctx: PullLeaseCtx, event: Completion) -> list[Effect]:
    ctx.readers.add(event.sender)
    return [ReportFinishedSending(ctx.key), Metric("pull.p.read_by_d")]


def reap(ctx: PullLeaseCtx, event: LeaseExpired) -> list[Effect]:
    return [ReportFinishedSending(ctx.key), Metric("pull.p.lease_expired")]


PULL_P_LEASE: Declaration[PullLeaseCtx] = Declaration(
    name="pull.p_lease",
    description=__doc__ or "",
    states=[
        {"name": "finished", "timeout": LEASE, "tags": ("heartbeat_extends",)},
        {"name": "sent", "final": True},
        {"name": "expired", "final": True},
    ],
    initial="finished",
    transitions=[
        {
            "trigger": Completion,
            "source": "finished",
            "dest": None,
            "conditions": "repeated",
            "after": "count_repeat",
        },
        {
            "trigger": Completion,
            "source": "finished",
            "dest": "sent",
            "conditions": "last_read",
            "after": "done_sending",
        },
        {"trigger": Completion, "source": "finished", "dest": None, "after": "count_read"},
        {"trigger": Heartbeat, "source": "finished", "dest": None, "after": "extend_lease"},
    ],
    callbacks={
        "extend_lease": extend_lease,
        "repeated": repeated,
        "last_read": last_read,
        "count_read": count_read,
        "count_repeat": count_repeat,
        "done_sending": done_sending,
        "reap": reap,
    },
    config_defaults={"kv_lease_duration": 30.0},
    context=PullLeaseCtx,
)
