"""Pull-mode P lease lifecycle (B-09): P's finished blocks, held until D has read them.

One instance per prefill request, keyed by P's request id, on P's main-thread bus.
`request_finished` starts the lease and returns the pull params (P's coordinates, request
id and block ids) for the proxy to put on the decode leg. D's READ carries the completion
notif `<P request id>:<tp_size>`; when it arrives the lease ends and get_finished reports
`finished_sending`. D's heartbeats extend the lease meanwhile; an unclaimed lease is
reaped at expiry, in deadline order, exactly as in push mode (R-P11, B-07).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.push.effects import FinishedSending, QueueEviction
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import ExtendDeadline, Metric

KIND = "pull.p_lease"


@dataclass(slots=True)
class PullLeaseCtx:
    block_ids: tuple[int, ...]
    lease_extension: float = 20.0


LEASE = Timeout("kv_lease_duration", "expired", "lease_expired", action="reap")


def extend_lease(inst: Any, payload: Any) -> list[object]:
    return [ExtendDeadline(inst.ctx.lease_extension)]


def done_sending(inst: Any, payload: Any) -> list[object]:
    return [FinishedSending(inst.key), QueueEviction(inst.key), Metric("pull.p.read_by_d")]


def reap(inst: Any, payload: Any) -> list[object]:
    return [FinishedSending(inst.key), QueueEviction(inst.key), Metric("pull.p.lease_expired")]


PULL_P_LEASE = Declaration(
    name=KIND,
    description=__doc__ or "",
    states=[
        {"name": "finished", "timeout": LEASE},
        "reported",
        {"name": "sent", "final": True},
        {"name": "expired", "final": True},
    ],
    initial="finished",
    transitions=[
        {
            "trigger": "completion",
            "source": "finished",
            "dest": "reported",
            "after": "done_sending",
        },
        {"trigger": "heartbeat", "source": "finished", "dest": None, "after": "extend_lease"},
        {"trigger": "finished_sending", "source": "reported", "dest": "sent"},
    ],
    ignore=[("reported", "heartbeat"), ("reported", "completion")],
    callbacks={"extend_lease": extend_lease, "done_sending": done_sending, "reap": reap},
    config_defaults={"kv_lease_duration": 30.0},
    context=PullLeaseCtx,
)
