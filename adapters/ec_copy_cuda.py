"""The CUDA copy engine of the encoder-cache tier (R-E05): batched copies of token rows
between GPU encoder outputs and the host-registered `/dev/shm` region.

`CudaCopyEngine` implements `ec_copy_engine.CopyEngine`:

- The region (a flat CPU uint8 tensor over the mapping) is host-registered with
  `cudaHostRegister` (portable + mapped) when the engine starts, so DMA runs at PCIe
  speed and kernels can address the region directly; it is unregistered by `close()`.
  A region that is already pinned (registered by someone else) is used as it is.
- Each batch runs on the next stream of a small pool; the stream first waits for the
  caller's current stream (so a save sees the encoder output that stream produced), and
  an end event recorded after the batch is what `poll()` queries (`Event.query()`, never
  a synchronize).
- A batch is never one copy call per block. Items are enqueued in groups (the first
  item alone, so the device starts at once, then groups of at least `group_rows` rows):
  a group's block ids are written into a pinned buffer and uploaded with one copy, and
  the host work of a group overlaps the device work of the groups before it. Per item
  (one encoding) the engine picks:
  - `kernel`: one indexing kernel per item that reads or writes the region through its
    device mapping (`index_copy_` for a save, `index_select` for a load), moving 16-byte
    words when the row size and addresses allow;
  - `runs`: one DMA copy (`cudaMemcpyAsync`) per run of consecutive blocks, which is a
    single copy when the item's blocks are contiguous;
  - `auto` (the default): `runs` when the item's blocks form long runs (on average at
    least `dma_min_run_blocks` blocks), else `kernel`; DMA leaves the SMs to the model.
  Two more methods exist for measurement: `batch_memcpy` (one `cudaMemcpyBatchAsync`
  call per item, one entry per run; CUDA >= 12.8) and `per_block` (one copy per block:
  the baseline the others beat).

Errors in a batch (a missing or misshaped tensor, a block outside the region, a CUDA
error) are reported as `(batch_id, False)` by the next `poll()`.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

import numpy as np
import torch

from kvhandoff.adapters.ec_copy_engine import CopyDirection
from kvhandoff.machines.ec_meta import CopyItem
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["METHODS", "CopyMethod", "CudaCopyEngine", "runs_of"]

log = logging.getLogger("kvhandoff.ec.copy_cuda")

_cuda: Any = torch.cuda  # its Stream, Event and cudart() carry no type annotations

CopyMethod = Literal["auto", "kernel", "runs", "batch_memcpy", "per_block"]
METHODS: Final[tuple[CopyMethod, ...]] = ("auto", "kernel", "runs", "batch_memcpy", "per_block")

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2
_WORDS: Final[tuple[tuple[int, torch.dtype], ...]] = (
    (16, torch.complex128),  # plain 16-byte loads and stores; bits are never interpreted
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


# -- the CUDA runtime, for the calls torch does not expose ---------------------------------


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


_SRC_ACCESS_ORDER_STREAM = 1
_MEM_LOCATION_DEVICE = 1
_MEM_LOCATION_HOST = 2


class _CudaRuntime:
    """ctypes access to the `libcudart` that torch already loaded (never a second copy)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        version = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaHostGetDevicePointer.restype = ctypes.c_int
        lib.cudaHostGetDevicePointer.argtypes = (
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_uint,
        )
        self._batch: Any = None
        self.batch_reason = "cudaMemcpyBatchAsync needs CUDA >= 12.8"
        if self.version >= 12080 and hasattr(lib, "cudaMemcpyBatchAsync"):
            fn = lib.cudaMemcpyBatchAsync
            fn.restype = ctypes.c_int
            ptr = ctypes.c_void_p
            head = (ptr, ptr, ptr, ctypes.c_size_t, ptr, ptr, ctypes.c_size_t)
            # CUDA 13 dropped the `failIdx` out-parameter that 12.8/12.9 have before the stream.
            fn.argtypes = (*head, ptr) if self.version >= 13000 else (*head, ptr, ptr)
            self._batch = fn
            self.batch_reason = ""

    @classmethod
    def find(cls) -> _CudaRuntime | None:
        """The loaded libcudart, by soname or from /proc/self/maps; None if not found."""
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    path = line.split()[-1] if line.strip() else ""
                    if "/libcudart.so" in path and path not in names:
                        names.insert(0, path)
        except OSError:
            pass
        for name in names:
            try:
                return cls(ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL))
            except (OSError, AttributeError):
                continue
        return None

    def clear_error(self) -> int:
        return int(self.lib.cudaGetLastError())

    def device_pointer(self, host_ptr: int) -> int | None:
        out = ctypes.c_void_p(0)
        if self.lib.cudaHostGetDevicePointer(ctypes.byref(out), host_ptr, 0) != 0:
            self.clear_error()
            return None
        return out.value

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def memcpy_batch(
        self,
        dsts: np.ndarray[Any, Any],
        srcs: np.ndarray[Any, Any],
        sizes: np.ndarray[Any, Any],
        to_host: bool,
        device_index: int,
        stream: int,
    ) -> None:
        """One `cudaMemcpyBatchAsync` of `len(sizes)` copies (uint64 arrays) on `stream`."""
        attrs = _MemcpyAttributes()
        attrs.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
        device = _MemLocation(_MEM_LOCATION_DEVICE, device_index)
        host = _MemLocation(_MEM_LOCATION_HOST, 0)
        attrs.srcLocHint, attrs.dstLocHint = (device, host) if to_host else (host, device)
        attrs.flags = 0
        index = ctypes.c_size_t(0)
        args: list[Any] = [
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            len(sizes),
            ctypes.addressof(attrs),
            ctypes.addressof(index),
            1,
        ]
        if self.version < 13000:
            fail = ctypes.c_size_t(0)
            args.append(ctypes.addressof(fail))
        args.append(stream)
        err = int(self._batch(*args))
        if err != 0:
            self.clear_error()
            raise RuntimeError(f"cudaMemcpyBatchAsync failed with CUDA error {err}")


