"""The gather-scatter kernel of the CUDA IPC push path, compiled at run time by
`cuda.core` (NVRTC) and launched with a prepared `cuLaunchKernel` through `cuda.bindings`
(issue 18; the `gpu` extra, GPU only).

One launch copies every (block, region) pair of the requests it carries from P's KV into
D's IPC-mapped KV: grid `(blocks, regions)`, one CUDA block of 256 threads per pair, each
thread moving eight 16-byte words with all eight loads in flight before its stores.
Addresses are computed on the device from two tables of region base addresses (P's and
D's, uploaded once per opened peer) and the launch's int32 block ids (P's, then D's).

`GatherLaunches` keeps, per opened D rank, the stream the copies run on, the argument
block of the kernel (built once, rewritten in place before each launch) and a pool of
launch slots: a pinned host buffer for the ids, the device buffer they are copied into
(one `cudaMemcpyAsync` on the copy stream, so the kernel reads device memory) and the
event recorded after the kernel. A launch takes a free slot (or makes one) and the caller
gives it back (`retire`) once the slot's event fired and its requests were completed; so
a slot is never rewritten under a copy in flight.

The host cost of a launch is a few calls into the CUDA runtime and driver (ids copy,
stream wait, `cuLaunchKernel`, event record): about what Triton's launcher spends in
Python alone, so a writer can launch a few requests at a time while it matches the rest.
Where cuda.core, NVRTC or the driver API is missing, `GatherKernel.load` says why and the
caller keeps the Triton kernel (`ipc_kernel.py`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, ClassVar, Final

import numpy as np
import torch

from kvhandoff.adapters.cuda.bindings import CudaError
from kvhandoff.adapters.cuda.kernels import BoundKernels, compile_cubin
from kvhandoff.adapters.cuda.runtime import CudaRuntime

__all__ = ["GatherKernel", "GatherLaunches", "LaunchSlot"]

THREADS: Final = 256
UNROLL: Final = 8
WORD: Final = 16

_SOURCE = r"""
typedef unsigned long long u64;

// One block per (request block b, region r): P's block ids[b] of region r into D's
// block ids[n + b] of region r; `words` 16-byte words per block.
extern "C" __global__ void kvh_gather_scatter(const int* __restrict__ ids, unsigned int n,
                                              const u64* __restrict__ src_regions,
                                              const u64* __restrict__ dst_regions,
                                              unsigned int words) {
  const unsigned int b = blockIdx.x;
  const unsigned int r = blockIdx.y;
  const u64 s = static_cast<u64>(ids[b]);
  const u64 d = static_cast<u64>(ids[n + b]);
  const uint4* __restrict__ src =
      reinterpret_cast<const uint4*>(src_regions[r] + s * words * 16ull);
  uint4* __restrict__ dst = reinterpret_cast<uint4*>(dst_regions[r] + d * words * 16ull);
  for (unsigned int base = threadIdx.x; base < words; base += blockDim.x * UNROLL) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const unsigned int w = base + u * blockDim.x;
      if (w < words) v[u] = src[w];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const unsigned int w = base + u * blockDim.x;
      if (w < words) dst[w] = v[u];
    }
  }
}
""".replace("UNROLL", str(UNROLL))

_NAME: Final = "kvh_gather_scatter"


class GatherKernel:
    """The kernel loaded into one device's primary context (compiled once per process
    and architecture)."""

    _loaded: ClassVar[dict[int, GatherKernel | str]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, bound: BoundKernels, device: int) -> None:
        self.bound = bound
        self.device = device

    @classmethod
    def load(cls, device: int) -> GatherKernel | str:
        """The kernel on `device`, or why there is none (no cuda.core, NVRTC, driver)."""
        with cls._lock:
            known = cls._loaded.get(device)
            if known is None:
                try:
                    arch = torch.cuda.get_device_capability(device)
                    code = compile_cubin(_SOURCE, arch, "gather kernel")
                    bound = BoundKernels.bind(code, device, (_NAME,))
                    known = bound if isinstance(bound, str) else cls(bound, device)
                except Exception as exc:  # cuda.core / NVRTC errors have no common base
                    known = f"the cuda.core gather kernel is unavailable: {exc}"
                cls._loaded[device] = known
            return known

    def launch(self, blocks: int, regions: int, stream: int, params: int) -> None:
        """One `cuLaunchKernel` over `(blocks, regions)` on `stream`."""
        self.bound.launch(_NAME, (blocks, regions), THREADS, stream, params)


class LaunchSlot:
    """One launch's buffers and end event; `query()` / `synchronize()` as an event."""

    __slots__ = ("_gl", "capacity", "device", "device_ptr", "event", "host", "host_np", "host_ptr")

    def __init__(self, launches: GatherLaunches, capacity: int) -> None:
        self._gl = launches
        self.capacity = capacity  # block ids per side
        self.host = torch.empty(2 * capacity, dtype=torch.int32, pin_memory=True)
        self.host_np: np.ndarray[Any, Any] = self.host.numpy()
        self.host_ptr = self.host.data_ptr()
        self.device = torch.empty(2 * capacity, dtype=torch.int32, device=launches.device)
        self.device_ptr = self.device.data_ptr()
        self.event = launches.runtime.new_event()
        if not self.event:
            raise CudaError("cudaEventCreateWithFlags failed")

    def query(self) -> bool:
        """Whether the launch ended (a failed launch raises `CudaError`)."""
        return self._gl.query(self.event)

    def synchronize(self) -> None:
        self._gl.synchronize(self.event)


