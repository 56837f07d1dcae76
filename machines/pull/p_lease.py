"""Pull-mode P lease lifecycle (B-09): P's finished blocks, held until D has read them.

One instance per prefill request, keyed by P's request id, on P's main-thread bus.
`request_finished` starts the lease and returns the pull params (P's coordinates, request
id and block ids) for the proxy to put on the decode leg. D's READ carries the completion
notif `<P request id>:<tp_size>`; when it arrives the lease ends and get_finished reports
`finished_sending`. D's heartbeats extend the lease meanwhile; an unclaimed lease is
reaped at expiry, in deadline order, exactly as in push mode (R-P11, B-07).

`Completion` and `Heartbeat` come from D: one the state does not declare is a
`RemoteProtocolError` that changes nothing. Tags: `heartbeat_extends` (D's heartbeats
extend the lease), `confirmable` (reported to the engine, awaiting
`update_connector_output`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.push.effects import QueueEviction, ReportFinishedSending
from kvhandoff.machines.push.events import (
    Completion,
    FinishedSending,
    Heartbeat,
    LeaseExpired,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, ExtendDeadline, Metric


@dataclass(slots=True)
class PullLeaseCtx:
    key: str
    block_ids: tuple[int, ...]
    lease_extension: float = 20.0


LEASE = Timeout("kv_lease_duration", "expired", LeaseExpired, action="reap")


def extend_lease(ctx: PullLeaseCtx, event: Heartbeat) -> list[Effect]:
    return [ExtendDeadline(ctx.lease_extension)]


def done_sending(ctx: PullLeaseCtx, event: Completion) -> list[Effect]:
    return [ReportFinishedSending(ctx.key), QueueEviction(ctx.key), Metric("pull.p.read_by_d")]


def reap(ctx: PullLeaseCtx, event: LeaseExpired) -> list[Effect]:
    return [
        ReportFinishedSending(ctx.key),
        QueueEviction(ctx.key),
        Metric("pull.p.lease_expired"),
    ]


PULL_P_LEASE: Declaration[PullLeaseCtx] = Declaration(
    name="pull.p_lease",
    description=__doc__ or "",
    states=[
        {"name": "finished", "timeout": LEASE, "tags": ("heartbeat_extends",)},
        {"name": "reported", "tags": ("confirmable",)},
        {"name": "sent", "final": True},
        {"name": "expired", "final": True},
    ],
    initial="finished",
    transitions=[
        {
            "trigger": Completion,
            "source": "finished",
            "dest": "reported",
            "after": "done_sending",
        },
        {"trigger": Heartbeat, "source": "finished", "dest": None, "after": "extend_lease"},
        {"trigger": FinishedSending, "source": "reported", "dest": "sent"},
    ],
    ignore=[("reported", Heartbeat), ("reported", Completion)],
    callbacks={"extend_lease": extend_lease, "done_sending": done_sending, "reap": reap},
    config_defaults={"kv_lease_duration": 30.0},
    context=PullLeaseCtx,
)
