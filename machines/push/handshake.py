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

Every event here is local: the result comes from our own handshake job (late results of
a superseded handshake are declared ignored), a lost peer from our own failed send.
Tags: `deferring` (operations wait for the handshake in progress), `peer_ready`
(connected: operations proceed at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.push.effects import (
    DropRemoteAgent,
    ReplayPush,
    ReplayRead,
    ReplayRegistration,
    ReportToMain,
    StartHandshake,
)
from kvhandoff.machines.push.events import HandshakeDone, HandshakeFailed, HandshakeStarted
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.machines.runtime.events import Event

DeferredOp = ReplayRegistration | ReplayPush | ReplayRead


@dataclass(slots=True)
class HandshakeCtx:
    key: str
    host: str
    port: int
    deferred: list[DeferredOp] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Ensure(Event):
    """An operation needs the peer connected: proceed, or defer it to the handshake."""

    op: DeferredOp


@dataclass(frozen=True, slots=True)
class Succeeded(Event):
    """The handshake job connected the peer's agent."""


@dataclass(frozen=True, slots=True)
class Failed(Event):
    """The handshake job failed."""


@dataclass(frozen=True, slots=True)
class PeerLost(Event):
    """A send or WRITE found the peer gone (B-08)."""


@dataclass(frozen=True, slots=True)
class HandshakeTimeout(Event):
    """No result within `handshake_timeout`."""


def _defer(ctx: HandshakeCtx, op: DeferredOp) -> list[Effect]:
    ctx.deferred.append(op)
    return [ReportToMain(op.request_id, HandshakeStarted())]


def endpoint(op: DeferredOp) -> tuple[str, int]:
    """The side channel the operation names for its peer (a restarted peer may move)."""
    if isinstance(op, ReplayRegistration):
        return op.registration.remote_host, op.registration.remote_port
    if isinstance(op, ReplayPush):
        return op.registration.decode_host, op.registration.decode_port
    return op.source.prefill.host, op.source.prefill.port


def start(ctx: HandshakeCtx, event: Ensure) -> list[Effect]:
    ctx.host, ctx.port = endpoint(event.op)
    return [StartHandshake(ctx.key, ctx.host, ctx.port), *_defer(ctx, event.op)]


def defer(ctx: HandshakeCtx, event: Ensure) -> list[Effect]:
    return _defer(ctx, event.op)


def replay_now(ctx: HandshakeCtx, event: Ensure) -> list[Effect]:
    return [event.op]


def replay_deferred(ctx: HandshakeCtx, event: Succeeded) -> list[Effect]:
    ops, ctx.deferred = ctx.deferred, []
    reports: list[Effect] = [ReportToMain(op.request_id, HandshakeDone()) for op in ops]
    return [*reports, *ops, Metric("push.handshake.succeeded")]


def fail_deferred(ctx: HandshakeCtx, event: Failed | HandshakeTimeout) -> list[Effect]:
    ops, ctx.deferred = ctx.deferred, []
    reports: list[Effect] = [ReportToMain(op.request_id, HandshakeFailed()) for op in ops]
    return [*reports, Metric("push.handshake.failed")]


def forget_agent(ctx: HandshakeCtx, event: PeerLost) -> list[Effect]:
    return [DropRemoteAgent(ctx.key)]


HANDSHAKE: Declaration[HandshakeCtx] = Declaration(
    name="push.handshake",
    description=__doc__ or "",
    states=[
        "idle",
        {
            "name": "in_progress",
            "tags": ("deferring",),
            "timeout": Timeout("handshake_timeout", "failed", HandshakeTimeout, "fail_deferred"),
        },
        {"name": "connected", "tags": ("peer_ready",)},
        "failed",
    ],
    initial="idle",
    transitions=[
        {"trigger": Ensure, "source": ["idle", "failed"], "dest": "in_progress", "after": "start"},
        {"trigger": Ensure, "source": "in_progress", "dest": None, "after": "defer"},
        {"trigger": Ensure, "source": "connected", "dest": None, "after": "replay_now"},
        {
            "trigger": Succeeded,
            "source": "in_progress",
            "dest": "connected",
            "after": "replay_deferred",
        },
        {"trigger": Failed, "source": "in_progress", "dest": "failed", "after": "fail_deferred"},
        {"trigger": PeerLost, "source": "connected", "dest": "idle", "after": "forget_agent"},
    ],
    # Late results of a handshake that already timed out or was superseded (a newer one
    # connected, or the peer was lost since), and losses of unknown peers.
    ignore=[
        ("failed", Succeeded),
        ("failed", Failed),
        ("connected", Succeeded),
        ("connected", Failed),
        ("idle", Succeeded),
        ("idle", Failed),
        ("idle", PeerLost),
        ("failed", PeerLost),
        ("in_progress", PeerLost),
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
