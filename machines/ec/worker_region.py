"""Worker region: one worker's use of the shared CPU region of its instance (R-E03).

One `/dev/shm` region per instance and DP rank is shared by every TP/PCP worker of that
instance. Every worker `register`s it (after the adapter mapped it) before copying; all
of them load from it, but only the writer (TP rank 0 and PCP rank 0) saves into it, since
every rank holds the same encoder outputs. `shutdown` closes it with a `CloseRegion`
effect; the writer, which owns the region, also unlinks it. Tag: `usable` (registered:
copies may run).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event

__all__ = ["EC_WORKER_REGION", "CloseRegion", "RegionCtx", "Register", "Shutdown"]


@dataclass(slots=True)
class RegionCtx:
    key: str
    writer: bool = True
    """TP rank 0 and PCP rank 0: the one worker that saves, and the region's owner."""
    region_base_addr: int = 0


@dataclass(frozen=True, slots=True)
class Register(Event):
    """The region adapter mapped the region at `base_addr`."""

    base_addr: int = 0


@dataclass(frozen=True, slots=True)
class Shutdown(Event):
    """The worker shuts down."""


@dataclass(frozen=True, slots=True)
class CloseRegion(Effect):
    """Region adapter: unmap the region; `unlink` it from `/dev/shm` too when owned."""

    unlink: bool


def _registered(ctx: RegionCtx, event: Register) -> None:
    ctx.region_base_addr = event.base_addr


def _close(ctx: RegionCtx, event: Shutdown) -> list[Effect]:
    return [CloseRegion(unlink=ctx.writer)]


EC_WORKER_REGION: Declaration[RegionCtx] = Declaration(
    name="ec.worker_region",
    context=RegionCtx,
    description=(
        "A worker's use of the shared CPU region (R-E03): registered before any copy; "
        "only TP rank 0 / PCP rank 0 saves; shutdown closes it and the owner unlinks it."
    ),
    states=[
        "unregistered",
        {"name": "registered", "tags": ("usable",)},
        {"name": "closed", "final": True},
    ],
    initial="unregistered",
    transitions=[
        {
            "trigger": Register,
            "source": "unregistered",
            "dest": "registered",
            "after": "registered",
        },
        {
            "trigger": Shutdown,
            "source": ["unregistered", "registered"],
            "dest": "closed",
            "after": "close",
        },
    ],
    callbacks={"registered": _registered, "close": _close},
)
