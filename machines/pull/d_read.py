"""Pull-mode D read lifecycle (B-09): D reads P's finished blocks with NIXL READ.

One instance per decode request, keyed by D's request id, on D's main-thread bus. The
base is push mode's: the same handshake machine, writer thread, lease and heartbeats, and
the same failure accounting on D.

- `update_state_after_alloc` with a decode leg naming P's request and blocks creates it
  `waiting`, watchdog armed; `build_connector_meta` drains it; `start_load_kv` hands the
  read to the writer thread (`enqueued`).
- The writer reports back: the D->P handshake started and was replayed, or failed; the
  READ was posted (completion notif `<P request id>:<tp_size>` rides on it, so P frees
  its lease) or failed to post. get_finished polls the READ: done reports
  `finished_recving`; an error marks the blocks invalid and reports a failed receive.
- The watchdog covers everything up to the posted READ; a READ in flight is guarded by
  its own timeout. Heartbeats keep P's lease alive meanwhile. As for P's WRITE, the main
  thread applies the writer's report before its time moves on (the watchdog can never
  give up blocks a posted READ writes into): the report lands in `posted`, and the first
  poll moves it to `reading` and starts the read timeout.

Every event here is local (D's own READ, polled). Tags: `drainable` (the next connector
meta carries it), `needs_heartbeat` (D keeps P's lease alive for it), `pollable` (a READ
is posted: get_finished polls it), `confirmable` (reported to the engine, awaiting
`update_connector_output`), `abortable` (the engine's abort path ends it; a posted READ
runs to its end), `unreported` (ended without a report: the engine's abort path must
fail it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.push.effects import (
    EnqueueRead,
    PollTransfer,
    QueueEviction,
    ReleaseTransfer,
    ReportFailedRecving,
    ReportFinishedRecving,
    Warn,
)
from kvhandoff.machines.push.events import (
    Abort,
    Drained,
    Enqueued,
    FinishedRecving,
    HandshakeDone,
    HandshakeFailed,
    HandshakeStarted,
    Poll,
    ReadDone,
    ReadError,
    ReadPosted,
    ReadSubmitFailed,
    ReadTimeout,
    WatchdogExpired,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.protocol.legs import PullSource


@dataclass(slots=True)
class DReadCtx:
    key: str
    source: PullSource
    block_ids: tuple[int, ...]


WATCHDOG = Timeout("push_registration_timeout", "expired", WatchdogExpired, action="give_up")
READ_TIMEOUT = Timeout("push_write_timeout", "failed", ReadTimeout, action="abandon_read")


def enqueue(ctx: DReadCtx, event: Enqueued) -> list[Effect]:
    return [EnqueueRead(ctx.key, ctx.source, ctx.block_ids)]


def poll(ctx: DReadCtx, event: Poll) -> list[Effect]:
    return [PollTransfer(ctx.key)]


def finish_recv(ctx: DReadCtx, event: ReadDone) -> list[Effect]:
    return [ReportFinishedRecving(ctx.key), QueueEviction(ctx.key), Metric("pull.d.received")]


def _failed(ctx: DReadCtx, reason: str) -> list[Effect]:
    return [
        ReportFailedRecving(ctx.key, ctx.block_ids, reason),
        QueueEviction(ctx.key),
        Metric("pull.d.failed_recv"),
    ]


def fail_recv(ctx: DReadCtx, event: HandshakeFailed | ReadSubmitFailed | ReadError) -> list[Effect]:
    return _failed(ctx, "pull read failed")


def abandon_read(ctx: DReadCtx, event: ReadTimeout) -> list[Effect]:
    """A READ that outlived its timeout is released (cancelled) before the blocks it
    writes into are reported invalid and reused."""
    return [ReleaseTransfer(ctx.key), *_failed(ctx, "pull read timed out")]


def give_up(ctx: DReadCtx, event: WatchdogExpired | Abort) -> list[Effect]:
    return [Warn(ctx.key, "pull read watchdog expired"), QueueEviction(ctx.key)]


D_READ: Declaration[DReadCtx] = Declaration(
    name="pull.d_read",
    description=__doc__ or "",
    states=[
        {"name": "waiting", "timeout": WATCHDOG, "tags": ("drainable", "abortable")},
        {"name": "in_meta", "timeout": WATCHDOG, "tags": ("abortable",)},
        {"name": "queued", "timeout": WATCHDOG, "tags": ("needs_heartbeat", "abortable")},
        {
            "name": "awaiting_handshake",
            "timeout": WATCHDOG,
            "tags": ("needs_heartbeat", "abortable"),
        },
        {"name": "posted", "tags": ("needs_heartbeat", "pollable")},
        {"name": "reading", "timeout": READ_TIMEOUT, "tags": ("needs_heartbeat", "pollable")},
        {"name": "reported", "tags": ("confirmable",)},
        {"name": "received", "final": True},
        {"name": "failed", "final": True},
        {"name": "expired", "final": True, "tags": ("unreported",)},
        {"name": "aborted", "final": True, "tags": ("unreported",)},
    ],
    initial="waiting",
    transitions=[
        {"trigger": Drained, "source": "waiting", "dest": "in_meta"},
        {"trigger": Enqueued, "source": "in_meta", "dest": "queued", "after": "enqueue"},
        {"trigger": HandshakeStarted, "source": "queued", "dest": "awaiting_handshake"},
        {"trigger": HandshakeDone, "source": "awaiting_handshake", "dest": "queued"},
        {
            "trigger": HandshakeFailed,
            "source": ["queued", "awaiting_handshake"],
            "dest": "failed",
            "after": "fail_recv",
        },
        {"trigger": ReadPosted, "source": "queued", "dest": "posted"},
        {
            "trigger": ReadSubmitFailed,
            "source": "queued",
            "dest": "failed",
            "after": "fail_recv",
        },
        {"trigger": Poll, "source": "posted", "dest": "reading", "after": "poll"},
        {"trigger": Poll, "source": "reading", "dest": None, "after": "poll"},
        {"trigger": ReadDone, "source": "reading", "dest": "reported", "after": "finish_recv"},
        {"trigger": ReadError, "source": "reading", "dest": "failed", "after": "fail_recv"},
        {"trigger": FinishedRecving, "source": "reported", "dest": "received"},
        {
            "trigger": Abort,
            "source": ["waiting", "in_meta", "queued", "awaiting_handshake"],
            "dest": "aborted",
            "after": "give_up",
        },
    ],
    callbacks={
        "enqueue": enqueue,
        "poll": poll,
        "finish_recv": finish_recv,
        "fail_recv": fail_recv,
        "abandon_read": abandon_read,
        "give_up": give_up,
    },
    config_defaults={"push_registration_timeout": 480.0, "push_write_timeout": 30.0},
    context=DReadCtx,
)
