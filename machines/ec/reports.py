"""Validating the worker ranks' reports before any of them is applied (R-T02, R-T06).

`plan_reports(bus, output, ranks)` reads a whole `ECWorkerMeta` first and says what to do
with every item of it, without changing anything:

- the report as a whole is refused (`refused` set, nothing applied) when it is not made
  of `RankReport`s of int transfer ids from ranks this scheduler has;
- an item naming a transfer that no longer exists (it ended: every rank reported) or
  never existed is `stale`;
- a second report of one transfer by one rank (in this output, or after an earlier one)
  is a `duplicate`;
- an item reporting a transfer in the wrong direction, from a rank that does not take
  part in it, or before it was handed to the workers is `misdirected`;
- everything else is applied, in order, as one `RankReported(rank, ok)` each.

Stale and duplicate reports are expected when outputs arrive late or twice; they are
counted and ignored, never raised into the engine. Part of the local tier.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvhandoff.machines.ec.meta import ECWorkerMeta, RankReport
from kvhandoff.machines.ec.transfer import EC_TRANSFER, RankReported, TransferCtx
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance

__all__ = ["ReportPlan", "plan_reports"]

_FIELDS = (
    ("saved", "save", True),
    ("loaded", "load", True),
    ("failed_saves", "save", False),
    ("failed_loads", "load", False),
)


@dataclass(slots=True)
class ReportPlan:
    """What to do with one aggregated worker output."""

    apply: list[tuple[int, RankReported]] = field(default_factory=list)
    stale: int = 0
    duplicate: int = 0
    misdirected: int = 0
    refused: str = ""
    """Why the whole output is refused (nothing of it is applied), or empty."""


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _refusal(output: object, tp_size: int, pcp_size: int) -> str:
    if not isinstance(output, ECWorkerMeta) or not isinstance(output.reports, tuple):
        return f"not an ECWorkerMeta: {type(output).__name__}"
    for report in output.reports:
        if not isinstance(report, RankReport):
            return f"a report is a {type(report).__name__}, not a RankReport"
        tp, pcp = report.tp_rank, report.pcp_rank
        if not (_is_id(tp) and _is_id(pcp) and 0 <= tp < tp_size and 0 <= pcp < pcp_size):
            return f"rank tp={tp!r} pcp={pcp!r} is outside TP={tp_size} x PCP={pcp_size}"
        for name, _, _ in _FIELDS:
            ids: Any = getattr(report, name)
            if not isinstance(ids, tuple) or not all(_is_id(i) for i in ids):
                return f"{name} of rank tp={tp} pcp={pcp} is not a tuple of transfer ids"
    return ""


def plan_reports(bus: EventBus, output: object, tp_size: int, pcp_size: int) -> ReportPlan:
    """Classify every item of `output` (see the module docstring); changes nothing."""
    plan = ReportPlan(refused=_refusal(output, tp_size, pcp_size))
    if plan.refused:
        return plan
    assert isinstance(output, ECWorkerMeta)
    seen: set[tuple[int, int]] = set()
    for report in output.reports:
        rank = report.pcp_rank * tp_size + report.tp_rank
        for name, direction, ok in _FIELDS:
            for transfer_id in getattr(report, name):
                inst: Instance[TransferCtx] | None = bus.get(EC_TRANSFER, transfer_id)
                if inst is None:
                    plan.stale += 1
                elif (transfer_id, rank) in seen:
                    plan.duplicate += 1
                elif (
                    inst.ctx.direction != direction
                    or not inst.has("in_flight")
                    or rank not in inst.ctx.participants
                ):
                    plan.misdirected += 1
                elif rank not in inst.ctx.pending:
                    plan.duplicate += 1
                else:
                    seen.add((transfer_id, rank))
                    plan.apply.append((transfer_id, RankReported(rank, ok)))
    return plan
