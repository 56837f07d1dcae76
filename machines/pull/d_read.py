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
  its own timeout. Heartbeats keep P's lease alive meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.push.effects import (
    EnqueueRead,
    FailedRecving,
    FinishedRecving,
    PollTransfer,
    QueueEviction,
    ReleaseTransfer,
    Warn,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Metric
from kvhandoff.protocol.legs import PullSource

KIND = "pull.d_read"


@dataclass(slots=True)
class DReadCtx:
    source: PullSource
    block_ids: tuple[int, ...]


WATCHDOG = Timeout("push_registration_timeout", "expired", "watchdog_expired", action="give_up")
READ_TIMEOUT = Timeout("push_write_timeout", "failed", "read_timeout", action="abandon_read")


def enqueue(inst: Any, payload: Any) -> list[object]:
    ctx: DReadCtx = inst.ctx
    return [EnqueueRead(inst.key, ctx.source, ctx.block_ids)]


def poll(inst: Any, payload: Any) -> list[object]:
    return [PollTransfer(inst.key)]


def finish_recv(inst: Any, payload: Any) -> list[object]:
    return [FinishedRecving(inst.key), QueueEviction(inst.key), Metric("pull.d.received")]


def fail_recv(inst: Any, payload: Any) -> list[object]:
    reason = str(payload) if payload else "pull read failed"
    return [
        FailedRecving(inst.key, inst.ctx.block_ids, reason),
        QueueEviction(inst.key),
        Metric("pull.d.failed_recv"),
    ]


def abandon_read(inst: Any, payload: Any) -> list[object]:
    """A READ that outlived its timeout is released (cancelled) before the blocks it
    writes into are reported invalid and reused."""
    return [ReleaseTransfer(inst.key), *fail_recv(inst, "pull read timed out")]


def give_up(inst: Any, payload: Any) -> list[object]:
    return [Warn(inst.key, "pull read watchdog expired"), QueueEviction(inst.key)]


D_READ = Declaration(
    name=KIND,
    description=__doc__ or "",
    states=[
        {"name": "waiting", "timeout": WATCHDOG},
        {"name": "in_meta", "timeout": WATCHDOG},
        {"name": "queued", "timeout": WATCHDOG},
        {"name": "awaiting_handshake", "timeout": WATCHDOG},
        {"name": "reading", "timeout": READ_TIMEOUT},
        "reported",
        {"name": "received", "final": True},
        {"name": "failed", "final": True},
        {"name": "expired", "final": True},
        {"name": "aborted", "final": True},
    ],
    initial="waiting",
    transitions=[
        {"trigger": "drained", "source": "waiting", "dest": "in_meta"},
        {"trigger": "enqueued", "source": "in_meta", "dest": "queued", "after": "enqueue"},
        {"trigger": "handshake_started", "source": "queued", "dest": "awaiting_handshake"},
        {"trigger": "handshake_done", "source": "awaiting_handshake", "dest": "queued"},
        {
            "trigger": "handshake_failed",
            "source": ["queued", "awaiting_handshake"],
            "dest": "failed",
            "after": "fail_recv",
        },
        {"trigger": "read_posted", "source": "queued", "dest": "reading"},
        {
            "trigger": "read_submit_failed",
            "source": "queued",
            "dest": "failed",
            "after": "fail_recv",
        },
        {"trigger": "poll", "source": "reading", "dest": None, "after": "poll"},
        {"trigger": "read_done", "source": "reading", "dest": "reported", "after": "finish_recv"},
        {"trigger": "read_error", "source": "reading", "dest": "failed", "after": "fail_recv"},
        {"trigger": "finished_recving", "source": "reported", "dest": "received"},
        {
            "trigger": "abort",
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
