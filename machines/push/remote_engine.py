"""Remote engine lifecycle: one peer engine and its agents, as one writer sees them
(R-P05, R-P15, B-08, B-11).

One instance per remote engine id, on a worker rank's writer bus. The handshake itself
(the engine's side channel, every rank's agent metadata, the compatibility check) runs on
a background executor and never blocks the writer; its callback only posts the result
and wakes the writer.

- `idle`: nothing loaded. The first operation that needs the peer (`Ensure`) starts a
  handshake and waits for it (`handshaking`); so does every operation meanwhile. An
  engine nothing asked for during `engine_ttl` is forgotten (`evicted`).
- `handshaking`: a result of this attempt replays every waiting operation (`connected`)
  or fails them all (back to `idle`, no retry loop, R-P12); so does the declared
  handshake timeout. A late result of an earlier attempt is ignored. An operation whose
  request ended meanwhile is dropped (`Cancel`).
- `connected`: operations proceed at once. Every use, and every notif from the engine,
  keeps it alive; unused for `engine_ttl` (vLLM 0.33: 3600 s) it is `evicted` and its
  agents are forgotten (B-11). A send or WRITE that finds the peer gone forgets its
  agents too (`idle`), so the next operation re-handshakes: a restarted peer has new
  agents (B-08).

Every event here is local: results come from our own handshake job, a lost peer from our
own failed send. Tags: `deferring` (operations wait for the handshake in progress),
`peer_ready` (connected: operations proceed at once).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.kv.effects import (
    DeferredFailed,
    DeferredOp,
    DropRemoteAgent,
    ReplayPush,
    ReplayRegistration,
    ReportToMain,
    StartHandshake,
)
from kvhandoff.machines.kv.events import HandshakeDone, HandshakeStarted
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, ExtendDeadline, Metric
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.errors import LocalProtocolError


@dataclass(slots=True)
class RemoteEngineCtx:
    key: str
    host: str
    port: int
    ttl: float = 3600.0
    attempt: int = 0
    deferred: list[DeferredOp] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Ensure(Event):
    """Operations need the peer connected: proceed, or wait for the handshake. A writer
    hands one engine the operations of a run of commands together, in their order."""

    ops: tuple[DeferredOp, ...]

    def __post_init__(self) -> None:
        if not self.ops:
            raise LocalProtocolError("Ensure carries at least one operation")


@dataclass(frozen=True, slots=True)
class Succeeded(Event):
    """Handshake `attempt` connected the peer's agents."""

    attempt: int = 0


@dataclass(frozen=True, slots=True)
class Failed(Event):
    """Handshake `attempt` failed."""

    attempt: int = 0


@dataclass(frozen=True, slots=True)
class HandshakeTimeout(Event):
    """No result within `handshake_timeout`."""


@dataclass(frozen=True, slots=True)
class PeerLost(Event):
    """A send or WRITE found the peer gone (B-08)."""


@dataclass(frozen=True, slots=True)
class Touch(Event):
    """The peer was used or heard from: it is not idle."""


@dataclass(frozen=True, slots=True)
class Cancel(Event):
    """`request_id` ended: drop its operation if it still waits."""

    request_id: str


@dataclass(frozen=True, slots=True)
class IdleExpired(Event):
    """Unused for `engine_ttl` (B-11)."""


IDLE_TTL = Timeout("engine_ttl", "evicted", IdleExpired, "forget")


def endpoint(op: DeferredOp) -> tuple[str, int]:
    """The side channel the operation names for its peer (a restarted peer may move)."""
    if isinstance(op, ReplayRegistration):
        return op.registration.remote_host, op.registration.remote_port
    if isinstance(op, ReplayPush):
        reg = op.registrations[0].registration
        return reg.decode_host, reg.decode_port
    return op.source.prefill.host, op.source.prefill.port


def shape(op: DeferredOp) -> tuple[int, int]:
    """The peer's (TP, PP) sizes as the operation names them: what the side channel is
    asked for, one request per rank (C-01)."""
    if isinstance(op, ReplayRegistration):
        return op.registration.remote_tp_size, op.registration.remote_pp_size
    if isinstance(op, ReplayPush):
        return op.registrations[0].registration.decode_tp_size, 1
    return op.source.prefill.tp_size, op.source.prefill.pp_size


def current(ctx: RemoteEngineCtx, event: Succeeded | Failed) -> bool:
    return event.attempt == ctx.attempt


def _defer(ctx: RemoteEngineCtx, ops: tuple[DeferredOp, ...]) -> list[Effect]:
    ctx.deferred.extend(ops)
    return [ReportToMain(op.request_id, HandshakeStarted()) for op in ops]


