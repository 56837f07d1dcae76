"""Pull-mode D read lifecycle of one worker rank (B-09): D reads P's finished blocks with
NIXL READ.

One instance per decode request, keyed by D's request id, on the rank's main-thread bus.
The base is push mode's: the scheduler's `push.d_request` (watchdog, aggregation), the
remote-engine machine, the writer thread, leases and heartbeats.

- `start_load_kv` creates it from the step's metadata and hands the read to the writer
  thread (`StartRead`).
- The writer reports back: the D->P handshake started and was replayed, or failed; the
  READ was posted (completion notif `<P request id>:<tp_size>` rides on it, so P frees
  its lease) or failed to post. A posted READ is reported to the scheduler, whose
  watchdog then stops: the READ runs to its end under its own timeout. get_finished polls
  it: done reports the receive; an error marks the blocks invalid. A READ seen done after
  P's lease may have ended (the deadline a kvhandoff P puts on its params, less the
  clocks' skew) may have read blocks P freed and reused: it fails like an error, so D
  never takes such bytes as received.
- The scheduler ends a read it gave up on (`End`): one not posted yet is revoked (the
  writer answers `Revoked` and will not post it); a posted READ runs to its end first. The
  rank then reports it dropped, so the engine reuses the blocks only after every READ
  into them ended.

Every event here is local (D's own READ, polled). Tags: `pollable` (a READ is posted:
get_finished polls it), `polled` (polled before: get_finished may skip it while the
transport says the READ is still in flight).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.kv.effects import (
    CountFailure,
    PollTransfer,
    ReleaseTransfer,
    ReportEnded,
    ReportFailedRecving,
    ReportFinishedRecving,
    ReportPosted,
    RevokeRead,
    StartRead,
)
from kvhandoff.machines.kv.events import (
    End,
    Enqueued,
    HandshakeDone,
    HandshakeFailed,
    HandshakeStarted,
    Poll,
    ReadDone,
    ReadError,
    ReadPosted,
    ReadSubmitFailed,
    ReadTimeout,
    Revoked,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.protocol.legs import PullSource


@dataclass(slots=True)
class DReadCtx:
    key: str
    source: PullSource
    block_ids: tuple[int, ...]
    lease_deadline: float | None = None
    """D's wall-clock time after which P's lease may have ended (None: P did not say)."""
    ending: bool = False
    """The scheduler ended it while its READ was in flight: report it dropped."""


READ_TIMEOUT = Timeout("push_write_timeout", "failed", ReadTimeout, action="abandon_read")


def enqueue(ctx: DReadCtx, event: Enqueued) -> list[Effect]:
    return [StartRead(ctx.key, ctx.source, ctx.block_ids)]


def posted(ctx: DReadCtx, event: ReadPosted) -> list[Effect]:
    return [] if ctx.ending else [ReportPosted(ctx.key)]


def poll(ctx: DReadCtx, event: Poll) -> list[Effect]:
    return [PollTransfer(ctx.key)]


def mark_ending(ctx: DReadCtx, event: End) -> None:
    ctx.ending = True


def revoke(ctx: DReadCtx, event: End) -> list[Effect]:
    ctx.ending = True
    return [RevokeRead(ctx.key)]


def dropped(
    ctx: DReadCtx, event: End | Revoked | HandshakeFailed | ReadSubmitFailed
) -> list[Effect]:
    return [ReportEnded(ctx.key)]


def within_lease(ctx: DReadCtx, event: ReadDone) -> bool:
    """Seen done while P's lease certainly held the blocks (or P named no deadline)."""
    deadline = ctx.lease_deadline
    return deadline is None or event.wall is None or event.wall <= deadline


def past_lease(ctx: DReadCtx, event: ReadDone) -> list[Effect]:
    return _failed(ctx, "pull read done after P's lease may have ended", "timeout")


def finish_recv(ctx: DReadCtx, event: ReadDone) -> list[Effect]:
    if ctx.ending:
        return [ReportEnded(ctx.key)]
    return [ReportFinishedRecving(ctx.key), Metric("pull.d.received")]


