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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.push.effects import (
    EnqueueRegistration,
    FailedRecving,
    FinishedRecving,
    QueueEviction,
    Warn,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Metric
from kvhandoff.protocol.push_wire import PushRegistration

KIND = "push.d_registration"


@dataclass(slots=True)
class DRegistrationCtx:
    registration: PushRegistration
    completions_needed: int = 1
    completions_seen: int = 0


WATCHDOG = Timeout(
    "push_registration_timeout", "expired", "watchdog_expired", action="drop_registration"
)


def enqueue(inst: Any, payload: Any) -> list[object]:
    ctx: DRegistrationCtx = inst.ctx
    return [EnqueueRegistration(inst.key, ctx.registration)]


def count_completion(inst: Any, payload: Any) -> None:
    inst.ctx.completions_seen += 1


def last_completion(inst: Any, payload: Any) -> bool:
    ctx: DRegistrationCtx = inst.ctx
    return ctx.completions_seen + 1 >= ctx.completions_needed


def finish_recv(inst: Any, payload: Any) -> list[object]:
    inst.ctx.completions_seen += 1
    return [FinishedRecving(inst.key)]


def fail_recv(inst: Any, payload: Any) -> list[object]:
    ctx: DRegistrationCtx = inst.ctx
    reason = str(payload) if payload else "push registration failed"
    return [
        FailedRecving(inst.key, ctx.registration.block_ids, reason),
        QueueEviction(inst.key),
        Metric("push.d.failed_recv"),
    ]


def drop_registration(inst: Any, payload: Any) -> list[object]:
    return [
        Warn(inst.key, "push registration watchdog expired; dropped, not re-sent"),
        QueueEviction(inst.key),
        Metric("push.d.watchdog_expired"),
    ]


def drop_aborted(inst: Any, payload: Any) -> list[object]:
    return [QueueEviction(inst.key)]


_IN_FLIGHT = ["queued", "awaiting_handshake", "sent"]

D_REGISTRATION = Declaration(
    name=KIND,
    description=__doc__ or "",
    states=[
        {"name": "stashed", "timeout": WATCHDOG},
        {"name": "in_meta", "timeout": WATCHDOG},
        {"name": "queued", "timeout": WATCHDOG},
        {"name": "awaiting_handshake", "timeout": WATCHDOG},
        {"name": "sent", "timeout": WATCHDOG},
        {"name": "reported"},
        {"name": "received", "final": True},
        {"name": "expired", "final": True},
        {"name": "failed", "final": True},
        {"name": "aborted", "final": True},
    ],
    initial="stashed",
    transitions=[
        {"trigger": "drained", "source": "stashed", "dest": "in_meta"},
        {"trigger": "enqueued", "source": "in_meta", "dest": "queued", "after": "enqueue"},
        {"trigger": "handshake_started", "source": "queued", "dest": "awaiting_handshake"},
        {"trigger": "handshake_done", "source": "awaiting_handshake", "dest": "queued"},
        {
            "trigger": "handshake_failed",
            "source": ["queued", "awaiting_handshake"],
            "dest": "failed",
            "after": "fail_recv",
        },
        {"trigger": "reg_sent", "source": "queued", "dest": "sent"},
        {"trigger": "send_failed", "source": "queued", "dest": "failed", "after": "fail_recv"},
        {
            "trigger": "completion",
            "source": "sent",
            "dest": "reported",
            "conditions": "last_completion",
            "after": "finish_recv",
        },
        {"trigger": "completion", "source": "sent", "dest": None, "after": "count_completion"},
        {"trigger": "write_failed", "source": _IN_FLIGHT, "dest": "failed", "after": "fail_recv"},
        {"trigger": "finished_recving", "source": "reported", "dest": "received"},
        {
            "trigger": "abort",
            "source": ["stashed", "in_meta", *_IN_FLIGHT],
            "dest": "aborted",
            "after": "drop_aborted",
        },
    ],
    # A duplicated completion after the last one changes nothing.
    ignore=[("reported", "completion")],
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
