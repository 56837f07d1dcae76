"""Copy batch: one batched save or load between the GPU encoder cache and the CPU tier (R-E05).

The worker stages one batch per direction and step, keyed by a batch id it numbers.

- `submit`: `staged -> submitted`; the batch is handed to the copy engine as a
  `CopyBlocks` effect, which an adapter runs on a pooled CUDA stream (`swap_blocks_batch`)
  and closes with an end event recorded on that stream.
- `end_event` (the adapter saw the end event fire) or `copy_failed` (the copy engine
  refused or lost the batch): `submitted -> end_event_seen`; `CopyLanded` tells the
  worker, which reports it to its model runner through `get_finished`.
- `report`: `end_event_seen -> reported` when `build_connector_worker_meta` puts the
  batch into the worker meta. The scheduler applies it in `update_connector_output`:
  saved entries become ready, loaded entries are unpinned (see `ec.cache_entry`); the
  scheduler runs on its own bus, so "applied" is the entry's transition there.

No timeout: a CUDA end event always fires; a copy engine that fails says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.ec.meta import CopyDirection, CopyItem
from kvhandoff.machines.runtime.declaration import Declaration

__all__ = ["COPY_BATCH_KIND", "EC_COPY_BATCH", "BatchCtx", "CopyBlocks", "CopyLanded"]

COPY_BATCH_KIND = "ec.copy_batch"


@dataclass(slots=True)
class BatchCtx:
    direction: CopyDirection = "save"
    items: tuple[CopyItem, ...] = ()
    ok: bool = True


@dataclass(frozen=True, slots=True)
class CopyBlocks:
    """Adapter: copy `items` in `direction` on a pooled stream, then report the end
    event with `ECWorker.on_copy_done(batch_id, ok)`."""

    direction: CopyDirection
    batch_id: int
    items: tuple[CopyItem, ...]


@dataclass(frozen=True, slots=True)
class CopyLanded:
    """The worker itself: a batch's end event was seen (`ok` False when it failed)."""

    direction: CopyDirection
    batch_id: int
    mm_hashes: tuple[str, ...]
    ok: bool


def _submit(inst: Any, payload: Any) -> list[object]:
    ctx = inst.ctx
    return [CopyBlocks(ctx.direction, inst.key, ctx.items)]


def _landed(inst: Any, ok: bool) -> list[object]:
    ctx = inst.ctx
    ctx.ok = ok
    return [CopyLanded(ctx.direction, inst.key, tuple(i.mm_hash for i in ctx.items), ok)]


def _end_event(inst: Any, payload: Any) -> list[object]:
    return _landed(inst, True)


def _copy_failed(inst: Any, payload: Any) -> list[object]:
    return _landed(inst, False)


EC_COPY_BATCH = Declaration(
    name=COPY_BATCH_KIND,
    description=(
        "One batched save or load on a pooled CUDA stream (R-E05): submitted -> end event "
        "seen -> reported in the worker meta; the scheduler then marks saved entries "
        "ready and unpins loaded ones."
    ),
    states=["staged", "submitted", "end_event_seen", {"name": "reported", "final": True}],
    initial="staged",
    transitions=[
        {"trigger": "submit", "source": "staged", "dest": "submitted", "after": "submit"},
        {
            "trigger": "end_event",
            "source": "submitted",
            "dest": "end_event_seen",
            "after": "end_event",
        },
        {
            "trigger": "copy_failed",
            "source": "submitted",
            "dest": "end_event_seen",
            "after": "copy_failed",
        },
        {"trigger": "report", "source": "end_event_seen", "dest": "reported"},
    ],
    callbacks={"submit": _submit, "end_event": _end_event, "copy_failed": _copy_failed},
    context=BatchCtx,
)
