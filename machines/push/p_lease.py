"""P lease lifecycle: P's finished KV blocks, held until they are pushed or reaped.

One instance per prefill request, keyed by P's request id, on P's main-thread bus.

- `request_finished` stashes the block ids and starts the lease (`kv_lease_duration`,
  R-P03, R-P11); `start_load_kv` hands them to the writer's finished-blocks inbox.
- The writer reports back: a `PUSH_REG` matched them (R-P04); the P->D handshake started
  and was replayed (R-P05); the WRITE was posted or failed to post (R-P06, R-P12). A
  failed handshake is logged as `push_handshake_failed` and dropped, and a failed submit
  is counted; neither reports a failed receive: the lease reclaims the blocks (R-P12).
- D's heartbeats extend the lease to max(deadline, now + `kv_lease_extension`) (R-P08),
  except after a failed handshake or WRITE: nothing will use the blocks any more, so the
  lease runs out at its deadline instead of living on until D's watchdog.
- While the WRITE is in flight the lease is suspended (freeing blocks under a DMA would
  corrupt D) and a write timeout guards it instead; get_finished polls the transfer.
- A finished WRITE, or an expired lease (reaped in deadline order, B-07), reports
  `finished_sending` and queues the request on the evict inbox (R-P09); the scheduler's
  `update_connector_output(finished_sending)` clears the lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.push.effects import (
    EnqueueFinishedBlocks,
    FinishedSending,
    PollTransfer,
    QueueEviction,
    ReleaseTransfer,
    Warn,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import ExtendDeadline, Metric

KIND = "push.p_lease"


@dataclass(slots=True)
class PLeaseCtx:
    block_ids: tuple[int, ...]
    lease_extension: float = 20.0


LEASE = Timeout("kv_lease_duration", "expired", "lease_expired", action="reap")
WRITE_TIMEOUT = Timeout(
    "push_write_timeout", "write_failed", "write_timeout", action="abandon_write"
)


def stage(inst: Any, payload: Any) -> list[object]:
    ctx: PLeaseCtx = inst.ctx
    return [EnqueueFinishedBlocks(inst.key, ctx.block_ids)]


def extend_lease(inst: Any, payload: Any) -> list[object]:
    return [ExtendDeadline(inst.ctx.lease_extension)]


def poll(inst: Any, payload: Any) -> list[object]:
    return [PollTransfer(inst.key)]


def log_handshake_failed(inst: Any, payload: Any) -> list[object]:
    return [
        Warn(inst.key, "push_handshake_failed: dropped, no requeue"),
        Metric("push.p.handshake_failed"),
    ]


def count_failed(inst: Any, payload: Any) -> list[object]:
    return [Metric("push.p.failed_transfers")]


def abandon_write(inst: Any, payload: Any) -> list[object]:
    # The handle must not outlive the wait: released, the WRITE cannot land after the
    # lease frees the blocks it reads.
    return [ReleaseTransfer(inst.key), Metric("push.p.failed_transfers")]


def done_sending(inst: Any, payload: Any) -> list[object]:
    return [FinishedSending(inst.key), QueueEviction(inst.key), Metric("push.p.sent")]


def reap(inst: Any, payload: Any) -> list[object]:
    return [FinishedSending(inst.key), QueueEviction(inst.key), Metric("push.p.lease_expired")]


_LEASED = ["finished", "staged", "matched", "awaiting_handshake"]
# After a failed handshake or WRITE nothing is retried (R-P12): the blocks wait only for
# the lease to reclaim them, so D's heartbeats no longer extend it.
_GIVEN_UP = ["handshake_failed", "write_failed"]

P_LEASE = Declaration(
    name=KIND,
    description=__doc__ or "",
    states=[
        {"name": "finished", "timeout": LEASE},
        {"name": "staged", "timeout": LEASE},
        {"name": "matched", "timeout": LEASE},
        {"name": "awaiting_handshake", "timeout": LEASE},
        {"name": "handshake_failed", "timeout": LEASE},
        {"name": "writing", "timeout": WRITE_TIMEOUT},
        {"name": "write_failed", "timeout": LEASE},
        {"name": "reported"},
        {"name": "sent", "final": True},
        {"name": "expired", "final": True},
    ],
    initial="finished",
    transitions=[
        {"trigger": "staged", "source": "finished", "dest": "staged", "after": "stage"},
        {"trigger": "matched", "source": "staged", "dest": "matched"},
        {"trigger": "handshake_started", "source": "matched", "dest": "awaiting_handshake"},
        {"trigger": "handshake_done", "source": "awaiting_handshake", "dest": "matched"},
        {
            "trigger": "handshake_failed",
            "source": ["matched", "awaiting_handshake"],
            "dest": "handshake_failed",
            "after": "log_handshake_failed",
        },
        {"trigger": "write_posted", "source": "matched", "dest": "writing"},
        {
            "trigger": "write_submit_failed",
            "source": "matched",
            "dest": "write_failed",
            "after": "count_failed",
        },
        {"trigger": "poll", "source": "writing", "dest": None, "after": "poll"},
        {"trigger": "write_done", "source": "writing", "dest": "reported", "after": "done_sending"},
        {
            "trigger": "write_error",
            "source": "writing",
            "dest": "write_failed",
            "after": "count_failed",
        },
        {"trigger": "heartbeat", "source": _LEASED, "dest": None, "after": "extend_lease"},
        {"trigger": "finished_sending", "source": "reported", "dest": "sent"},
    ],
    ignore=[
        ("writing", "heartbeat"),
        ("reported", "heartbeat"),
        *((state, "heartbeat") for state in _GIVEN_UP),
    ],
    callbacks={
        "stage": stage,
        "extend_lease": extend_lease,
        "poll": poll,
        "log_handshake_failed": log_handshake_failed,
        "count_failed": count_failed,
        "abandon_write": abandon_write,
        "done_sending": done_sending,
        "reap": reap,
    },
    config_defaults={"kv_lease_duration": 30.0, "push_write_timeout": 30.0},
    context=PLeaseCtx,
)
