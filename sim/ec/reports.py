"""The worker ranks' reports on their way to the scheduler (simulation only).

In an engine each TP/PCP rank's report (`build_connector_worker_meta`) reaches the
scheduler through the engine's own RPC: reliably, but not necessarily in the step it was
built, nor in rank order, and a retried RPC can deliver one twice. `ReportChannel`
plays that: each rank's report is due at once, or late (`SimFaults.delay`: up to a second
of steps later), sometimes twice (`duplicate`), and the reports due at one step arrive
shuffled (`reorder`). None is lost while its engine lives.

It also keeps the simulation's ground truth of loads (`Engine.loads_unreported`): a load
transfer is outstanding until every rank's report of it reached the scheduler, and the
entry must stay pinned until then (`checks.py`).
"""

from __future__ import annotations

import itertools
import random

from kvhandoff.machines.ec.meta import ECConnectorMeta, ECWorkerMeta
from kvhandoff.sim.ec.engine import Engine
from kvhandoff.sim.faults import SimFaults

__all__ = ["ReportChannel"]


class ReportChannel:
    """Late, duplicated and reordered delivery of rank reports, seeded."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self._order = itertools.count()
        self.counters: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    def planned(self, engine: Engine, meta: ECConnectorMeta) -> None:
        """The scheduler handed these loads to every rank."""
        ranks = set(engine.scheduler.ranks)
        for item in meta.loads:
            engine.loads_unreported[item.transfer_id] = (item.mm_hash, set(ranks))

    def send(
        self, engine: Engine, reports: list[ECWorkerMeta], now: float, faults: SimFaults
    ) -> None:
        rng = self.rng
        for meta in reports:
            if not meta:
                continue
            due = now
            if faults.delay and rng.random() < faults.delay:
                due += rng.uniform(0.01, 1.0)
                self._count("reports_late")
            engine.reports_in_transit.append((due, next(self._order), meta))
            if faults.duplicate and rng.random() < faults.duplicate:
                again = due + rng.uniform(0.0, 1.0)
                engine.reports_in_transit.append((again, next(self._order), meta))
                self._count("reports_duplicated")

    def deliver(self, engine: Engine, now: float, faults: SimFaults) -> ECWorkerMeta:
        """The reports due by `now`, aggregated as the engine hands them to the scheduler."""
        due = [entry for entry in engine.reports_in_transit if entry[0] <= now]
        if not due:
            return ECWorkerMeta()
        engine.reports_in_transit = [e for e in engine.reports_in_transit if e[0] > now]
        due.sort(key=lambda entry: (entry[0], entry[1]))
        if faults.reorder and len(due) > 1 and self.rng.random() < faults.reorder:
            self.rng.shuffle(due)
            self._count("reports_reordered")
        output = ECWorkerMeta()
        tp_size = engine.scheduler.tp_size
        for _, _, meta in due:
            output = output.aggregate(meta)
            for report in meta.reports:
                rank = report.pcp_rank * tp_size + report.tp_rank
                for transfer_id in report.loaded + report.failed_loads:
                    self._delivered(engine, transfer_id, rank)
        return output

    @staticmethod
    def _delivered(engine: Engine, transfer_id: int, rank: int) -> None:
        entry = engine.loads_unreported.get(transfer_id)
        if entry is None:
            return
        entry[1].discard(rank)
        if not entry[1]:
            del engine.loads_unreported[transfer_id]

    @staticmethod
    def next_due(engine: Engine) -> float | None:
        return min((entry[0] for entry in engine.reports_in_transit), default=None)
