"""One worker rank of an encoder-cache instance, in its own process, with vLLM's call names.

An engine builds the scheduler connector in one process and one worker connector per
TP/PCP rank in others (R-T01); they share nothing but the scheduler's per-step
`ECConnectorMeta` going down and each rank's `ECWorkerMeta` coming up (plain records an
engine serialises between its processes). `ECWorkerSide` is the worker connector of one
rank: it maps the instance's `/dev/shm` region (created and unlinked by the process of the
scheduler side, `ECSide`), runs an `ECWorker` for `tp_rank` / `pcp_rank` and executes its
`CopyBlocks` on a copy engine (`CpuCopyEngine` unless a factory is given).

The calls are those of vLLM 0.33's `ECConnectorBase` (worker side):
`bind_connector_metadata(meta)`, `start_load_caches(encoder_cache)` (every rank loads into
its own encoder cache; a missing tensor is allocated `[num_tokens, hidden_dim]` of
`dtype`), `save_caches(encoder_cache, mm_hash)` (the writer rank, TP 0 / PCP 0, only:
R-E03), `build_connector_worker_meta()`, `get_finished(...)`,
`clear_connector_metadata()`, `shutdown()`. Each reads the injected clock once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.ec_copy_cpu import CpuCopyEngine
from kvhandoff.adapters.ec_copy_engine import CopyEngine
from kvhandoff.adapters.shm.region import SHM_DIR, SharedRegion
from kvhandoff.machines.ec.copy_batch import CopyBlocks
from kvhandoff.machines.ec.meta import ECConnectorMeta, ECFinished, ECWorkerMeta
from kvhandoff.machines.ec.worker import ECWorker
from kvhandoff.machines.ec.worker_region import CloseRegion
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["ECWorkerSide"]

log = logging.getLogger("kvhandoff.ec.worker_side")

CopyEngineFactory = Callable[[torch.Tensor, int], CopyEngine]


class ECWorkerSide:
    """The worker connector of one TP/PCP rank over the instance's shared region."""

    def __init__(
        self,
        config: ECTransferConfig,
        layout: ECLayout,
        *,
        region_name: str,
        tp_rank: int = 0,
        pcp_rank: int = 0,
        shm_dir: str = SHM_DIR,
        dtype: torch.dtype = torch.bfloat16,
        env: Mapping[str, str] | None = None,
        clock: Clock = real_clock,
        copy_engine_factory: CopyEngineFactory | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        """`region_name`: the region the scheduler side created (`ECSide.region.name`).
        `device`: where the engine's encoder cache lives; on CUDA (and with no factory
        given) the copies run on `CudaCopyEngine`'s pooled streams (R-E05) and loads are
        allocated on that device."""
        if dtype.itemsize != layout.dtype_size:
            raise LocalProtocolError(
                f"dtype {dtype} has {dtype.itemsize} bytes; the layout says {layout.dtype_size}"
            )
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.clock = clock
        self.worker = ECWorker(config, layout, tp_rank=tp_rank, pcp_rank=pcp_rank, env=env)
        self.region: SharedRegion | None = SharedRegion.attach(
            region_name, shm_dir=shm_dir, expected_size=None
        )
        self.copy_engine: CopyEngine | None = None
        self._cache: MutableMapping[str, torch.Tensor] = {}  # the engine's encoder cache
        self._closed = False
        try:
            factory = copy_engine_factory or _engine_for(self.device)
            self.copy_engine = factory(self.region.as_tensor(), layout.block_size_bytes)
            self.worker.bus.handle(CopyBlocks, self._copy)
            self.worker.bus.handle(CloseRegion, self._close_region)
            self.worker.register_region(self.region.addr, self.region.size, clock())
        except BaseException:
            self.shutdown()
            raise

    def _open(self, call: str) -> float:
        if self._closed:
            raise LocalProtocolError(f"ECWorkerSide.{call}: the worker was shut down")
        return self.clock()

    # -- vLLM's worker-side calls ----------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: ECConnectorMeta) -> None:
        self.worker.bus.advance(self._open("bind_connector_metadata"))
        self.worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        self.worker.clear_connector_metadata()

    def start_load_caches(
        self, encoder_cache: MutableMapping[str, torch.Tensor], **kwargs: Any
    ) -> None:
        """Load the bound plan's encodings into `encoder_cache` (allocating what is
        missing); each lands when the copy engine reports its batch."""
        now = self._open("start_load_caches")
        hidden = self.layout.hidden_dim
        for item in self.worker.planned_loads:
            if item.mm_hash not in encoder_cache:
                encoder_cache[item.mm_hash] = torch.empty(
                    (item.num_tokens, hidden), dtype=self.dtype, device=self.device
                )
        self._cache = encoder_cache
        self.worker.start_load_caches(now)

    def save_caches(
        self, encoder_cache: MutableMapping[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        """Save the encoder output of `mm_hash` where the plan put it (writer rank only)."""
        now = self._open("save_caches")
        self._cache = encoder_cache
        if self.worker.is_writer:
            self.worker.save_caches(now, [mm_hash])

    def build_connector_worker_meta(self) -> ECWorkerMeta | None:
        """This rank's report for the step (None when there is nothing to report)."""
        now = self._open("build_connector_worker_meta")
        self._poll_copies(now)
        meta = self.worker.build_connector_worker_meta(now)
        return meta if meta else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """No request waits on this connector to finish (copies are per encoding)."""
        return None, None

    def take_landed(self) -> ECFinished:
        """Encodings whose copies landed or failed since the last call, for the runner."""
        return self.worker.take_landed()

    def shutdown(self) -> None:
        """Unmap the region (the scheduler side's process unlinks it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.worker.shutdown(self.clock())  # CloseRegion(unlink=False): not the owner
        if self.region is not None:  # registration never happened
            self._close_region(None, CloseRegion(unlink=False))

    # -- edges -----------------------------------------------------------------------------

    def _copy(self, inst: Instance[Any] | None, effect: CopyBlocks) -> None:
        engine = self.copy_engine
        try:
            if engine is None:
                raise LocalProtocolError("the copy engine is closed")
            engine.submit(effect.batch_id, effect.direction, effect.items, self._cache)
        except Exception:  # an engine that raises fails its batch, never the step
            self.worker.on_copy_refused(effect.batch_id)  # failed at the next poll

    def _poll_copies(self, now: float) -> None:
        self.worker.fail_refused(now)
        if self.copy_engine is not None:
            for batch_id, ok in self.copy_engine.poll():
                self.worker.on_copy_done(batch_id, now, ok=ok)

    def _close_region(self, inst: Instance[Any] | None, effect: CloseRegion) -> None:
        if self.copy_engine is not None:
            self.copy_engine.close()
            self.copy_engine = None
        region, self.region = self.region, None
        if region is None:
            return
        try:
            region.close()
        except LocalProtocolError as exc:  # a view is still alive: unmapped when it goes
            log.warning("%s", exc)


def _engine_for(device: torch.device) -> CopyEngineFactory:
    """The copy engine of an encoder cache on `device`: CUDA's (imported only then) or
    the CPU one."""
    if device.type != "cuda":
        return CpuCopyEngine
    from kvhandoff.adapters.cuda.ec_copy import CudaCopyEngine

    def cuda_engine(region: torch.Tensor, block_size_bytes: int) -> CopyEngine:
        return CudaCopyEngine(region, block_size_bytes, device=device)

    return cuda_engine
