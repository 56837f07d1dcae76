"""Worker half of the CPU encoder-cache connector, one per TP/PCP rank (R-E03, R-E05, R-T01).

A thin API over machines on the worker's own bus: `ec.worker_region` (registered,
closed), one `ec.planned_save` per save of the plan (writer rank), one `ec.copy_batch`
per batched save or load, and one `ec.landed_copy` notice per batch whose end event was
seen, until `take_landed` takes it. Copies are `CopyBlocks` effects for a copy engine
adapter; the adapter reports each batch's end event with `on_copy_done` (a batch the
engine refused with `on_copy_refused`, failed at its next poll by `fail_refused`).
Register handlers with `worker.bus.handle(CopyBlocks, ...)` and
`worker.bus.handle(CloseRegion, ...)`, or drain `worker.drain_effects()`.

It shares nothing with the scheduler half: the scheduler's `ECConnectorMeta` comes down
(`bind_connector_metadata`), this rank's report goes up (`build_connector_worker_meta`,
an `ECWorkerMeta` holding one `RankReport` by transfer id), both plain records.

Per engine step, with vLLM's call names: `bind_connector_metadata(meta)` takes the step's
plan (saves of the previous plan never submitted are reported failed, so the scheduler
frees their blocks); `start_load_caches(now)` submits the loads (every rank loads into
its own encoder cache); `save_caches(now, ...)` submits saves (the writer rank only,
TP 0 / PCP 0: every rank holds the same encoder outputs); `build_connector_worker_meta`
reports every batch whose end event was seen. Every call that changes state takes `now`
from its caller; nothing here reads a clock.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

from kvhandoff.machines.ec.copy_batch import (
    EC_COPY_BATCH,
    BatchCtx,
    CopyFailed,
    CopyLanded,
    EndEvent,
    EngineRefused,
    Report,
    Submit,
)
from kvhandoff.machines.ec.meta import (
    CopyDirection,
    CopyItem,
    ECConnectorMeta,
    ECFinished,
    ECWorkerMeta,
    RankReport,
)
from kvhandoff.machines.ec.nixl_gate import require_nixl
from kvhandoff.machines.ec.notices import EC_LANDED_COPY, LandedCtx, take_notices
from kvhandoff.machines.ec.planned_save import (
    EC_PLANNED_SAVE,
    PlannedSaveCtx,
    Replanned,
    ReportedUnsaved,
    SaveSubmitted,
)
from kvhandoff.machines.ec.worker_region import EC_WORKER_REGION, RegionCtx, Register, Shutdown
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["ECWorker"]

_REGION_KEY = "region"


class ECWorker:
    """The worker half for one TP/PCP rank of an instance."""

    def __init__(
        self,
        config: ECTransferConfig,
        layout: ECLayout,
        *,
        tp_rank: int = 0,
        pcp_rank: int = 0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        self.extra = config.extra_config(env)
        if self.extra.ec_enable_nixl:
            require_nixl()
        self.layout = layout
        self.tp_rank = tp_rank
        self.pcp_rank = pcp_rank
        self.is_writer = tp_rank == 0 and pcp_rank == 0
        self.bus = EventBus()
        self.bus.register(EC_WORKER_REGION)
        self.bus.register(EC_COPY_BATCH)
        self.bus.register(EC_PLANNED_SAVE)
        self.bus.register(EC_LANDED_COPY)
        self.bus.handle(CopyLanded, self._landed)
        self._region: Instance[RegionCtx] | None = None  # created by its first event
        self._batch_ids = itertools.count(1)
        self._meta: ECConnectorMeta | None = None

    # -- lifecycle of the region -----------------------------------------------------------

    def register_region(self, region_base_addr: int, region_bytes: int | None, now: float) -> None:
        """The region adapter mapped the shared region at `region_base_addr`."""
        if region_bytes is not None and region_bytes < self.layout.region_bytes:
            raise LocalProtocolError(
                f"region of {region_bytes} bytes cannot hold {self.layout.num_blocks} blocks "
                f"of {self.layout.block_size_bytes} bytes"
            )
        self._region_at(now)
        self.bus.dispatch(EC_WORKER_REGION, _REGION_KEY, Register(region_base_addr), now)

    def shutdown(self, now: float) -> None:
        """Close the region (`CloseRegion`; the writer also unlinks it). Idempotent."""
        region = self._region_at(now)
        if self.bus.get(EC_WORKER_REGION, _REGION_KEY) is region:
            self.bus.dispatch(EC_WORKER_REGION, _REGION_KEY, Shutdown(), now)

    def _region_at(self, now: float) -> Instance[RegionCtx]:
        if self._region is None:
            ctx = RegionCtx(_REGION_KEY, writer=self.is_writer)
            self._region = self.bus.create(EC_WORKER_REGION, ctx, now)
        return self._region

    def _require_registered(self, what: str) -> None:
        region = self._region
        if region is None or not region.has("usable"):
            state = "unregistered" if region is None else region.state
            raise LocalProtocolError(
                f"ECWorker.{what}: the region is {state}; call register_region "
                "first (and not after shutdown)"
            )

    # -- one engine step ---------------------------------------------------------------

    def bind_connector_metadata(self, meta: ECConnectorMeta) -> None:
        """This step's plan from the scheduler: loads to run, and where saves go (each an
        `ec.planned_save` on the writer rank). Saves of the previous plan that were never
        submitted are reported failed."""
        bus = self.bus
        now = bus.now  # vLLM's call takes no time: the bus's latest
        for inst in bus.tagged(EC_PLANNED_SAVE, "planned"):
            bus.dispatch(EC_PLANNED_SAVE, inst.key, Replanned(), now)
        self._meta = meta
        if self.is_writer:
            for item in meta.saves:
                bus.create(EC_PLANNED_SAVE, PlannedSaveCtx(item.transfer_id, item), now)

    @property
    def planned_loads(self) -> tuple[CopyItem, ...]:
        """The loads of the bound plan (empty when none is bound)."""
        return () if self._meta is None else self._meta.loads

    def clear_connector_metadata(self) -> None:
        """The step's model execution is over."""
        self._meta = None

    def start_load_caches(self, now: float) -> None:
        """Submit the bound plan's loads (every rank loads into its own encoder cache)."""
        self._require_registered("start_load_caches")
        meta = self._meta
        if meta is not None and meta.loads:
            self._submit("load", meta.loads, now)

    def save_caches(self, now: float, mm_hashes: Iterable[str] | None = None) -> None:
        """Submit saves of this step's encoder outputs (all, or those named). Only the
        writer rank writes (R-E03); on other ranks this does nothing."""
        self._require_registered("save_caches")
        if not self.is_writer:
            return
        bus = self.bus
        planned = {inst.ctx.item.mm_hash: inst for inst in bus.tagged(EC_PLANNED_SAVE, "planned")}
        names = list(planned) if mm_hashes is None else list(dict.fromkeys(mm_hashes))
        unknown = [h for h in names if h not in planned]
        if unknown:
            raise LocalProtocolError(f"ECWorker.save_caches: no save was planned for {unknown}")
        items = tuple(planned[h].ctx.item for h in names)
        for mm_hash in names:
            bus.dispatch(EC_PLANNED_SAVE, planned[mm_hash].key, SaveSubmitted(), now)
        if items:
            self._submit("save", items, now)

    def _submit(self, direction: CopyDirection, items: tuple[CopyItem, ...], now: float) -> int:
        batch_id = next(self._batch_ids)
        self.bus.create(EC_COPY_BATCH, BatchCtx(batch_id, direction=direction, items=items), now)
        self.bus.dispatch(EC_COPY_BATCH, batch_id, Submit(), now)
        return batch_id

    # -- events from the copy engine ---------------------------------------------------

    def on_copy_done(self, batch_id: int, now: float, ok: bool = True) -> None:
        """The copy adapter saw batch `batch_id`'s end event fire (or the copy failed)."""
        self.bus.dispatch(EC_COPY_BATCH, batch_id, EndEvent() if ok else CopyFailed(), now)

    def on_copy_refused(self, batch_id: int) -> None:
        """The copy engine raised when batch `batch_id` was handed to it (a `CopyBlocks`
        handler may call this): the batch fails at the adapter's next poll
        (`fail_refused`)."""
        self.bus.dispatch(EC_COPY_BATCH, batch_id, EngineRefused(), self.bus.now)

    def fail_refused(self, now: float) -> int:
        """Fail every batch the copy engine refused, oldest first; how many."""
        refused = self.bus.tagged(EC_COPY_BATCH, "refused")
        for inst in refused:
            self.bus.dispatch(EC_COPY_BATCH, inst.key, CopyFailed(), now)
        return len(refused)

    def _landed(self, inst: Instance[BatchCtx] | None, effect: CopyLanded) -> None:
        """What `take_landed` tells the model runner: an `ec.landed_copy` notice."""
        ctx = LandedCtx(effect.batch_id, effect.direction, effect.mm_hashes, effect.ok)
        self.bus.create(EC_LANDED_COPY, ctx, self.bus.now)

    # -- reports -------------------------------------------------------------------------

    def build_connector_worker_meta(self, now: float) -> ECWorkerMeta:
        """This rank's report to the scheduler (R-E05): the transfer ids of landed batches
        and of this step's saves that were never submitted (R-T06); empty (falsy) when
        there is nothing to report."""
        saved: list[int] = []
        loaded: list[int] = []
        failed_saves: list[int] = []  # planned, never submitted
        failed_loads: list[int] = []
        for plan in self.bus.tagged(EC_PLANNED_SAVE, "unsaved"):
            failed_saves.append(plan.ctx.key)
            self.bus.dispatch(EC_PLANNED_SAVE, plan.key, ReportedUnsaved(), now)
        for inst in self.bus.tagged(EC_COPY_BATCH, "reportable"):
            ctx = inst.ctx
            ids = [item.transfer_id for item in ctx.items]
            if ctx.direction == "save":
                (saved if ctx.ok else failed_saves).extend(ids)
            else:
                (loaded if ctx.ok else failed_loads).extend(ids)
            self.bus.dispatch(EC_COPY_BATCH, inst.key, Report(), now)
        report = RankReport(
            self.tp_rank,
            self.pcp_rank,
            tuple(saved),
            tuple(loaded),
            tuple(failed_saves),
            tuple(failed_loads),
        )
        return ECWorkerMeta((report,)) if report else ECWorkerMeta()

    def take_landed(self) -> ECFinished:
        """Encodings whose copies landed (or failed) since the last call, for the runner:
        every untaken `ec.landed_copy` notice, taken."""
        saved: set[str] = set()
        loaded: set[str] = set()
        failed: set[str] = set()
        for notice in take_notices(self.bus, EC_LANDED_COPY):
            ctx = notice.ctx
            if not ctx.ok:
                failed.update(ctx.mm_hashes)
            elif ctx.direction == "save":
                saved.update(ctx.mm_hashes)
            else:
                loaded.update(ctx.mm_hashes)
        return ECFinished(frozenset(saved), frozenset(loaded), frozenset(failed))

    def in_flight(self) -> int:
        """Batches submitted whose end event has not been seen yet."""
        return len(self.bus.tagged(EC_COPY_BATCH, "in_flight"))

    def drain_effects(self) -> list[object]:
        """Effects no adapter handler took (`CopyBlocks`, `CloseRegion`), in order."""
        return [effect for _, effect in self.bus.drain_outbox()]
