"""Per-remote-engine handshake lifecycle, with defer and replay (R-P05, R-P15, B-08).

One instance per remote engine id, on the writer thread's bus. The handshake itself
(ZMQ side channel, agent metadata, compatibility check) runs on a background executor
and never blocks the writer; its callback only posts the result and wakes the writer.

- `ensure` with an operation: from idle or failed it starts a handshake and defers the
  operation; while one is in progress it defers the operation too; once connected it
  replays the operation at once.
- `succeeded` replays every deferred operation onto its inbox (a registration onto the
  reg-send inbox, a matched push onto the deferred-push inbox); the second pass finds the
  agent connected and proceeds.
- `failed` (or the declared handshake timeout) reports `handshake_failed` for every
  deferred operation: no retry loop. A later operation may start a fresh handshake.
- `peer_lost` forgets the remote agent, so the next operation re-handshakes (B-08).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvhandoff.machines.push.effects import (
    DropRemoteAgent,
    ReplayPush,
    ReplayRead,
    ReplayRegistration,
    ReportToMain,
    StartHandshake,
)
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Metric

KIND = "push.handshake"

DeferredOp = ReplayRegistration | ReplayPush | ReplayRead


@dataclass(slots=True)
class HandshakeCtx:
    host: str
    port: int
    deferred: list[DeferredOp] = field(default_factory=list)


def _defer(inst: Any, op: DeferredOp) -> list[object]:
    inst.ctx.deferred.append(op)
    return [ReportToMain(op.request_id, "handshake_started")]


def endpoint(op: DeferredOp) -> tuple[str, int]:
    """The side channel the operation names for its peer (a restarted peer may move)."""
    if isinstance(op, ReplayRegistration):
        return op.registration.remote_host, op.registration.remote_port
    if isinstance(op, ReplayPush):
        return op.registration.decode_host, op.registration.decode_port
    return op.source.prefill.host, op.source.prefill.port


def start(inst: Any, op: DeferredOp) -> list[object]:
    ctx: HandshakeCtx = inst.ctx
    ctx.host, ctx.port = endpoint(op)
    return [StartHandshake(inst.key, ctx.host, ctx.port), *_defer(inst, op)]


def defer(inst: Any, op: DeferredOp) -> list[object]:
    return _defer(inst, op)


def replay_now(inst: Any, op: DeferredOp) -> list[object]:
    return [op]


def replay_deferred(inst: Any, payload: Any) -> list[object]:
    ops, inst.ctx.deferred = inst.ctx.deferred, []
    reports: list[object] = [ReportToMain(op.request_id, "handshake_done") for op in ops]
    return [*reports, *ops, Metric("push.handshake.succeeded")]


def fail_deferred(inst: Any, payload: Any) -> list[object]:
    ops, inst.ctx.deferred = inst.ctx.deferred, []
    reports: list[object] = [ReportToMain(op.request_id, "handshake_failed") for op in ops]
    return [*reports, Metric("push.handshake.failed")]


def forget_agent(inst: Any, payload: Any) -> list[object]:
    return [DropRemoteAgent(inst.key)]


HANDSHAKE = Declaration(
    name=KIND,
    description=__doc__ or "",
    states=[
        "idle",
        {
            "name": "in_progress",
            "timeout": Timeout("handshake_timeout", "failed", "handshake_timeout", "fail_deferred"),
        },
        "connected",
        "failed",
    ],
    initial="idle",
    transitions=[
        {
            "trigger": "ensure",
            "source": ["idle", "failed"],
            "dest": "in_progress",
            "after": "start",
        },
        {"trigger": "ensure", "source": "in_progress", "dest": None, "after": "defer"},
        {"trigger": "ensure", "source": "connected", "dest": None, "after": "replay_now"},
        {
            "trigger": "succeeded",
            "source": "in_progress",
            "dest": "connected",
            "after": "replay_deferred",
        },
        {"trigger": "failed", "source": "in_progress", "dest": "failed", "after": "fail_deferred"},
        {"trigger": "peer_lost", "source": "connected", "dest": "idle", "after": "forget_agent"},
    ],
    # Late results of a handshake that already timed out or was superseded (a newer one
    # connected, or the peer was lost since), and losses of unknown peers.
    ignore=[
        ("failed", "succeeded"),
        ("failed", "failed"),
        ("connected", "succeeded"),
        ("connected", "failed"),
        ("idle", "succeeded"),
        ("idle", "failed"),
        ("idle", "peer_lost"),
        ("failed", "peer_lost"),
        ("in_progress", "peer_lost"),
    ],
    callbacks={
        "start": start,
        "defer": defer,
        "replay_now": replay_now,
        "replay_deferred": replay_deferred,
        "fail_deferred": fail_deferred,
        "forget_agent": forget_agent,
    },
    config_defaults={"handshake_timeout": 10.0},
    context=HandshakeCtx,
)
