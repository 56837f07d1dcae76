"""Worker half of the CPU encoder-cache connector (R-E03, R-E05).

A thin API over two machines on the worker's own bus: `ec.worker_region` (registered,
closed) and one `ec.copy_batch` per batched save or load. Copies are `CopyBlocks` effects
for a copy engine adapter; the adapter reports each batch's end event with
`on_copy_done`. Register handlers with `worker.bus.handle(CopyBlocks, ...)` and
`worker.bus.handle(CloseRegion, ...)`, or drain `worker.drain_effects()`.

Per engine step: `start_load_caches(meta)` submits the step's loads and remembers where
the step's encoder outputs go; `save_caches(...)` submits saves (writer rank only);
`build_connector_worker_meta()` reports every batch whose end event was seen, and the
saves of this step that were never submitted (so the scheduler frees their blocks).
Every call that changes state takes `now` from its caller; nothing here reads a clock.
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
    Report,
    Submit,
)
from kvhandoff.machines.ec.meta import (
    CopyDirection,
    CopyItem,
    ECConnectorMeta,
    ECFinished,
    ECWorkerMeta,
)
from kvhandoff.machines.ec.nixl_gate import require_nixl
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
        self.is_writer = tp_rank == 0 and pcp_rank == 0
        self.bus = EventBus()
        self.bus.register(EC_WORKER_REGION)
        self.bus.register(EC_COPY_BATCH)
        self.bus.handle(CopyLanded, self._landed)
        self._region: Instance[RegionCtx] | None = None  # created by its first event
        self._batch_ids = itertools.count(1)
        self._pending_saves: dict[str, CopyItem] = {}
        self._abandoned: list[str] = []
        self._landed_saves: set[str] = set()
        self._landed_loads: set[str] = set()
        self._landed_failed: set[str] = set()

    # -- lifecycle of the region -----------------------------------------------------------

    def register_caches(self, region_base_addr: int, region_bytes: int | None, now: float) -> None:
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
                f"ECWorker.{what}: the region is {state}; call register_caches "
                "first (and not after shutdown)"
            )

    # -- one engine step ---------------------------------------------------------------

    def start_load_caches(self, meta: ECConnectorMeta, now: float) -> None:
        """Submit this step's loads; remember where this step's saves go."""
        self._require_registered("start_load_caches")
        self._abandoned.extend(self._pending_saves)  # a step that never reported
        self._pending_saves = {item.mm_hash: item for item in meta.saves} if self.is_writer else {}
        if meta.loads:
            self._submit("load", meta.loads, now)

    def save_caches(self, now: float, mm_hashes: Iterable[str] | None = None) -> None:
        """Submit saves of this step's encoder outputs (all, or those named). Only the
        writer rank writes (R-E03); on other ranks this does nothing."""
        self._require_registered("save_caches")
        if not self.is_writer:
            return
        names = list(self._pending_saves) if mm_hashes is None else list(mm_hashes)
        unknown = [h for h in names if h not in self._pending_saves]
        if unknown:
            raise LocalProtocolError(f"ECWorker.save_caches: no save was planned for {unknown}")
        items = tuple(self._pending_saves.pop(h) for h in names)
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

    def _landed(self, inst: Instance[BatchCtx] | None, effect: CopyLanded) -> None:
        if not effect.ok:
            self._landed_failed.update(effect.mm_hashes)
        elif effect.direction == "save":
            self._landed_saves.update(effect.mm_hashes)
        else:
            self._landed_loads.update(effect.mm_hashes)

    # -- reports -------------------------------------------------------------------------

    def build_connector_worker_meta(self, now: float) -> ECWorkerMeta:
        """Report landed batches and abandoned saves to the scheduler (R-E05)."""
        saved: list[str] = []
        loaded: list[str] = []
        failed_saves: list[str] = [*self._abandoned, *self._pending_saves]
        failed_loads: list[str] = []
        self._pending_saves, self._abandoned = {}, []
        for inst in self.bus.tagged(EC_COPY_BATCH, "reportable"):
            ctx = inst.ctx
            names = [item.mm_hash for item in ctx.items]
            if ctx.direction == "save":
                (saved if ctx.ok else failed_saves).extend(names)
            else:
                (loaded if ctx.ok else failed_loads).extend(names)
            self.bus.dispatch(EC_COPY_BATCH, inst.key, Report(), now)
        return ECWorkerMeta(tuple(saved), tuple(loaded), tuple(failed_saves), tuple(failed_loads))

    def get_finished(self) -> ECFinished:
        """Encodings whose copies landed (or failed) since the last call, for the runner."""
        finished = ECFinished(
            frozenset(self._landed_saves),
            frozenset(self._landed_loads),
            frozenset(self._landed_failed),
        )
        self._landed_saves.clear()
        self._landed_loads.clear()
        self._landed_failed.clear()
        return finished

    def in_flight(self) -> int:
        """Batches submitted whose end event has not been seen yet."""
        return len(self.bus.tagged(EC_COPY_BATCH, "in_flight"))

    def drain_effects(self) -> list[object]:
        """Effects no adapter handler took (`CopyBlocks`, `CloseRegion`), in order."""
        return [effect for _, effect in self.bus.drain_outbox()]
