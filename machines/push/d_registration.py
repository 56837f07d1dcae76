"""D registration lifecycle: D's pre-allocated blocks, from allocation to received KV.

One instance per decode request, keyed by D's request id, on D's main-thread bus.

- `update_state_after_alloc` stashes the registration and arms the watchdog (R-P02, R-P10).
- `build_connector_meta` drains it into `meta.push_registrations` (`drained`).
- `start_load_kv` enqueues it on the reg-send inbox (`enqueued`).
- The writer reports back: the D->P handshake started and was replayed (R-P05), or the
  `PUSH_REG` notif left (`reg_sent`); a failed handshake or `send_notif` fails the
  receive and marks the blocks invalid (R-P12).
- P's completion notifs `<request_id>:<tp_size>` arrive (R-P06, R-P08); once every P rank
  writing into this rank has reported, get_finished reports `finished_recving` and the
  scheduler's `update_connector_output` clears the watchdog (R-P09).
- B-06: a WRITE-failed notif from P fails the receive at once.
- The watchdog spans every state until the receive is reported: on expiry the registration
  is dropped with a warning and never re-sent; the request stays awaiting its KV until
  the engine's own abort path fails it (R-P10).

`Completion` and `WriteFailed` come from P: one the state does not declare (a `PUSH_FAIL`
after the last completion, a completion after a `PUSH_FAIL`, a duplicate after the
request ended) is a `RemoteProtocolError` that changes nothing. Tags: `drainable` (the
next connector meta carries it), `reg_unsent` (its `PUSH_REG` has not left yet),
`needs_heartbeat` (D keeps P's lease alive for it), `confirmable` (reported to the
engine, awaiting `update_connector_output`), `abortable` (the engine's abort path ends
it; once its receive is reported there is nothing left to abort), `unreported` (ended
without a report: the engine's abort path must fail it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.push.effects import (
    EnqueueRegistration,
    QueueEviction,
    ReportFailedRecving,
    ReportFinishedRecving,
    Warn,
)
from kvhandoff.machines.push.events import (
    Abort,
    Completion,
    Drained,
    Enqueued,
    FinishedRecving,
    HandshakeDone,
    HandshakeFailed,
    HandshakeStarted,
    RegSent,
    SendFailed,
    WatchdogExpired,
    WriteFailed,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.protocol.push_wire import PushRegistration


@dataclass(slots=True)
class DRegistrationCtx:
    key: str
    registration: PushRegistration
    completions_needed: int = 1
    completions_seen: int = 0


WATCHDOG = Timeout(
    "push_registration_timeout", "expired", WatchdogExpired, action="drop_registration"
)


def enqueue(ctx: DRegistrationCtx, event: Enqueued) -> list[Effect]:
    return [EnqueueRegistration(ctx.key, ctx.registration)]


def count_completion(ctx: DRegistrationCtx, event: Completion) -> None:
    ctx.completions_seen += 1


def last_completion(ctx: DRegistrationCtx, event: Completion) -> bool:
    return ctx.completions_seen + 1 >= ctx.completions_needed


def finish_recv(ctx: DRegistrationCtx, event: Completion) -> list[Effect]:
    ctx.completions_seen += 1
    return [ReportFinishedRecving(ctx.key)]


def fail_recv(
    ctx: DRegistrationCtx, event: HandshakeFailed | SendFailed | WriteFailed
) -> list[Effect]:
    reason = "push registration failed"
    if isinstance(event, WriteFailed) and event.reason:
        reason = event.reason
    return [
        ReportFailedRecving(ctx.key, ctx.registration.block_ids, reason),
        QueueEviction(ctx.key),
        Metric("push.d.failed_recv"),
    ]


def drop_registration(ctx: DRegistrationCtx, event: WatchdogExpired) -> list[Effect]:
    return [
        Warn(ctx.key, "push registration watchdog expired; dropped, not re-sent"),
        QueueEviction(ctx.key),
        Metric("push.d.watchdog_expired"),
    ]


def drop_aborted(ctx: DRegistrationCtx, event: Abort) -> list[Effect]:
    return [QueueEviction(ctx.key)]


_IN_FLIGHT = ["queued", "awaiting_handshake", "sent"]

D_REGISTRATION: Declaration[DRegistrationCtx] = Declaration(
    name="push.d_registration",
    description=__doc__ or "",
    states=[
        {
            "name": "stashed",
            "timeout": WATCHDOG,
            "tags": ("drainable", "reg_unsent", "abortable"),
        },
        {"name": "in_meta", "timeout": WATCHDOG, "tags": ("reg_unsent", "abortable")},
        {"name": "queued", "timeout": WATCHDOG, "tags": ("reg_unsent", "abortable")},
        {
            "name": "awaiting_handshake",
            "timeout": WATCHDOG,
            "tags": ("reg_unsent", "abortable"),
        },
        {"name": "sent", "timeout": WATCHDOG, "tags": ("needs_heartbeat", "abortable")},
        {"name": "reported", "tags": ("confirmable",)},
        {"name": "received", "final": True},
        {"name": "expired", "final": True, "tags": ("unreported",)},
        {"name": "failed", "final": True},
        {"name": "aborted", "final": True, "tags": ("unreported",)},
    ],
    initial="stashed",
    transitions=[
        {"trigger": Drained, "source": "stashed", "dest": "in_meta"},
        {"trigger": Enqueued, "source": "in_meta", "dest": "queued", "after": "enqueue"},
        {"trigger": HandshakeStarted, "source": "queued", "dest": "awaiting_handshake"},
        {"trigger": HandshakeDone, "source": "awaiting_handshake", "dest": "queued"},
        {
            "trigger": HandshakeFailed,
            "source": ["queued", "awaiting_handshake"],
            "dest": "failed",
            "after": "fail_recv",
        },
        {"trigger": RegSent, "source": "queued", "dest": "sent"},
        {"trigger": SendFailed, "source": "queued", "dest": "failed", "after": "fail_recv"},
        {
            "trigger": Completion,
            "source": "sent",
            "dest": "reported",
            "conditions": "last_completion",
            "after": "finish_recv",
        },
        {"trigger": Completion, "source": "sent", "dest": None, "after": "count_completion"},
        {"trigger": WriteFailed, "source": _IN_FLIGHT, "dest": "failed", "after": "fail_recv"},
        {"trigger": FinishedRecving, "source": "reported", "dest": "received"},
        {
            "trigger": Abort,
            "source": ["stashed", "in_meta", *_IN_FLIGHT],
            "dest": "aborted",
            "after": "drop_aborted",
        },
    ],
    # A duplicated completion after the last one changes nothing.
    ignore=[("reported", Completion)],
    callbacks={
        "enqueue": enqueue,
        "count_completion": count_completion,
        "last_completion": last_completion,
        "finish_recv": finish_recv,
        "fail_recv": fail_recv,
        "drop_registration": drop_registration,
        "drop_aborted": drop_aborted,
    },
    config_defaults={"push_registration_timeout": 480.0},
    context=DRegistrationCtx,
)
