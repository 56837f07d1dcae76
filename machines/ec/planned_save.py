"""Planned save: one save the scheduler's plan gave the writer rank (R-E03, R-E05, R-T06).

A plan bound with `bind_connector_metadata` says where this step's encoder outputs go; on
the writer rank (TP 0 / PCP 0) each of its saves becomes one `ec.planned_save`, keyed by
its transfer id, until a copy batch takes it or the rank reports it unsaved:

- `save_submitted`: `planned -> submitted` (final): `save_caches` put it into a copy
  batch (`ec.copy_batch`), which reports it from then on.
- `replanned`: `planned -> abandoned`: the next plan was bound before it was saved.
- `reported_unsaved`: `planned` or `abandoned -> unsaved` (final):
  `build_connector_worker_meta` reports it as a failed save (it was never written), so
  the scheduler frees its blocks.

No timeout: the worker's next report always ends it. Tags: `planned` (it may still be
saved this step), `unsaved` (not saved, not reported yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.ec.meta import CopyItem
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event

__all__ = ["EC_PLANNED_SAVE", "PlannedSaveCtx", "Replanned", "ReportedUnsaved", "SaveSubmitted"]


@dataclass(slots=True)
class PlannedSaveCtx:
    key: int
    """The save's transfer id (R-T06)."""
    item: CopyItem = field(default_factory=lambda: CopyItem("", (), 1))


@dataclass(frozen=True, slots=True)
class SaveSubmitted(Event):
    """`save_caches` put the save into a copy batch."""


@dataclass(frozen=True, slots=True)
class Replanned(Event):
    """The next plan was bound before the save was submitted."""


@dataclass(frozen=True, slots=True)
class ReportedUnsaved(Event):
    """The rank's report names the save as failed: it was never written."""


EC_PLANNED_SAVE: Declaration[PlannedSaveCtx] = Declaration(
    name="ec.planned_save",
    context=PlannedSaveCtx,
    description=(
        "A save the plan gave the writer rank (R-E03, R-T06): submitted in a copy batch, "
        "or reported unsaved so the scheduler frees its blocks."
    ),
    states=[
        {"name": "planned", "tags": ("planned", "unsaved")},
        {"name": "abandoned", "tags": ("unsaved",)},
        {"name": "submitted", "final": True},
        {"name": "unsaved", "final": True},
    ],
    initial="planned",
    transitions=[
        {"trigger": SaveSubmitted, "source": "planned", "dest": "submitted"},
        {"trigger": Replanned, "source": "planned", "dest": "abandoned"},
        {"trigger": ReportedUnsaved, "source": ["planned", "abandoned"], "dest": "unsaved"},
    ],
)
