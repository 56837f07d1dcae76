"""Copy batch: one batched save or load between the GPU encoder cache and the CPU tier (R-E05).

The worker stages one batch per direction and step, keyed by a batch id it numbers.

- `submit`: `staged -> submitted`; the batch is handed to the copy engine as a
  `CopyBlocks` effect, which an adapter runs on a pooled CUDA stream (`swap_blocks_batch`)
  and closes with an end event recorded on that stream.
- `engine_refused`: the copy engine raised when the batch was handed to it:
  `submitted -> refused`, until the adapter's next poll fails it (`copy_failed`).
- `end_event` (the adapter saw the end event fire) or `copy_failed` (the copy engine
  refused or lost the batch): `submitted` or `refused -> end_event_seen`; `CopyLanded` tells the
  worker, which reports it to its model runner through `get_finished`.
- `report`: `end_event_seen -> reported` when `build_connector_worker_meta` puts the
  batch's transfer ids into this rank's report. The scheduler applies it in
  `update_connector_output` once every participating rank reported (`ec.transfer`):
  saved entries become ready, loaded entries are unpinned; the scheduler runs on its
  own bus, so "applied" is the transfer's transition there.

No timeout: a CUDA end event always fires; a copy engine that fails says so. Tags:
`in_flight` (submitted, its end event not seen yet), `refused` (the copy engine refused
it; failed at the next poll), `reportable` (end event seen, not yet in a worker meta).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.ec.meta import CopyDirection, CopyItem
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event

__all__ = [
    "EC_COPY_BATCH",
    "BatchCtx",
    "CopyBlocks",
    "CopyFailed",
    "CopyLanded",
    "EndEvent",
    "EngineRefused",
    "Report",
    "Submit",
]


@dataclass(slots=True)
class BatchCtx:
    key: int
    """The batch id the worker numbered."""
    direction: CopyDirection = "save"
    items: tuple[CopyItem, ...] = ()
    ok: bool = True


@dataclass(frozen=True, slots=True)
class Submit(Event):
    """The worker hands the staged batch to the copy engine."""


@dataclass(frozen=True, slots=True)
class EndEvent(Event):
    """The copy adapter saw the batch's end event fire."""


@dataclass(frozen=True, slots=True)
class EngineRefused(Event):
    """The copy engine raised when the batch was handed to it."""


@dataclass(frozen=True, slots=True)
class CopyFailed(Event):
    """The copy engine refused or lost the batch."""


@dataclass(frozen=True, slots=True)
class Report(Event):
    """The batch went into a worker meta."""


@dataclass(frozen=True, slots=True)
class CopyBlocks(Effect):
    """Adapter: copy `items` in `direction` on a pooled stream, then report the end
    event with `ECWorker.on_copy_done(batch_id, now, ok)`."""

    direction: CopyDirection
    batch_id: int
    items: tuple[CopyItem, ...]


@dataclass(frozen=True, slots=True)
class CopyLanded(Effect):
    """The worker itself: a batch's end event was seen (`ok` False when it failed)."""

    direction: CopyDirection
    batch_id: int
    mm_hashes: tuple[str, ...]
    ok: bool
    transfer_ids: tuple[int, ...] = ()


def _submit(ctx: BatchCtx, event: Submit) -> list[Effect]:
    return [CopyBlocks(ctx.direction, ctx.key, ctx.items)]


def _landed(ctx: BatchCtx, ok: bool) -> list[Effect]:
    ctx.ok = ok
    hashes = tuple(i.mm_hash for i in ctx.items)
    ids = tuple(i.transfer_id for i in ctx.items)
    return [CopyLanded(ctx.direction, ctx.key, hashes, ok, ids)]


def _end_event(ctx: BatchCtx, event: EndEvent) -> list[Effect]:
    return _landed(ctx, True)


def _copy_failed(ctx: BatchCtx, event: CopyFailed) -> list[Effect]:
    return _landed(ctx, False)


EC_COPY_BATCH: Declaration[BatchCtx] = Declaration(
    name="ec.copy_batch",
    context=BatchCtx,
    description=(
        "One batched save or load on a pooled CUDA stream (R-E05): submitted -> end event "
        "seen -> reported in the worker meta; the scheduler then marks saved entries "
        "ready and unpins loaded ones."
    ),
    states=[
        "staged",
        {"name": "submitted", "tags": ("in_flight",)},
        {"name": "refused", "tags": ("in_flight", "refused")},
        {"name": "end_event_seen", "tags": ("reportable",)},
        {"name": "reported", "final": True},
    ],
    initial="staged",
    transitions=[
        {"trigger": Submit, "source": "staged", "dest": "submitted", "after": "submit"},
        {
            "trigger": EndEvent,
            "source": "submitted",
            "dest": "end_event_seen",
            "after": "end_event",
        },
        {"trigger": EngineRefused, "source": "submitted", "dest": "refused"},
        {
            "trigger": CopyFailed,
            "source": ["submitted", "refused"],
            "dest": "end_event_seen",
            "after": "copy_failed",
        },
        {"trigger": Report, "source": "end_event_seen", "dest": "reported"},
    ],
    callbacks={"submit": _submit, "end_event": _end_event, "copy_failed": _copy_failed},
)
