"""Worker region: one worker's use of the shared CPU region of its instance (R-E03).

One `/dev/shm` region per instance and DP rank is shared by every TP/PCP worker of that
instance. Every worker `register`s it (after the adapter mapped it) before copying; all
of them load from it, but only the writer (TP rank 0 and PCP rank 0) saves into it, since
every rank holds the same encoder outputs. `shutdown` closes it with a `CloseRegion`
effect; the writer, which owns the region, also unlinks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.runtime.declaration import Declaration

__all__ = ["EC_WORKER_REGION", "REGION_KIND", "CloseRegion", "RegionCtx"]

REGION_KIND = "ec.worker_region"


@dataclass(slots=True)
class RegionCtx:
    writer: bool = True
    """TP rank 0 and PCP rank 0: the one worker that saves, and the region's owner."""
    region_base_addr: int = 0


@dataclass(frozen=True, slots=True)
class CloseRegion:
    """Region adapter: unmap the region; `unlink` it from `/dev/shm` too when owned."""

    unlink: bool


def _registered(inst: Any, base_addr: int | None) -> None:
    inst.ctx.region_base_addr = int(base_addr or 0)


def _close(inst: Any, payload: Any) -> list[object]:
    return [CloseRegion(unlink=inst.ctx.writer)]


EC_WORKER_REGION = Declaration(
    name=REGION_KIND,
    description=(
        "A worker's use of the shared CPU region (R-E03): registered before any copy; "
        "only TP rank 0 / PCP rank 0 saves; shutdown closes it and the owner unlinks it."
    ),
    states=["unregistered", "registered", {"name": "closed", "final": True}],
    initial="unregistered",
    transitions=[
        {
            "trigger": "register",
            "source": "unregistered",
            "dest": "registered",
            "after": "registered",
        },
        {
            "trigger": "shutdown",
            "source": ["unregistered", "registered"],
            "dest": "closed",
            "after": "close",
        },
    ],
    callbacks={"registered": _registered, "close": _close},
    context=RegionCtx,
)
