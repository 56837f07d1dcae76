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
  The main thread applies the writer's reports before its time moves on, so a WRITE the
  writer posted while the lease stood always suspends the lease before the lease can
  expire; the report lands in `posted` (suspended, no timeout yet) and the first poll,
  at the main thread's own time, moves it to `writing` and starts the write timeout.
- A finished WRITE, or an expired lease (reaped in deadline order, B-07), reports
  `finished_sending` and queues the request on the evict inbox (R-P09); the scheduler's
  `update_connector_output(finished_sending)` clears the lease.

`Heartbeat` (D's `HB:` notif) and `Matched` (D's `PUSH_REG` met the blocks) come from D:
one the state does not declare is a `RemoteProtocolError` that changes nothing. Tags:
`drainable` (the next connector meta carries the blocks), `heartbeat_extends` (D's
heartbeats extend the lease), `pollable` (a WRITE is posted: get_finished polls it),
`confirmable` (reported to the engine, awaiting `update_connector_output`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.push.effects import (
    EnqueueFinishedBlocks,
    PollTransfer,
    QueueEviction,
    ReleaseTransfer,
    ReportFinishedSending,
    Warn,
)
from kvhandoff.machines.push.events import (
    FinishedSending,
    HandshakeDone,
    HandshakeFailed,
    HandshakeStarted,
    Heartbeat,
    LeaseExpired,
    Matched,
    Poll,
    Staged,
    WriteDone,
    WriteError,
    WritePosted,
    WriteSubmitFailed,
    WriteTimeout,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, ExtendDeadline, Metric


@dataclass(slots=True)
class PLeaseCtx:
    key: str
    block_ids: tuple[int, ...]
    lease_extension: float = 20.0


LEASE = Timeout("kv_lease_duration", "expired", LeaseExpired, action="reap")
WRITE_TIMEOUT = Timeout("push_write_timeout", "write_failed", WriteTimeout, action="abandon_write")


def stage(ctx: PLeaseCtx, event: Staged) -> list[Effect]:
    return [EnqueueFinishedBlocks(ctx.key, ctx.block_ids)]


def extend_lease(ctx: PLeaseCtx, event: Heartbeat) -> list[Effect]:
    return [ExtendDeadline(ctx.lease_extension)]


def poll(ctx: PLeaseCtx, event: Poll) -> list[Effect]:
    return [PollTransfer(ctx.key)]


def log_handshake_failed(ctx: PLeaseCtx, event: HandshakeFailed) -> list[Effect]:
    return [
        Warn(ctx.key, "push_handshake_failed: dropped, no requeue"),
        Metric("push.p.handshake_failed"),
    ]


def count_failed(ctx: PLeaseCtx, event: WriteSubmitFailed | WriteError) -> list[Effect]:
    return [Metric("push.p.failed_transfers")]


def abandon_write(ctx: PLeaseCtx, event: WriteTimeout) -> list[Effect]:
    # The handle must not outlive the wait: released, the WRITE cannot land after the
    # lease frees the blocks it reads.
    return [ReleaseTransfer(ctx.key), Metric("push.p.failed_transfers")]


def done_sending(ctx: PLeaseCtx, event: WriteDone) -> list[Effect]:
    return [ReportFinishedSending(ctx.key), QueueEviction(ctx.key), Metric("push.p.sent")]


def reap(ctx: PLeaseCtx, event: LeaseExpired) -> list[Effect]:
    return [
        ReportFinishedSending(ctx.key),
        QueueEviction(ctx.key),
        Metric("push.p.lease_expired"),
    ]


_LEASED = ["finished", "staged", "matched", "awaiting_handshake"]
# After a failed handshake or WRITE nothing is retried (R-P12): the blocks wait only for
# the lease to reclaim them, so D's heartbeats no longer extend it.
_GIVEN_UP = ["handshake_failed", "write_failed"]

P_LEASE: Declaration[PLeaseCtx] = Declaration(
    name="push.p_lease",
    description=__doc__ or "",
    states=[
        {"name": "finished", "timeout": LEASE, "tags": ("drainable", "heartbeat_extends")},
        {"name": "staged", "timeout": LEASE, "tags": ("heartbeat_extends",)},
        {"name": "matched", "timeout": LEASE, "tags": ("heartbeat_extends",)},
        {"name": "awaiting_handshake", "timeout": LEASE, "tags": ("heartbeat_extends",)},
        {"name": "handshake_failed", "timeout": LEASE},
        {"name": "posted", "tags": ("pollable",)},
        {"name": "writing", "timeout": WRITE_TIMEOUT, "tags": ("pollable",)},
        {"name": "write_failed", "timeout": LEASE},
        {"name": "reported", "tags": ("confirmable",)},
        {"name": "sent", "final": True},
        {"name": "expired", "final": True},
    ],
    initial="finished",
    transitions=[
        {"trigger": Staged, "source": "finished", "dest": "staged", "after": "stage"},
        {"trigger": Matched, "source": "staged", "dest": "matched"},
        {"trigger": HandshakeStarted, "source": "matched", "dest": "awaiting_handshake"},
        {"trigger": HandshakeDone, "source": "awaiting_handshake", "dest": "matched"},
        {
            "trigger": HandshakeFailed,
            "source": ["matched", "awaiting_handshake"],
            "dest": "handshake_failed",
            "after": "log_handshake_failed",
        },
        {"trigger": WritePosted, "source": "matched", "dest": "posted"},
        {
            "trigger": WriteSubmitFailed,
            "source": "matched",
            "dest": "write_failed",
            "after": "count_failed",
        },
        {"trigger": Poll, "source": "posted", "dest": "writing", "after": "poll"},
        {"trigger": Poll, "source": "writing", "dest": None, "after": "poll"},
        {"trigger": WriteDone, "source": "writing", "dest": "reported", "after": "done_sending"},
        {
            "trigger": WriteError,
            "source": "writing",
            "dest": "write_failed",
            "after": "count_failed",
        },
        {"trigger": Heartbeat, "source": _LEASED, "dest": None, "after": "extend_lease"},
        {"trigger": FinishedSending, "source": "reported", "dest": "sent"},
    ],
    ignore=[
        ("posted", Heartbeat),
        ("writing", Heartbeat),
        ("reported", Heartbeat),
        *((state, Heartbeat) for state in _GIVEN_UP),
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
