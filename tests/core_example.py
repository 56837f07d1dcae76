"""A small declared machine used by the framework-core tests (not part of the package)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Emit, ExtendDeadline, Metric


@dataclass(slots=True)
class LeaseCtx:
    blocks: list[int] = field(default_factory=list)
    writes: int = 0


@dataclass(frozen=True, slots=True)
class Released:
    blocks: tuple[int, ...]


def has_blocks(inst: Any, payload: Any) -> bool:
    return bool(inst.ctx.blocks)


def release(inst: Any, payload: Any) -> list[object]:
    return [Released(tuple(inst.ctx.blocks)), Metric("released")]


def count_write(inst: Any, payload: Any) -> list[object]:
    inst.ctx.writes += 1
    return []


def renew(inst: Any, payload: Any) -> list[object]:
    return [ExtendDeadline(20.0)]


def ping_self(inst: Any, payload: Any) -> list[object]:
    return [Emit("example.lease", inst.key, "write_done")]


LEASE = Declaration(
    name="example.lease",
    description="Example lease used by the framework-core tests.",
    states=[
        {"name": "finished", "timeout": Timeout("kv_lease_duration", "expired", "lease_expired")},
        {"name": "writing", "timeout": Timeout(5.0, "expired", "write_timeout")},
        {"name": "sent", "final": True},
        {"name": "expired", "final": True},
        {"name": "dropped", "final": True},
    ],
    initial="finished",
    transitions=[
        {
            "trigger": "start_write",
            "source": "finished",
            "dest": "writing",
            "conditions": "has_blocks",
            "after": "count_write",
        },
        {"trigger": "start_write", "source": "finished", "dest": "dropped"},
        {"trigger": "heartbeat", "source": "finished", "dest": None, "after": "renew"},
        {"trigger": "write_done", "source": "writing", "dest": "sent", "after": "release"},
        {"trigger": "chain", "source": "writing", "dest": None, "after": "ping_self"},
    ],
    ignore=[("writing", "heartbeat")],
    callbacks={
        "has_blocks": has_blocks,
        "release": release,
        "count_write": count_write,
        "renew": renew,
        "ping_self": ping_self,
    },
    config_defaults={"kv_lease_duration": 30.0},
    context=LeaseCtx,
)
