"""The CUDA copy engine of the encoder-cache tier (R-E05): batched copies of token rows
between GPU encoder outputs and the host-registered `/dev/shm` region.

`CudaCopyEngine` implements `ec_copy_engine.CopyEngine`:

- The region (a flat CPU uint8 tensor over the mapping) is host-registered with
  `cudaHostRegister` (portable + mapped) when the engine starts, so DMA runs at PCIe
  speed and kernels can address the region directly; it is unregistered by `close()`.
  A region that is already pinned (registered by someone else) is used as it is.
- Each batch runs on the next lane of a small pool: a CUDA stream with its own pinned
  buffer (block ids and row addresses, which kernels read through its device mapping) and
  wait event, all reused from batch to batch (no allocation per batch). The stream first
  waits for the caller's current stream (so a save sees the encoder output that stream
  produced); an end event (from a pool) recorded after the batch is what `poll()` queries
  (`Event.query()`, never a synchronize).
- A batch is never one copy call per block. It is enqueued in groups of rows (the first
  `first_rows` rows alone, so the device starts as early as possible, then groups of at
  least `group_rows` rows): a group's block ids are packed into the lane's pinned buffer,
  and the host work of a group overlaps the device work of the groups before it. Per
  item (one encoding, or the slice of it in a group) the engine picks:
  - `row_kernel`: a row-copy kernel (module `row_kernel`: compiled once per process by
    `cuda.core`, launched through `cuda.bindings`) that copies whole rows with 16-byte
    words between the encoder rows and the region's device mapping; one launch per run of
    such items in a group (encodings in separate tensors need no staging: it reads the
    block ids and each row's address from the pinned buffer), so 16 encodings take 5
    launches, not 16;
  - `kernel`: one torch indexing kernel per item over the region's device mapping
    (`index_copy_` for a save, `index_select` for a load), reading the ids the same way;
  - `runs`: one DMA copy (`cudaMemcpyAsync`) per run of consecutive blocks, which is a
    single copy when the item's blocks are contiguous;
  - `auto` (the default): `runs` when the item's blocks form long runs (on average at
    least `dma_min_run_blocks` blocks; DMA leaves the SMs to the model), else
    `row_kernel`, else (no NVRTC) `kernel`.
  Two more methods exist for measurement: `batch_memcpy` (one `cudaMemcpyBatchAsync`
  call per item, one entry per run; CUDA >= 12.8) and `per_block` (one `copy_` per block:
  the baseline the others beat).

The runtime calls (memcpy, events, host registration) go through NVIDIA's
`cuda.bindings` (`runtime`); the engine needs the `gpu` extra (`pip install
'kvhandoff[gpu]'`) and says so when it is missing.

Errors in a batch (a missing or misshaped tensor, a block outside the region, a CUDA
error) are reported as `(batch_id, False)` by the next `poll()`.

This module is the engine's facade (construction, `submit`, `poll`, `close`); its parts
live beside it: `copy_methods` (the method names, word sizes, runs of blocks), `lanes`
(the stream pool and the batch record), `region_mapping` (registration, device mapping,
id buffers, row kernel), `item_copies` (one item's copy paths) and `batching` (groups,
id packing and the method of each piece).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvhandoff.adapters.cuda.batching import BatchCopies
from kvhandoff.adapters.cuda.copy_methods import METHODS, CopyMethod, runs_of, word
from kvhandoff.adapters.cuda.lanes import Batch, Lane
from kvhandoff.adapters.cuda.row_kernel import RowLaunch
from kvhandoff.adapters.cuda.runtime import CudaRuntime
from kvhandoff.adapters.ec_copy_engine import CopyDirection
from kvhandoff.machines.ec.meta import CopyItem
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["METHODS", "CopyMethod", "CudaCopyEngine", "runs_of"]

log = logging.getLogger("kvhandoff.ec.copy_cuda")

_cuda: Any = torch.cuda  # its Stream and Event carry no type annotations


# torch's own current-stream calls without building Stream objects (several µs each);
# where a torch build lacks them, the public calls are used.
_get_stream: Any = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream: Any = getattr(torch._C, "_cuda_setStream", None)
_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class CudaCopyEngine(BatchCopies):
    """Batched token-row copies between CUDA encoder outputs and a host-registered region."""

    def __init__(
        self,
        region: torch.Tensor,
        block_size_bytes: int,
        *,
        device: torch.device | str | int | None = None,
        streams: int = 4,
        method: CopyMethod = "auto",
        dma_min_run_blocks: int = 64,
        group_rows: int = 2048,
        first_rows: int = 256,
        mapped_ids: bool = True,
    ) -> None:
        if not torch.cuda.is_available():
            raise LocalProtocolError("CudaCopyEngine needs CUDA; use ec_copy_cpu.CpuCopyEngine")
        if method not in METHODS:
            raise LocalProtocolError(f"unknown copy method {method!r}; one of {METHODS}")
        if region.device.type != "cpu" or region.dtype != torch.uint8 or region.dim() != 1:
            raise LocalProtocolError("the region must be a flat CPU uint8 tensor")
        if not region.is_contiguous():
            raise LocalProtocolError("the region tensor must be contiguous")
        if block_size_bytes <= 0 or region.numel() < block_size_bytes:
            raise LocalProtocolError(
                f"a region of {region.numel()} bytes holds no block of {block_size_bytes} bytes"
            )
        runtime = CudaRuntime.load()
        if isinstance(runtime, str):
            raise LocalProtocolError(runtime)
        if device is None or isinstance(device, int):
            device = torch.device("cuda", torch.cuda.current_device() if device is None else device)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise LocalProtocolError(f"CudaCopyEngine runs on a CUDA device, not {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._index: int = self.device.index or 0
        self.block_size_bytes = block_size_bytes
        self.num_blocks = region.numel() // block_size_bytes
        self.method: CopyMethod = method
        self.dma_min_run_blocks = max(1, dma_min_run_blocks)
        self.mapped_ids = mapped_ids
        self._region = region
        self._nbytes = self.num_blocks * block_size_bytes
        self._host_ptr = region.data_ptr()
        self._host_rows = region[: self._nbytes].view(self.num_blocks, block_size_bytes)
        self._runtime = runtime
        self._registered = False
        self._pending: list[Batch] = []
        self._ids: set[int] = set()
        self._events: list[Any] = []  # end events whose batch was reported: reused
        self._packers: dict[int, struct.Struct] = {}
        self._offsets = np.zeros(0, dtype=np.int64)  # row r at byte offset r * block size
        self._widest = 16
        self._word_size, self._word_dtype = word(block_size_bytes, widest=self._widest)
        self.group_rows = max(1, group_rows)
        self.first_rows = max(1, first_rows)
        self._kernel_views: dict[torch.dtype, torch.Tensor] = {}
        self.kernel_unavailable = ""
        self.row_kernel_unavailable = ""
        self.batch_unavailable = runtime.batch_reason
        self._fast = (
            None not in (_get_stream, _set_stream, _raw_stream)
            and os.environ.get("KVHANDOFF_EC_PUBLIC_STREAM_API", "") != "1"
        )
        self._row_launch: RowLaunch | None = None
        self._device_rows: torch.Tensor | None = None
        self._lanes: list[Lane] = []
        self._next_lane = 0
        with torch.cuda.device(self.device):
            self._register()
            try:
                self._start(method, streams)
            except BaseException:
                # Never leave the region registered: a later mapping at the same address
                # would look pinned and reach the old pages through the stale registration.
                self.close()
                raise

    def _start(self, method: CopyMethod, streams: int) -> None:
        self._device_rows = self._map_region()
        self._lanes = [Lane(self, self.group_rows) for _ in range(max(1, streams))]
        if method in ("auto", "row_kernel"):
            self._row_launch = self._row_kernels()
        if method == "kernel" and self._device_rows is None:
            raise LocalProtocolError(f"kernel copies unavailable: {self.kernel_unavailable}")
        if method == "row_kernel" and self._row_launch is None:
            raise LocalProtocolError(f"row kernel unavailable: {self.row_kernel_unavailable}")
        if method == "batch_memcpy" and self.batch_unavailable:
            raise LocalProtocolError(f"batch memcpy unavailable: {self.batch_unavailable}")

    # -- CopyEngine ----------------------------------------------------------------------

    def submit(
        self,
        batch_id: int,
        direction: CopyDirection,
        items: Sequence[CopyItem],
        encoder_cache: Mapping[str, torch.Tensor],
    ) -> None:
        if batch_id in self._ids:
            raise LocalProtocolError(f"copy batch {batch_id} is already in flight")
        if direction not in ("save", "load"):
            raise LocalProtocolError(f"unknown copy direction {direction!r}")
        lanes = self._lanes
        lane = lanes[self._next_lane]
        self._next_lane = (self._next_lane + 1) % len(lanes)
        stream = lane.stream
        batch = Batch(batch_id, None, True)
        self._ids.add(batch_id)
        self._pending.append(batch)
        save = direction == "save"
        try:
            if self._fast and lane.wait_event and torch.cuda.current_device() == self._index:
                # The common case, with torch's and the runtime's raw calls (no objects).
                index = self._index
                caller = _get_stream(index)
                self._runtime.wait_for(lane.handle, _raw_stream(index), lane.wait_event)
                _set_stream(
                    stream_id=stream.stream_id,
                    device_index=index,
                    device_type=stream.device_type,
                )
                try:
                    self._copy_batch(lane, save, items, encoder_cache, batch)
                finally:
                    _set_stream(stream_id=caller[0], device_index=caller[1], device_type=caller[2])
            else:
                caller = torch.cuda.current_stream(self.device)
                with torch.cuda.device(self.device), torch.cuda.stream(stream):
                    lane.waits.record(caller)
                    stream.wait_event(lane.waits)  # a save reads what the caller's stream made
                    self._copy_batch(lane, save, items, encoder_cache, batch)
        except Exception as exc:  # reported as a failed batch, never raised (R-E05)
            batch.ok = False
            log.warning("%s batch %s failed: %s", direction, batch_id, exc)
        try:
            event = self._events.pop() if self._events else _cuda.Event()
            event.record(stream)
            batch.event = event
        except RuntimeError:
            batch.event, batch.ok = None, False
            with contextlib.suppress(RuntimeError):
                stream.synchronize()  # the lane's buffers must be free before it is reused

    def poll(self) -> list[tuple[int, bool]]:
        done: list[tuple[int, bool]] = []
        still: list[Batch] = []
        for batch in self._pending:
            if batch.landed():
                done.append((batch.batch_id, batch.ok))
                self._ids.discard(batch.batch_id)
                batch.finished = True
                batch.keep.clear()
                if batch.event is not None and batch.ok:
                    self._events.append(batch.event)
            else:
                still.append(batch)
        self._pending = still
        return done

    def in_flight(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Wait for batches in flight, then unregister the region. Idempotent."""
        for batch in self._pending:
            if batch.event is not None:
                with contextlib.suppress(RuntimeError):
                    batch.event.synchronize()
        for lane in self._lanes:
            with contextlib.suppress(RuntimeError):
                lane.stream.synchronize()
            if lane.wait_event:
                self._runtime.destroy_event(lane.wait_event)
                lane.wait_event = 0
        self._pending.clear()
        self._ids.clear()
        self._events.clear()
        self._kernel_views.clear()
        self._device_rows = None
        self._row_launch = None
        if self._registered:
            self._registered = False
            self._runtime.host_unregister(self._host_ptr)
