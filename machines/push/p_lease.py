"""P lease lifecycle of one worker rank: this rank's share of P's finished blocks, held
until it is pushed or the lease runs out (R-P03..R-P06, R-P08, R-P11, R-P12, B-10, S-02).

One instance per prefill request, keyed by P's request id, on the rank's main-thread bus;
this bus is the only owner of the lease. The writer thread owns matching and the posting
of WRITEs; the two talk only through typed commands and reports (no shared state, no
lock):

- `start_load_kv` creates the lease (`kv_lease_duration`, R-P11) and hands the blocks
  to the writer (`StageBlocks`, R-P03).
- The writer reports back: D's `PUSH_REG`s matched the blocks (`Matched`, which binds the
  lease to D's engine, R-P04); the P->D handshake started and was replayed (R-P05); the
  WRITEs were posted, or failed to post (R-P06).
- D's heartbeats extend the lease to max(deadline, now + extension) (R-P08), but only
  from agents of the D engine the lease is bound to (S-02): while P's handshake with D
  has not identified D's agents yet, only the agents whose `PUSH_REG`s matched; before
  a match, or after a failed handshake, nothing extends it.
- When the lease runs out it is revoked, not freed: the writer may be posting a WRITE
  from these blocks at that moment. `RevokeLease` asks the writer to post nothing more;
  its answer (`Revoked`) frees the blocks, or a `WritePosted` it sent first suspends the
  lease under the write timeout. Either way no block is freed under a DMA.
- While WRITEs are in flight the lease is suspended; get_finished polls them. When they
  all completed the blocks are freed (R-P09). A WRITE that fails to post, ends in error
  or outlives `push_write_timeout` frees the blocks at once and D is told with
  `PUSH_FAIL` where it speaks it (B-10); a failed handshake is logged
  `push_handshake_failed` and left to the lease (R-P12, the seed).

Tags: `heartbeat_extends`, `pollable` (WRITEs posted: get_finished polls them),
`polled` (polled before: a further poll can only end the WRITE, so get_finished may skip
it while the transport says the transfer is still in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.kv.effects import (
    CountFailure,
    PollTransfer,
    ReleaseTransfer,
    ReportFinishedSending,
    ReportWriteError,
    RevokeLease,
    StageBlocks,
    Warn,
)
from kvhandoff.machines.kv.events import (
    HandshakeDone,
    HandshakeFailed,
    HandshakeStarted,
    Heartbeat,
    LeaseExpired,
    Matched,
    Poll,
    Revoked,
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
    engine: str = ""
    """The D engine whose `PUSH_REG`s matched the blocks ("" until then)."""
    agents: tuple[str, ...] = ()
    """The D agents that sent those `PUSH_REG`s."""


LEASE = Timeout("kv_lease_duration", "revoking", LeaseExpired, action="revoke")
WRITE_TIMEOUT = Timeout("push_write_timeout", "released", WriteTimeout, action="abandon_write")


def stage(ctx: PLeaseCtx, event: Staged) -> list[Effect]:
    return [StageBlocks(ctx.key, ctx.block_ids)]


def bind(ctx: PLeaseCtx, event: Matched) -> None:
    ctx.engine = event.engine
    ctx.agents = event.agents


def from_bound_peer(ctx: PLeaseCtx, event: Heartbeat) -> bool:
    """S-02: an agent of the bound D engine; before P's handshake with D identified its
    agents, one of the agents whose `PUSH_REG`s matched."""
    if not ctx.engine:
        return False
    if event.engine is not None:
        return event.engine == ctx.engine
    return event.sender in ctx.agents


def extend_lease(ctx: PLeaseCtx, event: Heartbeat) -> list[Effect]:
    return [ExtendDeadline(ctx.lease_extension)]


def poll(ctx: PLeaseCtx, event: Poll) -> list[Effect]:
    return [PollTransfer(ctx.key)]


def log_handshake_failed(ctx: PLeaseCtx, event: HandshakeFailed) -> list[Effect]:
    return [
        Warn(ctx.key, "push_handshake_failed: dropped, no requeue"),
        CountFailure("handshake"),
    ]


def revoke(ctx: PLeaseCtx, event: LeaseExpired) -> list[Effect]:
    return [RevokeLease(ctx.key)]


def reap(ctx: PLeaseCtx, event: Revoked) -> list[Effect]:
    return [ReportFinishedSending(ctx.key), Metric("push.p.lease_expired")]


def free_unposted(ctx: PLeaseCtx, event: WriteSubmitFailed) -> list[Effect]:
    # B-10: nothing is in flight; the writer already told D.
    return [ReportFinishedSending(ctx.key), CountFailure(event.cause)]


def free_failed(ctx: PLeaseCtx, event: WriteError) -> list[Effect]:
    # B-10: every WRITE ended, one in error: free at once and tell D.
    reason = "WRITE failed to post" if event.cause == "post" else "WRITE ended in error"
    return [
        ReportFinishedSending(ctx.key),
        ReportWriteError(ctx.key, reason, event.failed_ranks),
        CountFailure(event.cause),
    ]


def abandon_write(ctx: PLeaseCtx, event: WriteTimeout) -> list[Effect]:
    # The handles must not outlive the wait: released, no WRITE lands after the blocks
    # are freed.
    return [
        ReleaseTransfer(ctx.key),
        ReportFinishedSending(ctx.key),
        ReportWriteError(ctx.key, "WRITE timed out"),
        CountFailure("timeout"),
    ]


def done_sending(ctx: PLeaseCtx, event: WriteDone) -> list[Effect]:
    return [ReportFinishedSending(ctx.key), Metric("push.p.sent")]


_BOUND = ["matched", "awaiting_handshake"]

P_LEASE: Declaration[PLeaseCtx] = Declaration(
    name="push.p_lease",
    description=__doc__ or "",
    states=[
        {"name": "new", "timeout": LEASE},
        {"name": "staged", "timeout": LEASE},
        {"name": "matched", "timeout": LEASE, "tags": ("heartbeat_extends",)},
        {"name": "awaiting_handshake", "timeout": LEASE, "tags": ("heartbeat_extends",)},
        {"name": "handshake_failed", "timeout": LEASE},
        {"name": "revoking"},
        {"name": "posted", "tags": ("pollable",)},
        {"name": "writing", "timeout": WRITE_TIMEOUT, "tags": ("pollable", "polled")},
        {"name": "sent", "final": True},
        {"name": "released", "final": True},
        {"name": "expired", "final": True},
    ],
    initial="new",
    transitions=[
        {"trigger": Staged, "source": "new", "dest": "staged", "after": "stage"},
        {"trigger": Matched, "source": "staged", "dest": "matched", "after": "bind"},
        {"trigger": HandshakeStarted, "source": "matched", "dest": "awaiting_handshake"},
        {"trigger": HandshakeDone, "source": "awaiting_handshake", "dest": "matched"},
        {
            "trigger": HandshakeFailed,
            "source": _BOUND,
            "dest": "handshake_failed",
            "after": "log_handshake_failed",
        },
        {"trigger": WritePosted, "source": ["matched", "revoking"], "dest": "posted"},
        {
            "trigger": WriteSubmitFailed,
            "source": ["matched", "revoking"],
            "dest": "released",
            "after": "free_unposted",
        },
        {"trigger": Revoked, "source": "revoking", "dest": "expired", "after": "reap"},
        {"trigger": Poll, "source": "posted", "dest": "writing", "after": "poll"},
        {"trigger": Poll, "source": "writing", "dest": None, "after": "poll"},
        {"trigger": WriteDone, "source": "writing", "dest": "sent", "after": "done_sending"},
        {"trigger": WriteError, "source": "writing", "dest": "released", "after": "free_failed"},
        {
            "trigger": Heartbeat,
            "source": _BOUND,
            "dest": None,
            "conditions": "from_bound_peer",
            "after": "extend_lease",
        },
    ],
    ignore=[
        # Late or redundant news: the lease no longer waits for any of it.
        ("handshake_failed", Heartbeat),
        *((state, Heartbeat) for state in ("revoking", "posted", "writing")),
        *((state, event) for state in ("revoking",) for event in (Matched, HandshakeStarted)),
        *((state, event) for state in ("revoking",) for event in (HandshakeDone, HandshakeFailed)),
        *((state, Revoked) for state in ("posted", "writing")),
    ],
    callbacks={
        "stage": stage,
        "bind": bind,
        "from_bound_peer": from_bound_peer,
        "extend_lease": extend_lease,
        "poll": poll,
        "log_handshake_failed": log_handshake_failed,
        "revoke": revoke,
        "reap": reap,
        "free_unposted": free_unposted,
        "free_failed": free_failed,
        "abandon_write": abandon_write,
        "done_sending": done_sending,
    },
    config_defaults={"kv_lease_duration": 30.0, "push_write_timeout": 30.0},
    context=PLeaseCtx,
)
