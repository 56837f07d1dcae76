"""D registration lifecycle of one worker rank: this rank's blocks, from the step's
metadata to received KV (R-P02, R-P05, R-P08, R-P12, R-T03, R-T04, B-10, S-02).

One instance per decode request, keyed by D's request id, on the rank's main-thread bus.
The rank, not only the scheduler, keeps the request: vLLM 0.33 reads the workers' load
errors (`invalid_block_ids`) before it hands the connector their outputs, so a rank whose
part fails must name the failed blocks itself (docs/architecture.md).

- `start_load_kv` hands the registration to the writer thread (`Enqueued`), which sends
  this rank's `PUSH_REG` to the P ranks that write into it, every stage of a PP producer
  (R-T04), through the handshake machine (R-P05). The writer reports the handshake and
  the send back; a failed handshake or `send_notif` fails this rank's part (R-P12).
- P's completion notifs `<request_id>:<tp_size>` arrive forwarded by the writer (R-P08).
  Each counts once per P rank that writes into this rank: vLLM 0.33 counts
  `pp x max(1, P.tp / D.tp)` of them; here each must come from an agent of the P engine
  the registration was sent to, from a rank that writes into this one, with P's TP size
  (S-02): anything else is a `RemoteProtocolError` that changes nothing, and a second
  completion from the same rank is a counted duplicate.
- A `PUSH_FAIL` notif (B-10) counts like a completion: once every writer reported, the
  part is failed and its blocks invalid.
- The scheduler ends what it gave up on (watchdog, abort): `End` drops it at once.

Tags: `reg_unsent` (its `PUSH_REG` has not left yet), `receiving`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.kv.effects import (
    CountFailure,
    EvictRegistration,
    ReportEnded,
    ReportFailedRecving,
    ReportFinishedRecving,
    SendRegistration,
)
from kvhandoff.machines.kv.events import (
    Completion,
    End,
    Enqueued,
    HandshakeDone,
    HandshakeFailed,
    HandshakeStarted,
    RegSent,
    SendFailed,
    WriteFailed,
)
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.protocol.push_wire import PushRegistration


@dataclass(slots=True)
class DRegistrationCtx:
    key: str
    registration: PushRegistration
    writers: frozenset[int] = frozenset({0})
    """The global P ranks whose WRITEs land in this rank (`tp_mapping.writers_of`)."""
    seen: set[int] = field(default_factory=set)
    failures: list[str] = field(default_factory=list)


Notified = Completion | WriteFailed


def from_writer(ctx: DRegistrationCtx, event: Notified) -> bool:
    """S-02: an agent of the P engine this rank registered with, of a rank that writes
    here, speaking P's TP size."""
    reg = ctx.registration
    if event.engine != reg.remote_engine_id or event.rank not in ctx.writers:
        return False
    return not isinstance(event, Completion) or event.tp_size == reg.remote_tp_size


def repeated(ctx: DRegistrationCtx, event: Notified) -> bool:
    return event.rank in ctx.seen


def completes(ctx: DRegistrationCtx, event: Notified) -> bool:
    return len(ctx.seen | {event.rank}) >= len(ctx.writers)


def clean(ctx: DRegistrationCtx, event: Completion) -> bool:
    return not ctx.failures


def count(ctx: DRegistrationCtx, event: Notified) -> None:
    if event.rank is not None:
        ctx.seen.add(event.rank)
    if isinstance(event, WriteFailed):
        ctx.failures.append(f"P rank {event.rank}: {event.reason or 'WRITE failed'}")


def count_duplicate(ctx: DRegistrationCtx, event: Notified) -> list[Effect]:
    return [Metric("push.d.duplicate_completions")]


def enqueue(ctx: DRegistrationCtx, event: Enqueued) -> list[Effect]:
    return [SendRegistration(ctx.key, ctx.registration)]


def finish_recv(ctx: DRegistrationCtx, event: Completion) -> list[Effect]:
    count(ctx, event)
    return [ReportFinishedRecving(ctx.key)]


def fail_recv(
    ctx: DRegistrationCtx, event: Notified | HandshakeFailed | SendFailed
) -> list[Effect]:
    effects: list[Effect] = []
    if isinstance(event, Completion | WriteFailed):
        count(ctx, event)
        reason = "; ".join(ctx.failures)
        effects.append(CountFailure("transfer_error"))
    elif isinstance(event, HandshakeFailed):
        reason = "push handshake with the prefill engine failed"
        effects.append(CountFailure("handshake"))
    else:
        reason = "PUSH_REG could not be sent"
        effects.append(CountFailure("post"))
    blocks = ctx.registration.block_ids
    return [ReportFailedRecving(ctx.key, blocks, reason), EvictRegistration(ctx.key), *effects]


def drop(ctx: DRegistrationCtx, event: End) -> list[Effect]:
    return [ReportEnded(ctx.key), EvictRegistration(ctx.key)]


_NOTIFIED = (Completion, WriteFailed)
_OPEN = ["new", "queued", "awaiting_handshake", "receiving"]


def _notified(trigger: type[Notified]) -> list[dict[str, object]]:
    """A writer's notif: a second one from the same rank is a duplicate; the last one
    ends this rank's part, received only if every writer completed."""
    rows: list[dict[str, object]] = [
        {"conditions": ["from_writer", "repeated"], "dest": None, "after": "count_duplicate"},
    ]
    if trigger is Completion:
        rows.append(
            {
                "conditions": ["from_writer", "completes", "clean"],
                "unless": "repeated",
                "dest": "received",
                "after": "finish_recv",
            }
        )
        rows.append(
            {
                "conditions": ["from_writer", "completes"],
                "unless": ["repeated", "clean"],
                "dest": "failed",
                "after": "fail_recv",
            }
        )
    else:
        rows.append(
            {
                "conditions": ["from_writer", "completes"],
                "unless": "repeated",
                "dest": "failed",
                "after": "fail_recv",
            }
        )
    rows.append(
        {
            "conditions": "from_writer",
            "unless": ["repeated", "completes"],
            "dest": None,
            "after": "count",
        }
    )
    return [{"trigger": trigger, "source": "receiving", **row} for row in rows]


D_REGISTRATION: Declaration[DRegistrationCtx] = Declaration(
    name="push.d_registration",
    description=__doc__ or "",
    states=[
        {"name": "new", "tags": ("reg_unsent",)},
        {"name": "queued", "tags": ("reg_unsent",)},
        {"name": "awaiting_handshake", "tags": ("reg_unsent",)},
        {"name": "receiving", "tags": ("receiving",)},
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
        {"trigger": RegSent, "source": "queued", "dest": "receiving"},
        {"trigger": SendFailed, "source": "queued", "dest": "failed", "after": "fail_recv"},
        *(row for trigger in _NOTIFIED for row in _notified(trigger)),
        {"trigger": End, "source": _OPEN, "dest": "ended", "after": "drop"},
    ],
    callbacks={
        "from_writer": from_writer,
        "repeated": repeated,
        "completes": completes,
        "clean": clean,
        "count": count,
        "count_duplicate": count_duplicate,
        "enqueue": enqueue,
        "finish_recv": finish_recv,
        "fail_recv": fail_recv,
        "drop": drop,
    },
    context=DRegistrationCtx,
)