class _DeviceArray:
    """A `__cuda_array_interface__` over a device address (the region's mapping)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


# -- one batch -----------------------------------------------------------------------------


@dataclass(slots=True)
class _Batch:
    batch_id: int
    event: Any  # a torch.cuda.Event once recorded
    ok: bool
    keep: list[object] = field(default_factory=list)  # alive until the end event fires


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
        self.block_size_bytes = block_size_bytes
        self.num_blocks = region.numel() // block_size_bytes
        self.method: CopyMethod = method
        self.dma_min_run_blocks = max(1, dma_min_run_blocks)
        self._region = region
        self._nbytes = self.num_blocks * block_size_bytes
        self._host_ptr = region.data_ptr()
        self._host_rows = region[: self._nbytes].view(self.num_blocks, block_size_bytes)
        self._runtime = _CudaRuntime.find()
        self._registered = False
        self._pending: list[_Batch] = []
        self._ids: set[int] = set()
        self._widest = 16
        self._word_size, self._word_dtype = _word(block_size_bytes, widest=self._widest)
        self.group_rows = max(1, group_rows)
        self._kernel_views: dict[torch.dtype, torch.Tensor] = {}
        self.kernel_unavailable = ""
        self.batch_unavailable = (
            "libcudart not found" if self._runtime is None else self._runtime.batch_reason
        )
        with torch.cuda.device(self.device):
            self._register()
            self._streams = [_cuda.Stream(self.device) for _ in range(max(1, streams))]
            self._device_rows = self._map_region()
        self._next_stream = 0
        if method == "kernel" and self._device_rows is None:
            raise LocalProtocolError(f"kernel copies unavailable: {self.kernel_unavailable}")
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

    def _map_region(self) -> torch.Tensor | None:
        """The region as a CUDA uint8 tensor [blocks, block_size] over its device mapping."""
        ptr = self._host_ptr
        if self._runtime is not None:
            ptr = self._runtime.device_pointer(self._host_ptr) or ptr
        try:
            flat = torch.as_tensor(_DeviceArray(ptr, self._nbytes), device=self.device)
        except (RuntimeError, TypeError, ValueError) as exc:
            self.kernel_unavailable = f"no device view of the region: {exc}"
            return None
        if flat.device != self.device or flat.data_ptr() != ptr:
            self.kernel_unavailable = f"the region's device view landed on {flat.device}"
            return None
        return flat.view(self.num_blocks, self.block_size_bytes)

    def _kernel_view(self, dtype: torch.dtype) -> torch.Tensor:
        view = self._kernel_views.get(dtype)
        if view is None:
            assert self._device_rows is not None
            view = self._device_rows.view(dtype)
            self._kernel_views[dtype] = view
        return view

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
        stream = self._streams[self._next_stream]
        self._next_stream = (self._next_stream + 1) % len(self._streams)
        batch = _Batch(batch_id, None, True)
        self._ids.add(batch_id)
        self._pending.append(batch)
        try:
            caller = torch.cuda.current_stream(self.device)
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                stream.wait_stream(caller)  # a save reads what the caller's stream produced
                self._copy_batch(direction, items, encoder_cache, batch.keep)
        except Exception as exc:  # reported as a failed batch, never raised (R-E05)
            batch.ok = False
            log.warning("%s batch %s failed: %s", direction, batch_id, exc)
        try:
            batch.event = _cuda.Event()
            batch.event.record(stream)
        except RuntimeError:
            batch.event, batch.ok = None, False

    def poll(self) -> list[tuple[int, bool]]:
        done: list[tuple[int, bool]] = []
        still: list[_Batch] = []
        for batch in self._pending:
            fired = True
            if batch.event is not None:
                try:
                    fired = batch.event.query()
                except RuntimeError:
                    batch.ok = False
            if fired:
                done.append((batch.batch_id, batch.ok))
                self._ids.discard(batch.batch_id)
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
        self._pending.clear()
        self._ids.clear()
        self._kernel_views.clear()
        self._device_rows = None
        if self._registered:
            self._registered = False
            cudart = _cuda.cudart()
            cudart.cudaHostUnregister(self._host_ptr)

    # -- one item --------------------------------------------------------------------------

    def _rows(self, item: CopyItem, tensor: torch.Tensor, save: bool, dtype: torch.dtype) -> Any:
        """The item's first `num_tokens` rows of its encoder tensor as `[n, words]` of `dtype`
        (one view in the common case: a contiguous `[tokens, hidden]` tensor)."""
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

    def _copy_batch(
        self,
        direction: CopyDirection,
        items: Sequence[CopyItem],
        encoder_cache: Mapping[str, torch.Tensor],
        keep: list[object],
    ) -> None:
        """Enqueue every item's copy on the current (engine) stream.

        Items go in groups: the first item alone (so the device starts early), then
        groups of at least `group_rows` rows. A group's block ids are written into one
        pinned buffer and uploaded with one copy; then each item of the group is one
        kernel or one DMA per run. The host work of a group overlaps the device work of
        the groups before it.
        """
        todo = [item for item in items if item.num_tokens > 0]
        for item in todo:
            if item.num_tokens > len(item.blocks):
                raise LocalProtocolError(
                    f"{item.mm_hash}: {item.num_tokens} tokens, {len(item.blocks)} blocks"
                )
        if not todo:
            return
        total = sum(item.num_tokens for item in todo)
        host_index = torch.empty(total, dtype=torch.int64, pin_memory=True)
        keep.append(host_index)
        ids = host_index.numpy()
        save = direction == "save"
        offset = first = 0
        while first < len(todo):
            last, rows_in_group = first + 1, todo[first].num_tokens
            while first > 0 and last < len(todo) and rows_in_group < self.group_rows:
                rows_in_group += todo[last].num_tokens
                last += 1
            group = todo[first:last]
            start = offset
            for item in group:  # the block ids (the one per-element Python cost)
                n = item.num_tokens
                ids[offset : offset + n] = item.blocks if len(item.blocks) == n else item.blocks[:n]
                offset += n
            if int(ids[start:offset].view(np.uint64).max()) >= self.num_blocks:
                bad = [item.mm_hash for item in group]  # negatives wrap high, too
                raise LocalProtocolError(f"a block id of {bad} lies outside the region")
            index: torch.Tensor | None = None
            at = start
            for item in group:
                n = item.num_tokens
                blocks = ids[at : at + n]
                tensor = encoder_cache[item.mm_hash]
                keep.append(tensor)  # its memory stays allocated until the end event fires
                method = self.method
                if method == "auto":
                    breaks = int(np.count_nonzero(np.diff(blocks) != 1))
                    long_runs = (breaks + 1) * self.dma_min_run_blocks <= n
                    method = "runs" if long_runs or self._device_rows is None else "kernel"
                if method == "kernel":
                    if index is None:
                        index = host_index[start:offset].to(self.device, non_blocking=True)
                        keep.append(index)
                    self._copy_kernel(save, item, tensor, index[at - start : at - start + n], keep)
                else:
                    rows = self._rows(item, tensor, save, torch.uint8)
                    keep.append(rows)
                    if method == "runs":
                        self._copy_runs(save, blocks, rows)
                    elif method == "batch_memcpy":
                        self._copy_batch_memcpy(save, blocks, rows, keep)
                    else:
                        self._copy_per_block(save, blocks, rows)
                at += n
            first = last

    def _copy_kernel(
        self,
        save: bool,
        item: CopyItem,
        tensor: torch.Tensor,
        index: torch.Tensor,
        keep: list[object],
    ) -> None:
        while True:
            ptr = tensor.data_ptr()
            if ptr % self._word_size == 0:
                size, dtype = self._word_size, self._word_dtype
            else:
                size, dtype = _word(self.block_size_bytes, ptr, widest=self._widest)
            words = self._rows(item, tensor, save, dtype)
            keep.append(words)
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

    def _copy_runs(self, save: bool, blocks: np.ndarray[Any, Any], rows: torch.Tensor) -> None:
        starts, lengths = runs_of(blocks)
        host = self._host_rows
        for start, length in zip(starts.tolist(), lengths.tolist(), strict=True):
            first = int(blocks[start])
            region_part = host[first : first + length]
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
        self, save: bool, blocks: np.ndarray[Any, Any], rows: torch.Tensor, keep: list[object]
    ) -> None:
        assert self._runtime is not None
        starts, lengths = runs_of(blocks)
        bs = self.block_size_bytes
        host = (self._host_ptr + blocks[starts] * bs).astype(np.uint64)
        dev = (rows.data_ptr() + starts * bs).astype(np.uint64)
        sizes = (lengths * bs).astype(np.uint64)
        dsts, srcs = (host, dev) if save else (dev, host)
        keep.extend((dsts, srcs, sizes))
        stream = torch.cuda.current_stream(self.device).cuda_stream
        self._runtime.memcpy_batch(dsts, srcs, sizes, save, self.device.index or 0, stream)