def start(ctx: RemoteEngineCtx, event: Ensure) -> list[Effect]:
    first = event.ops[0]  # the side channel the earliest operation names
    ctx.host, ctx.port = endpoint(first)
    ctx.attempt += 1
    tp_size, pp_size = shape(first)
    handshake = StartHandshake(ctx.key, ctx.host, ctx.port, ctx.attempt, tp_size, pp_size)
    return [handshake, *_defer(ctx, event.ops)]


def defer(ctx: RemoteEngineCtx, event: Ensure) -> list[Effect]:
    return _defer(ctx, event.ops)


def proceed(ctx: RemoteEngineCtx, event: Ensure) -> list[Effect]:
    return [*event.ops, ExtendDeadline(ctx.ttl)]


def keep_alive(ctx: RemoteEngineCtx, event: Touch) -> list[Effect]:
    return [ExtendDeadline(ctx.ttl)]


def replay(ctx: RemoteEngineCtx, event: Succeeded) -> list[Effect]:
    ops, ctx.deferred = ctx.deferred, []
    reports: list[Effect] = [ReportToMain(op.request_id, HandshakeDone()) for op in ops]
    return [*reports, *ops, Metric("push.handshake.succeeded")]


def fail_all(ctx: RemoteEngineCtx, event: Failed | HandshakeTimeout) -> list[Effect]:
    ops, ctx.deferred = ctx.deferred, []
    return [*(DeferredFailed(op) for op in ops), Metric("push.handshake.failed")]


def stale(ctx: RemoteEngineCtx, event: Succeeded | Failed) -> list[Effect]:
    return [Metric("push.handshake.stale_results")]


def cancel(ctx: RemoteEngineCtx, event: Cancel) -> None:
    ctx.deferred = [op for op in ctx.deferred if op.request_id != event.request_id]


def forget(ctx: RemoteEngineCtx, event: PeerLost | IdleExpired) -> list[Effect]:
    return [DropRemoteAgent(ctx.key)]


REMOTE_ENGINE: Declaration[RemoteEngineCtx] = Declaration(
    name="push.remote_engine",
    description=__doc__ or "",
    states=[
        {"name": "idle", "timeout": IDLE_TTL},
        {
            "name": "handshaking",
            "tags": ("deferring",),
            "timeout": Timeout("handshake_timeout", "idle", HandshakeTimeout, "fail_all"),
        },
        {"name": "connected", "tags": ("peer_ready",), "timeout": IDLE_TTL},
        {"name": "evicted", "final": True},
    ],
    initial="idle",
    transitions=[
        {"trigger": Ensure, "source": "idle", "dest": "handshaking", "after": "start"},
        {"trigger": Ensure, "source": "handshaking", "dest": None, "after": "defer"},
        {"trigger": Ensure, "source": "connected", "dest": None, "after": "proceed"},
        {
            "trigger": Succeeded,
            "source": "handshaking",
            "dest": "connected",
            "conditions": "current",
            "after": "replay",
        },
        {
            "trigger": Failed,
            "source": "handshaking",
            "dest": "idle",
            "conditions": "current",
            "after": "fail_all",
        },
        {"trigger": Succeeded, "source": "handshaking", "dest": None, "after": "stale"},
        {"trigger": Failed, "source": "handshaking", "dest": None, "after": "stale"},
        {"trigger": Cancel, "source": "handshaking", "dest": None, "after": "cancel"},
        {"trigger": Touch, "source": "connected", "dest": None, "after": "keep_alive"},
        {"trigger": PeerLost, "source": "connected", "dest": "idle", "after": "forget"},
    ],
    # Late results of an earlier attempt; losses, uses and cancellations that find
    # nothing to act on.
    ignore=[
        ("idle", Succeeded),
        ("idle", Failed),
        ("connected", Succeeded),
        ("connected", Failed),
        ("idle", PeerLost),
        ("handshaking", PeerLost),
        ("idle", Touch),
        ("handshaking", Touch),
        ("idle", Cancel),
        ("connected", Cancel),
    ],
    callbacks={
        "current": current,
        "start": start,
        "defer": defer,
        "proceed": proceed,
        "keep_alive": keep_alive,
        "replay": replay,
        "fail_all": fail_all,
        "stale": stale,
        "cancel": cancel,
        "forget": forget,
    },
    config_defaults={"handshake_timeout": 10.0, "engine_ttl": 3600.0},
    context=RemoteEngineCtx,
)
