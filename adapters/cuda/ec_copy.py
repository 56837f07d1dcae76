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
  - `row_kernel`: a row-copy kernel of this module (compiled once per process with NVRTC,
    launched through the driver API) that copies whole rows with 16-byte words between
    the encoder rows and the region's device mapping; one launch per run of such items in
    a group (encodings in separate tensors need no staging: it reads the block ids and
    each row's address from the pinned buffer), so 16 encodings take 5 launches, not 16;
  - `kernel`: one torch indexing kernel per item over the region's device mapping
    (`index_copy_` for a save, `index_select` for a load), reading the ids the same way;
  - `runs`: one DMA copy (`cudaMemcpyAsync`) per run of consecutive blocks, which is a
    single copy when the item's blocks are contiguous;
  - `auto` (the default): `runs` when the item's blocks form long runs (on average at
    least `dma_min_run_blocks` blocks; DMA leaves the SMs to the model), else
    `row_kernel`, else (no NVRTC or driver API) `kernel`.
  Two more methods exist for measurement: `batch_memcpy` (one `cudaMemcpyBatchAsync`
  call per item, one entry per run; CUDA >= 12.8) and `per_block` (one `copy_` per block:
  the baseline the others beat).

Errors in a batch (a missing or misshaped tensor, a block outside the region, a CUDA
error) are reported as `(batch_id, False)` by the next `poll()`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
import torch

from kvhandoff.adapters.cuda.row_kernel import RowKernels, RowLaunch
from kvhandoff.adapters.cuda.runtime import CudaRuntime, DeviceArray
from kvhandoff.adapters.ec_copy_engine import CopyDirection
from kvhandoff.machines.ec.meta import CopyItem
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["METHODS", "CopyMethod", "CudaCopyEngine", "runs_of"]

log = logging.getLogger("kvhandoff.ec.copy_cuda")

_cuda: Any = torch.cuda  # its Stream, Event and cudart() carry no type annotations

