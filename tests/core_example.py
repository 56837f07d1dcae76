"""A small declared machine used by the framework-core tests (not part of the package)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Emit, ExtendDeadline, Metric
from kvhandoff.machines.runtime.events import Event, PeerEvent


@dataclass(slots=True)
class LeaseCtx:
    key: str
    blocks: list[int] = field(default_factory=list)
    writes: int = 0


@dataclass(frozen=True, slots=True)
class Released(Effect):
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StartWrite(Event):
    pass


@dataclass(frozen=True, slots=True)
class Heartbeat(PeerEvent):
    """From the peer: extends the lease."""


@dataclass(frozen=True, slots=True)
class WriteDone(PeerEvent):
    """From the peer: the write landed."""


@dataclass(frozen=True, slots=True)
class Chain(Event):
    pass


@dataclass(frozen=True, slots=True)
class LeaseExpired(Event):
    pass


@dataclass(frozen=True, slots=True)
class WriteTimeout(Event):
    pass


def has_blocks(ctx: LeaseCtx, event: StartWrite) -> bool:
    return bool(ctx.blocks)


def release(ctx: LeaseCtx, event: WriteDone) -> list[Effect]:
    return [Released(tuple(ctx.blocks)), Metric("released")]


def count_write(ctx: LeaseCtx, event: StartWrite) -> list[Effect]:
    ctx.writes += 1
    return []


def renew(ctx: LeaseCtx, event: Heartbeat) -> list[Effect]:
    return [ExtendDeadline(20.0)]


def ping_self(ctx: LeaseCtx, event: Chain) -> list[Effect]:
    return [Emit(LEASE, ctx.key, WriteDone())]


LEASE: Declaration[LeaseCtx] = Declaration(
    name="example.lease",
    context=LeaseCtx,
    description="Example lease used by the framework-core tests.",
    states=[
        {
            "name": "finished",
            "tags": ("leased",),
            "timeout": Timeout("kv_lease_duration", "expired", LeaseExpired),
        },
        {
            "name": "writing",
            "tags": ("in_flight",),
            "timeout": Timeout(5.0, "expired", WriteTimeout),
        },
        {"name": "sent", "final": True},
        {"name": "expired", "final": True},
        {"name": "dropped", "final": True},
    ],
    initial="finished",
    transitions=[
        {
            "trigger": StartWrite,
            "source": "finished",
            "dest": "writing",
            "conditions": "has_blocks",
            "after": "count_write",
        },
        {"trigger": StartWrite, "source": "finished", "dest": "dropped"},
        {"trigger": Heartbeat, "source": "finished", "dest": None, "after": "renew"},
        {"trigger": WriteDone, "source": "writing", "dest": "sent", "after": "release"},
        {"trigger": Chain, "source": "writing", "dest": None, "after": "ping_self"},
    ],
    ignore=[("writing", Heartbeat)],
    callbacks={
        "has_blocks": has_blocks,
        "release": release,
        "count_write": count_write,
        "renew": renew,
        "ping_self": ping_self,
    },
    config_defaults={"kv_lease_duration": 30.0},
)