class GatherLaunches:
    """One opened D rank's launches (see the module docstring). P's writer thread alone
    launches, waits for and gives back slots (`ipc_launches.py`): no lock."""

    def __init__(
        self,
        kernel: GatherKernel,
        runtime: CudaRuntime,
        src_regions: list[int],
        dst_regions: list[int],
        block_len: int,
    ) -> None:
        if block_len % WORD:
            raise CudaError(f"block length {block_len} is not a multiple of {WORD} bytes")
        self.kernel = kernel
        self.runtime = runtime
        rt = runtime.rt
        self.device = torch.device("cuda", kernel.device)
        self.regions = len(src_regions)
        self._tables = torch.tensor(
            [src_regions, dst_regions], dtype=torch.int64, device=self.device
        )
        self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        self.stream = int(self._stream.cuda_stream)
        self._wait_event = runtime.new_event()
        if not self._wait_event:
            raise CudaError("cudaEventCreateWithFlags failed")
        self._values = np.zeros(5, dtype=np.uint64)
        self._values[2] = self._tables[0].data_ptr()
        self._values[3] = self._tables[1].data_ptr()
        self._values[4] = block_len // WORD
        base = int(self._values.ctypes.data)
        self._pointers = np.arange(5, dtype=np.uint64) * 8 + np.uint64(base)
        self._params = int(self._pointers.ctypes.data)
        self._free: list[LaunchSlot] = []
        self._slots: list[LaunchSlot] = []
        self._threads: set[int] = set()
        self._record: Any = rt.cudaEventRecord
        self._query: Any = rt.cudaEventQuery
        self._sync: Any = rt.cudaEventSynchronize
        self._set_device: Any = rt.cudaSetDevice
        self._success: object = rt.cudaError_t.cudaSuccess
        self._not_ready: object = rt.cudaError_t.cudaErrorNotReady

    def launch(self, local_ids: list[int], remote_ids: list[int]) -> LaunchSlot:
        """Copy P's blocks `local_ids` into D's `remote_ids` in every region, on the copy
        stream after the work enqueued so far on the device's default stream (where the
        engine wrote P's KV); returns the slot whose event ends the copy."""
        n = len(local_ids)
        thread = threading.get_ident()
        if thread not in self._threads:  # the runtime's current device is per thread
            self._set_device(self.kernel.device)
            self._threads.add(thread)
        slot = self._take(n)
        host = slot.host_np
        host[:n] = local_ids
        host[n : 2 * n] = remote_ids
        runtime = self.runtime
        stream = self.stream
        runtime.memcpy(slot.device_ptr, slot.host_ptr, 8 * n, stream)
        runtime.wait_for(stream, 0, self._wait_event)
        values = self._values
        values[0] = slot.device_ptr
        values[1] = n
        self.kernel.launch(n, self.regions, stream, self._params)
        err = self._record(slot.event, stream)[0]
        if err != self._success:
            raise CudaError(f"cudaEventRecord failed with CUDA error {err!r}")
        return slot

    def _take(self, n: int) -> LaunchSlot:
        while self._free:
            slot = self._free.pop()
            if slot.capacity >= n:
                return slot
            self._slots.remove(slot)  # too small for this launch: replaced
            self.runtime.destroy_event(slot.event)
        slot = LaunchSlot(self, max(n, 1024))
        self._slots.append(slot)
        return slot

    def retire(self, slot: object) -> None:
        """The slot's launch ended and its requests were completed: reusable (anything
        that is not one of this pool's slots is ignored)."""
        if isinstance(slot, LaunchSlot) and slot in self._slots and slot not in self._free:
            self._free.append(slot)

    def query(self, event: int) -> bool:
        err = self._query(event)[0]
        if err == self._success:
            return True
        if err == self._not_ready:
            return False
        self.runtime.clear_error()
        raise CudaError(f"cudaEventQuery failed with CUDA error {err!r}")

    def synchronize(self, event: int) -> None:
        err = self._sync(event)[0]
        if err != self._success:
            self.runtime.clear_error()
            raise CudaError(f"cudaEventSynchronize failed with CUDA error {err!r}")

    def close(self) -> None:
        """Wait for every launch, then free the events (buffers go with the slots)."""
        for slot in self._slots:
            with contextlib.suppress(CudaError):
                self.synchronize(slot.event)
            self.runtime.destroy_event(slot.event)
        self._slots.clear()
        self._free.clear()
        self.runtime.destroy_event(self._wait_event)