CopyMethod = Literal["auto", "row_kernel", "kernel", "runs", "batch_memcpy", "per_block"]
METHODS: Final[tuple[CopyMethod, ...]] = (
    "auto",
    "row_kernel",
    "kernel",
    "runs",
    "batch_memcpy",
    "per_block",
)

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2
_WORDS: Final[tuple[tuple[int, torch.dtype], ...]] = (
    (16, torch.complex128),  # plain 16-byte loads and stores; bits are never interpreted
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


# -- one batch -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Batch:
    batch_id: int
    event: Any  # a torch.cuda.Event once recorded
    ok: bool
    keep: list[object] = field(default_factory=list)  # alive until the end event fires
    finished: bool = False  # reported by poll()

    def landed(self) -> bool:
        """Whether the end event fired (a failed query fails the batch)."""
        if self.event is None:
            return True
        try:
            return bool(self.event.query())
        except RuntimeError:
            self.ok = False
            return True


@dataclass(slots=True)
class _Ids:
    """A pinned int64 buffer of `2 * capacity`: a batch's block ids in `[0, capacity)` and
    its rows' device addresses in `[capacity, 2 * capacity)` (row-kernel items)."""

    host: torch.Tensor
    array: np.ndarray[Any, Any]
    ptr: int
    capacity: int
    mapped_ptr: int  # the buffer's device address, 0 where it has no device mapping
    mapped: torch.Tensor | None  # the ids part as a CUDA int64 tensor over that mapping


class _Lane:
    """One stream of the pool with the buffers its batches reuse.

    `ids` (pinned) receives a batch's block ids (and row addresses). Kernels read them in
    place through the buffer's device mapping, or, where there is none, from `dev_ids`
    after one `cudaMemcpyAsync` per group. `dev_ids` is only used on this stream, so
    stream order makes its reuse safe; `ids` may be rewritten once the last batch that used
    it (`last`) has finished (its end event fired), else a batch takes a buffer of its own.
    """

    __slots__ = ("dev_ids", "dev_ptr", "handle", "ids", "last", "stream", "wait_event", "waits")

    def __init__(self, engine: CudaCopyEngine, capacity: int) -> None:
        self.stream: Any = _cuda.Stream(engine.device)
        self.handle = int(self.stream.cuda_stream)
        self.waits: Any = _cuda.Event()  # the caller's stream, which this one waits for
        runtime = engine._runtime
        self.wait_event = runtime.new_event() if runtime is not None else 0  # the same, raw
        self.last: _Batch | None = None
        self.ids = engine._new_ids(capacity)
        self.dev_ids = torch.empty(0, dtype=torch.int64, device=engine.device)
        self.dev_ptr = 0

    def device_ids(self, capacity: int) -> None:
        if self.dev_ids.numel() < capacity:
            with torch.cuda.stream(self.stream):  # allocated on (and reused by) this stream
                self.dev_ids = torch.empty(capacity, dtype=torch.int64, device=self.stream.device)
            self.dev_ptr = self.dev_ids.data_ptr()

    def host_free(self) -> bool:
        last = self.last
        if last is None or last.finished:
            return True
        return last.event is not None and last.landed()


def _word(nbytes: int, *ptrs: int, widest: int = 16) -> tuple[int, torch.dtype]:
    """The widest word that divides the row size and aligns every address."""
    for size, dtype in _WORDS:
        if size <= widest and nbytes % size == 0 and all(p % size == 0 for p in ptrs):
            return size, dtype
    return 1, torch.uint8


def runs_of(blocks: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Maximal runs of consecutive block ids: (start offsets in `blocks`, run lengths)."""
    if blocks.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [blocks.size]))).astype(np.int64)
    return starts, lengths


# torch's own current-stream calls without building Stream objects (several µs each);
# where a torch build lacks them, the public calls are used.
_get_stream: Any = getattr(torch._C, "_cuda_getCurrentStream", None)
_set_stream: Any = getattr(torch._C, "_cuda_setStream", None)
_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class CudaCopyEngine:
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
        self._runtime = CudaRuntime.find()
        self._registered = False
        self._pending: list[_Batch] = []
        self._ids: set[int] = set()
        self._events: list[Any] = []  # end events whose batch was reported: reused
        self._packers: dict[int, struct.Struct] = {}
        self._offsets = np.zeros(0, dtype=np.int64)  # row r at byte offset r * block size
        self._widest = 16
        self._word_size, self._word_dtype = _word(block_size_bytes, widest=self._widest)
        self.group_rows = max(1, group_rows)
        self.first_rows = max(1, first_rows)
        self._kernel_views: dict[torch.dtype, torch.Tensor] = {}
        self.kernel_unavailable = ""
        self.row_kernel_unavailable = ""
        self.batch_unavailable = (
            "libcudart not found" if self._runtime is None else self._runtime.batch_reason
        )
        self._fast = (
            self._runtime is not None
            and None not in (_get_stream, _set_stream, _raw_stream)
            and os.environ.get("KVHANDOFF_EC_PUBLIC_STREAM_API", "") != "1"
        )
        self._row_launch: RowLaunch | None = None
        self._device_rows: torch.Tensor | None = None
        self._lanes: list[_Lane] = []
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
        self._lanes = [_Lane(self, self.group_rows) for _ in range(max(1, streams))]
        if method in ("auto", "row_kernel"):
            self._row_launch = self._row_kernels()
        if method == "kernel" and self._device_rows is None:
            raise LocalProtocolError(f"kernel copies unavailable: {self.kernel_unavailable}")
        if method == "row_kernel" and self._row_launch is None:
            raise LocalProtocolError(f"row kernel unavailable: {self.row_kernel_unavailable}")
        if method == "batch_memcpy" and self.batch_unavailable:
            raise LocalProtocolError(f"batch memcpy unavailable: {self.batch_unavailable}")

    # -- set-up --------------------------------------------------------------------------

    def _register(self) -> None:
        if self._region.is_pinned():  # already registered (e.g. by another user of it)
            return
        cudart = _cuda.cudart()
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
        err = cudart.cudaHostRegister(self._host_ptr, self._nbytes, flags)
        if err != cudart.cudaError.success:
            if self._runtime is not None:
                self._runtime.clear_error()
            raise LocalProtocolError(
                f"cudaHostRegister of the region ({self._nbytes} bytes) failed: {err}"
            )
        self._registered = True

    def _device_pointer(self, host_ptr: int) -> int:
        if self._runtime is None:
            return 0
        return self._runtime.device_pointer(host_ptr) or 0

    def _device_view(self, ptr: int, nbytes: int) -> torch.Tensor | None:
        """A CUDA uint8 tensor over device address `ptr`, or None."""
        try:
            view = torch.as_tensor(DeviceArray(ptr, nbytes), device=self.device)
        except (RuntimeError, TypeError, ValueError):
            return None
        return view if view.device == self.device and view.data_ptr() == ptr else None

    def _map_region(self) -> torch.Tensor | None:
        """The region as a CUDA uint8 tensor [blocks, block_size] over its device mapping."""
        ptr = self._device_pointer(self._host_ptr) or self._host_ptr
        flat = self._device_view(ptr, self._nbytes)
        if flat is None:
            self.kernel_unavailable = "no device view of the region"
            return None
        return flat.view(self.num_blocks, self.block_size_bytes)

    def _new_ids(self, rows: int) -> _Ids:
        """A pinned id buffer for at least `rows` rows, with its device mapping."""
        capacity = max(1024, 1 << max(0, rows - 1).bit_length())
        host = torch.empty(2 * capacity, dtype=torch.int64, pin_memory=True)
        ptr = host.data_ptr()
        mapped_ptr = self._device_pointer(ptr) if self.mapped_ids else 0
        mapped = self._device_view(mapped_ptr, 8 * capacity) if mapped_ptr else None
        return _Ids(
            host,
            host.numpy(),
            ptr,
            capacity,
            mapped_ptr if mapped is not None else 0,
            None if mapped is None else mapped.view(torch.int64),
        )

    def _row_kernels(self) -> RowLaunch | None:
        if self._device_rows is None:
            self.row_kernel_unavailable = self.kernel_unavailable
            return None
        if not self._lanes[0].ids.mapped_ptr:
            self.row_kernel_unavailable = "pinned id buffers have no device mapping"
            return None
        kernels = RowKernels.load(self._index)
        if isinstance(kernels, str):
            self.row_kernel_unavailable = kernels
            log.info("CUDA copy engine without its row kernel: %s", kernels)
            return None
        return RowLaunch(kernels, self._device_rows.data_ptr(), self.block_size_bytes)

    def _kernel_view(self, dtype: torch.dtype) -> torch.Tensor:
        view = self._kernel_views.get(dtype)
        if view is None:
            assert self._device_rows is not None
            view = self._device_rows.view(dtype)
            self._kernel_views[dtype] = view
        return view

    def _row_offsets(self, n: int) -> np.ndarray[Any, Any]:
        if self._offsets.shape[0] < n:
            size = max(1024, 1 << max(0, n - 1).bit_length())
            self._offsets = np.arange(size, dtype=np.int64) * self.block_size_bytes
        return self._offsets[:n]

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
        batch = _Batch(batch_id, None, True)
        self._ids.add(batch_id)
        self._pending.append(batch)
        save = direction == "save"
        try:
            if self._fast and lane.wait_event and torch.cuda.current_device() == self._index:
                # The common case, with torch's and the runtime's raw calls (no objects).
                assert self._runtime is not None
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
        still: list[_Batch] = []
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
            if lane.wait_event and self._runtime is not None:
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
            cudart = _cuda.cudart()
            cudart.cudaHostUnregister(self._host_ptr)

    # -- one batch -----------------------------------------------------------------------

    def _id_buffer(self, lane: _Lane, total: int, batch: _Batch) -> _Ids:
        """A pinned buffer for the batch's `total` block ids (and row addresses): the
        lane's own when no unfinished batch still reads it, else one for this batch."""
        if total > lane.ids.capacity:
            batch.keep.append(lane.ids)  # earlier batches on this stream may still read it
            lane.ids = self._new_ids(total)
        elif not lane.host_free():
            own = self._new_ids(total)
            batch.keep.append(own)
            return own
        lane.last = batch
        return lane.ids

    def _upload(self, lane: _Lane, ids: _Ids, start: int, stop: int) -> None:
        """Copy ids `[start, stop)` from the pinned buffer into the lane's device buffer."""
        lane.device_ids(ids.capacity)
        if self._runtime is not None:
            self._runtime.memcpy(
                lane.dev_ptr + 8 * start, ids.ptr + 8 * start, 8 * (stop - start), lane.handle
            )
        else:
            lane.dev_ids[start:stop].copy_(ids.host[start:stop], non_blocking=True)

    def _copy_batch(
        self,
        lane: _Lane,
        save: bool,
        items: Sequence[CopyItem],
        encoder_cache: Mapping[str, torch.Tensor],
        batch: _Batch,
    ) -> None:
        """Enqueue every item's copy on the current (the lane's) stream.

        The batch goes in groups of pieces (an item, or a slice of its rows): first the
        first `first_rows` rows of the first item alone, so the device starts as early as
        possible, then groups of at least `group_rows` rows. A group's block ids are
        packed into the pinned buffer (one `struct.pack_into` per piece) and checked;
        then the group's row-kernel pieces are one launch per run of them, and every other
        piece is one torch indexing kernel or one DMA per run of blocks. The host work of
        a group overlaps the device work of the groups before it.
        """
        todo = [item for item in items if item.num_tokens > 0]
        total = 0
        for item in todo:
            if item.num_tokens > len(item.blocks):
                raise LocalProtocolError(
                    f"{item.mm_hash}: {item.num_tokens} tokens, {len(item.blocks)} blocks"
                )
            total += item.num_tokens
        if not todo:
            return
        pieces = [(item, 0, item.num_tokens) for item in todo]
        head, cut = todo[0], self.first_rows
        if cut < head.num_tokens:
            pieces[0:1] = [(head, 0, cut), (head, cut, head.num_tokens)]
        buf = self._id_buffer(lane, total, batch)
        ids, cap, bs = buf.array, buf.capacity, self.block_size_bytes
        raw: Any = ids  # written through the buffer protocol
        keep = batch.keep
        method = self.method
        rows_launch = self._row_launch if buf.mapped_ptr else None
        if method == "row_kernel" and rows_launch is None:
            raise LocalProtocolError(f"row kernel unavailable: {self.row_kernel_unavailable}")
        offset = first = 0
        while first < len(pieces):
            last, rows_in_group = first + 1, pieces[first][2] - pieces[first][1]
            while first > 0 and last < len(pieces) and rows_in_group < self.group_rows:
                rows_in_group += pieces[last][2] - pieces[last][1]
                last += 1
            group = pieces[first:last]
            start = offset
            for item, lo, hi in group:  # the block ids (the one per-element Python cost)
                self._pack(raw, offset, item, lo, hi)
                offset += hi - lo
            part = ids[start:offset]
            if int(part.view(np.uint64).max()) >= self.num_blocks:
                bad = sorted({item.mm_hash for item, _, _ in group})  # negatives wrap high
                raise LocalProtocolError(f"a block id of {bad} lies outside the region")
            steps = np.diff(part) != 1 if method in ("auto", "runs", "batch_memcpy") else None
            uploaded = False
            span, word = start, 16  # the pending row-kernel launch: rows [span, at)
            at = start
            for item, lo, hi in group:
                n = hi - lo
                tensor = encoder_cache[item.mm_hash]
                keep.append(tensor)  # its memory stays allocated until the end event fires
                how = method
                inner = None if steps is None else steps[at - start : at - start + n - 1]
                if how == "auto":
                    assert inner is not None
                    long_runs = (int(np.count_nonzero(inner)) + 1) * self.dma_min_run_blocks <= n
                    if long_runs or self._device_rows is None:
                        how = "runs"
                    else:
                        how = "row_kernel" if rows_launch is not None else "kernel"
                if how == "row_kernel":
                    assert rows_launch is not None
                    rows = self._rows(item, tensor, save, torch.uint8)
                    ptr = rows.data_ptr()
                    if ptr != tensor.data_ptr():
                        keep.append(rows)  # a contiguous copy of a strided tensor (a save)
                    np.add(self._row_offsets(n), ptr + lo * bs, out=ids[cap + at : cap + at + n])
                    while ptr % word or bs % word:
                        word //= 2
                    at += n
                    continue
                if at > span:  # rows of the row kernel before this piece
                    assert rows_launch is not None
                    self._launch_rows(rows_launch, save, buf, span, at, word, lane.handle)
                span, word = at + n, 16
                if how == "kernel":
                    if buf.mapped is not None:  # the kernel reads the ids from pinned memory
                        index = buf.mapped[at : at + n]
                    else:
                        if not uploaded:
                            self._upload(lane, buf, start, offset)
                            uploaded = True
                        index = lane.dev_ids[at : at + n]
                    self._copy_kernel(save, item, tensor, lo, hi, index, keep)
                else:
                    blocks = ids[at : at + n]
                    rows = self._rows(item, tensor, save, torch.uint8)[lo:hi]
                    keep.append(rows)
                    assert inner is not None or how == "per_block"
                    if how == "runs":
                        assert inner is not None
                        self._copy_runs(save, blocks, np.flatnonzero(inner), rows, lane.handle)
                    elif how == "batch_memcpy":
                        self._copy_batch_memcpy(save, blocks, rows, keep, lane.handle)
                    else:
                        self._copy_per_block(save, blocks, rows)
                at += n
            if at > span:
                assert rows_launch is not None
                self._launch_rows(rows_launch, save, buf, span, at, word, lane.handle)
            first = last

    def _pack(self, raw: Any, offset: int, item: CopyItem, lo: int, hi: int) -> None:
        """Block ids `[lo, hi)` of `item` into the id buffer at `offset` (int64)."""
        n = hi - lo
        packer = self._packers.get(n)
        if packer is None:
            packer = self._packers.setdefault(n, struct.Struct(f"{n}q"))
        seq = item.blocks if lo == 0 and len(item.blocks) == n else item.blocks[lo:hi]
        packer.pack_into(raw, 8 * offset, *seq)

    def _launch_rows(
        self,
        launch: RowLaunch,
        save: bool,
        buf: _Ids,
        start: int,
        stop: int,
        word: int,
        stream: int,
    ) -> None:
        """One row-kernel launch over rows `[start, stop)` of the id buffer."""
        base = buf.mapped_ptr
        ids, rows = base + 8 * start, base + 8 * (buf.capacity + start)
        launch(save, ids, rows, stop - start, word, stream)

    # -- one item --------------------------------------------------------------------------

    def _rows(self, item: CopyItem, tensor: torch.Tensor, save: bool, dtype: torch.dtype) -> Any:
        """The item's first `num_tokens` rows of its encoder tensor as `[n, words]` of `dtype`
        (one view in the common case: a contiguous `[tokens, hidden]` tensor; for a save
        from strided rows, a contiguous copy made on the engine's stream)."""
        n, bs = item.num_tokens, self.block_size_bytes
        if tensor.device != self.device:
            raise LocalProtocolError(
                f"{item.mm_hash}: tensor on {tensor.device}, not {self.device}"
            )
        if (
            tensor.dim() == 2
            and tensor.shape[0] >= n
            and tensor.shape[1] * tensor.element_size() == bs
            and tensor.is_contiguous()
        ):
            words = tensor.view(dtype)
            return words if tensor.shape[0] == n else words[:n]
        if tensor.dim() < 1 or tensor.shape[0] < n:
            raise LocalProtocolError(f"{item.mm_hash}: tensor {tuple(tensor.shape)} < {n} rows")
        rows = tensor[:n]
        if rows.numel() * rows.element_size() != n * bs:
            raise LocalProtocolError(
                f"{item.mm_hash}: rows of {rows.numel() * rows.element_size() // n} bytes, "
                f"blocks of {bs}"
            )
        if not rows.is_contiguous():
            if not save:
                raise LocalProtocolError(f"{item.mm_hash}: cannot load into a strided tensor")
            rows = rows.contiguous()
        return rows.reshape(n, -1).view(torch.uint8).view(n, bs).view(dtype)

    def _copy_kernel(
        self,
        save: bool,
        item: CopyItem,
        tensor: torch.Tensor,
        lo: int,
        hi: int,
        index: torch.Tensor,
        keep: list[object],
    ) -> None:
        """One torch indexing kernel for rows `[lo, hi)` of the item."""
        while True:
            ptr = tensor.data_ptr()
            if ptr % self._word_size == 0:
                size, dtype = self._word_size, self._word_dtype
            else:
                size, dtype = _word(self.block_size_bytes, ptr, widest=self._widest)
            words = self._rows(item, tensor, save, dtype)
            if words.data_ptr() != ptr:
                keep.append(words)  # a contiguous copy of a strided tensor (a save)
            if lo or hi != words.shape[0]:
                words = words[lo:hi]
            region = self._kernel_view(dtype)
            try:
                if save:
                    region.index_copy_(0, index, words)
                else:
                    torch.index_select(region, 0, index, out=words)
                return
            except RuntimeError:
                if size == 1:
                    raise
                self._widest = size // 2  # this word type is not supported: go narrower
                self._word_size, self._word_dtype = _word(
                    self.block_size_bytes, widest=self._widest
                )

    def _copy_runs(
        self,
        save: bool,
        blocks: np.ndarray[Any, Any],
        breaks: np.ndarray[Any, Any],
        rows: torch.Tensor,
        stream: int,
    ) -> None:
        """One DMA per run of consecutive blocks (`breaks`: where `blocks` steps by != 1,
        as offsets of the step's left element)."""
        bs = self.block_size_bytes
        if breaks.size == 0:  # one run: the common case for a contiguous encoding
            starts: list[int] = [0]
            lengths: list[int] = [int(blocks.size)]
        else:
            cut = (breaks + 1).tolist()
            starts = [0, *cut]
            lengths = [b - a for a, b in zip(starts, [*cut, int(blocks.size)], strict=True)]
        firsts = blocks[starts].tolist()
        runtime = self._runtime
        if runtime is not None and rows.is_contiguous():
            host, dev = self._host_ptr, rows.data_ptr()
            for start, length, first in zip(starts, lengths, firsts, strict=True):
                h, d = host + first * bs, dev + start * bs
                if save:
                    runtime.memcpy(h, d, length * bs, stream)
                else:
                    runtime.memcpy(d, h, length * bs, stream)
            return
        host_rows = self._host_rows
        for start, length, first in zip(starts, lengths, firsts, strict=True):
            region_part = host_rows[first : first + length]
            rows_part = rows[start : start + length]
            if save:
                region_part.copy_(rows_part, non_blocking=True)
            else:
                rows_part.copy_(region_part, non_blocking=True)

    def _copy_per_block(self, save: bool, blocks: np.ndarray[Any, Any], rows: torch.Tensor) -> None:
        host = self._host_rows
        for token, block in enumerate(blocks.tolist()):
            if save:
                host[block].copy_(rows[token], non_blocking=True)
            else:
                rows[token].copy_(host[block], non_blocking=True)

    def _copy_batch_memcpy(
        self,
        save: bool,
        blocks: np.ndarray[Any, Any],
        rows: torch.Tensor,
        keep: list[object],
        stream: int,
    ) -> None:
        assert self._runtime is not None
        starts, lengths = runs_of(blocks)
        bs = self.block_size_bytes
        host = (self._host_ptr + blocks[starts] * bs).astype(np.uint64)
        dev = (rows.data_ptr() + starts * bs).astype(np.uint64)
        sizes = (lengths * bs).astype(np.uint64)
        dsts, srcs = (host, dev) if save else (dev, host)
        keep.extend((dsts, srcs, sizes))
        self._runtime.memcpy_batch(dsts, srcs, sizes, save, self._index, stream)
