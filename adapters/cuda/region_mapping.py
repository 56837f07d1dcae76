"""The region side of the CUDA encoder-cache copy engine: host registration of the
`/dev/shm` region, its device mapping (and the views kernels index), the pinned id
buffers with their device mapping, and the row kernel bound to that mapping.

`RegionMapping` is the base of `ec_copy.CudaCopyEngine`; it declares the engine's
region attributes (set by the engine's constructor) and the set-up methods that use them.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kvhandoff.adapters.cuda.lanes import IdBuffer, Lane
from kvhandoff.adapters.cuda.row_kernel import RowKernels, RowLaunch
from kvhandoff.adapters.cuda.runtime import CudaError, CudaRuntime, DeviceArray
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["RegionMapping"]

log = logging.getLogger("kvhandoff.ec.copy_cuda")


class RegionMapping:
    """The engine's region: registered with CUDA, mapped for kernels, id buffers beside it."""

    device: torch.device
    _index: int
    block_size_bytes: int
    num_blocks: int
    mapped_ids: bool
    _region: torch.Tensor
    _nbytes: int
    _host_ptr: int
    _runtime: CudaRuntime
    _registered: bool
    _offsets: np.ndarray[Any, Any]
    _kernel_views: dict[torch.dtype, torch.Tensor]
    kernel_unavailable: str
    row_kernel_unavailable: str
    _device_rows: torch.Tensor | None
    _lanes: list[Lane]

    def _register(self) -> None:
        if self._region.is_pinned():  # already registered (e.g. by another user of it)
            return
        try:
            self._runtime.host_register(self._host_ptr, self._nbytes)
        except CudaError as exc:
            raise LocalProtocolError(f"the region could not be registered: {exc}") from exc
        self._registered = True

    def _device_pointer(self, host_ptr: int) -> int:
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

    def _new_ids(self, rows: int) -> IdBuffer:
        """A pinned id buffer for at least `rows` rows, with its device mapping."""
        capacity = max(1024, 1 << max(0, rows - 1).bit_length())
        host = torch.empty(2 * capacity, dtype=torch.int64, pin_memory=True)
        ptr = host.data_ptr()
        mapped_ptr = self._device_pointer(ptr) if self.mapped_ids else 0
        mapped = self._device_view(mapped_ptr, 8 * capacity) if mapped_ptr else None
        return IdBuffer(
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