def _failed(ctx: DReadCtx, reason: str, cause: str) -> list[Effect]:
    if ctx.ending:
        return [ReportEnded(ctx.key)]
    return [
        ReportFailedRecving(ctx.key, ctx.block_ids, reason),
        CountFailure(cause),
        Metric("pull.d.failed_recv"),
    ]


def fail_recv(ctx: DReadCtx, event: HandshakeFailed | ReadSubmitFailed | ReadError) -> list[Effect]:
    cause = {HandshakeFailed: "handshake", ReadSubmitFailed: "post"}.get(
        type(event), "transfer_error"
    )
    return _failed(ctx, "pull read failed", cause)


def abandon_read(ctx: DReadCtx, event: ReadTimeout) -> list[Effect]:
    """A READ that outlived its timeout is released (cancelled) before the blocks it
    writes into are reported invalid and reused."""
    return [ReleaseTransfer(ctx.key), *_failed(ctx, "pull read timed out", "timeout")]


D_READ: Declaration[DReadCtx] = Declaration(
    name="pull.d_read",
    description=__doc__ or "",
    states=[
        "new",
        "queued",
        "awaiting_handshake",
        "revoking",
        {"name": "posted", "tags": ("pollable",)},
        {"name": "reading", "timeout": READ_TIMEOUT, "tags": ("pollable", "polled")},
        {"name": "received", "final": True},
        {"name": "failed", "final": True},
        {"name": "ended", "final": True},
    ],
    initial="new",
    transitions=[
        {"trigger": Enqueued, "source": "new", "dest": "queued", "after": "enqueue"},
        {"trigger": HandshakeStarted, "source": "queued", "dest": "awaiting_handshake"},
        {"trigger": HandshakeDone, "source": "awaiting_handshake", "dest": "queued"},
        {
            "trigger": HandshakeFailed,
            "source": ["queued", "awaiting_handshake"],
            "dest": "failed",
            "after": "fail_recv",
        },
        {
            "trigger": ReadPosted,
            "source": ["queued", "revoking"],
            "dest": "posted",
            "after": "posted",
        },
        {"trigger": ReadSubmitFailed, "source": "queued", "dest": "failed", "after": "fail_recv"},
        {"trigger": Poll, "source": "posted", "dest": "reading", "after": "poll"},
        {"trigger": Poll, "source": "reading", "dest": None, "after": "poll"},
        {
            "trigger": ReadDone,
            "source": "reading",
            "dest": "received",
            "conditions": "within_lease",
            "after": "finish_recv",
        },
        {"trigger": ReadDone, "source": "reading", "dest": "failed", "after": "past_lease"},
        {"trigger": ReadError, "source": "reading", "dest": "failed", "after": "fail_recv"},
        {"trigger": End, "source": "new", "dest": "ended", "after": "dropped"},
        {
            "trigger": End,
            "source": ["queued", "awaiting_handshake"],
            "dest": "revoking",
            "after": "revoke",
        },
        {"trigger": End, "source": ["posted", "reading"], "dest": None, "after": "mark_ending"},
        {
            "trigger": Revoked,
            "source": "revoking",
            "dest": "ended",
            "after": "dropped",
        },
        {
            "trigger": HandshakeFailed,
            "source": "revoking",
            "dest": "ended",
            "after": "dropped",
        },
        {
            "trigger": ReadSubmitFailed,
            "source": "revoking",
            "dest": "ended",
            "after": "dropped",
        },
    ],
    ignore=[
        ("revoking", HandshakeStarted),
        ("revoking", HandshakeDone),
        ("revoking", End),
        ("posted", Revoked),
        ("reading", Revoked),
    ],
    callbacks={
        "enqueue": enqueue,
        "posted": posted,
        "poll": poll,
        "mark_ending": mark_ending,
        "revoke": revoke,
        "dropped": dropped,
        "within_lease": within_lease,
        "past_lease": past_lease,
        "finish_recv": finish_recv,
        "fail_recv": fail_recv,
        "abandon_read": abandon_read,
    },
    config_defaults={"push_write_timeout": 30.0},
    context=DReadCtx,
)
