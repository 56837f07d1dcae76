"""Pull-mode P lease lifecycle of one worker rank (B-09): P's finished blocks, held until
D has read them.

One instance per prefill request, keyed by P's request id, on the rank's main-thread
bus, created from the step's metadata. `request_finished` returned the pull params (P's
coordinates, request id and block ids) for the proxy to put on the decode leg. D's READ
carries the completion notif `<P request id>:<tp_size>`; when it arrives the lease ends
and the rank reports the blocks free. D's heartbeats extend the lease meanwhile; an
unclaimed lease is reaped at expiry, in deadline order, exactly as in push mode (R-P11,
B-07). P never connects to D in pull mode, so it cannot tell D's agents from others:
any completion or heartbeat naming the request is taken (the threat model says so).

Tags: `heartbeat_extends`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.kv.effects import ReportFinishedSending
from kvhandoff.machines.kv.events import Completion, Heartbeat, LeaseExpired
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
        {"trigger": Completion, "source": "finished", "dest": "sent", "after": "done_sending"},
        {"trigger": Heartbeat, "source": "finished", "dest": None, "after": "extend_lease"},
    ],
    callbacks={"extend_lease": extend_lease, "done_sending": done_sending, "reap": reap},
    config_defaults={"kv_lease_duration": 30.0},
    context=PullLeaseCtx,
)
