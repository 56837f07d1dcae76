"""The encoder-cache row-copy kernel: compiled at run time by `cuda.core` (its `Program`,
NVRTC as cuda-python finds it), launched with `cuLaunchKernel` through `cuda.bindings`
(the `gpu` extra; GPU only).

`RowKernels.load(device)` compiles the kernels once per process for the device's
architecture and binds them to the device's primary context (or returns why it cannot:
no cuda-python, no NVRTC, a failed load); `RowLaunch` holds one engine's kernel argument
block, built once and rewritten in place before each launch, and launches one kernel
over `count` rows, each row copied whole in 16-, 8-, 4-, 2- or 1-byte words between an
encoder row and the region's device mapping. Used by `ec_copy.CudaCopyEngine` (method
`row_kernel`).

The launch goes through `cuLaunchKernel` with that prepared argument block rather than
`cuda.core.launch`: on the H200 both cost the same host time per launch (5.5-6.9 µs,
`bench/probes/ec_host_calls.py`), and the prepared block takes torch's raw stream handles
and a grid that changes from launch to launch without wrapping each lane's stream in a
cuda.core `Stream` or building a `LaunchConfig` per launch.
"""

from __future__ import annotations

from typing import ClassVar, Final

import numpy as np
import torch

from kvhandoff.adapters.cuda.kernels import BoundKernels, compile_cubin

__all__ = ["RowKernels", "RowLaunch"]


_ROW_KERNEL_SOURCE = r"""
typedef long long i64;
typedef unsigned long long u64;

// Copies `words` words of type W from s to d; each thread keeps UNROLL loads in flight
// before it stores (the region side is PCIe: many outstanding requests hide its latency).
template <typename W, int UNROLL>
__device__ __forceinline__ void move_row(const W* __restrict__ s, W* __restrict__ d,
                                         unsigned int words) {
  for (unsigned int base = threadIdx.x; base < words; base += blockDim.x * UNROLL) {
    W v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const unsigned int w = base + u * blockDim.x;
      if (w < words) v[u] = s[w];
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const unsigned int w = base + u * blockDim.x;
      if (w < words) d[w] = v[u];
    }
  }
}

template <typename W>
__device__ __forceinline__ void move(u64 region, i64 id, u64 row, unsigned int words, int save) {
  W* in_region = reinterpret_cast<W*>(region + static_cast<u64>(id) * words * sizeof(W));
  W* in_rows = reinterpret_cast<W*>(row);
  if (save) {
    move_row<W, 4>(in_rows, in_region, words);
  } else {
    move_row<W, 4>(in_region, in_rows, words);
  }
}

// One block per row: row r of the launch is region row ids[r] <-> the row at rows[r].
// ids and rows are read through the device mapping of a pinned host buffer (plain loads:
// `__ldcv` here cost a third of the bandwidth on the H200).
template <typename W>
__device__ __forceinline__ void copy_rows(const i64* ids, const u64* rows, u64 region,
                                          unsigned int words, int save) {
  const unsigned int r = blockIdx.x;
  move<W>(region, ids[r], rows[r], words, save);
}

#define KVH_KERNELS(W, NAME)                                                             \
  extern "C" __global__ void kvh_rows##NAME(const i64* ids, const u64* rows, u64 region, \
                                            unsigned int words, int save) {             \
    copy_rows<W>(ids, rows, region, words, save);                                        \
  }

KVH_KERNELS(uint4, 16)
KVH_KERNELS(u64, 8)
KVH_KERNELS(unsigned int, 4)
KVH_KERNELS(unsigned short, 2)
KVH_KERNELS(unsigned char, 1)
"""
_ROW_WORDS: Final[tuple[int, ...]] = (16, 8, 4, 2, 1)
_NAMES: Final[tuple[str, ...]] = tuple(f"kvh_rows{word}" for word in _ROW_WORDS)


def _compile_row_kernels(arch: tuple[int, int]) -> object:
    """The row-copy kernels as `cuda.core` object code (a cubin) for `sm_<arch>`, compiled
    by NVRTC (no GPU needed); raises where cuda.core or NVRTC is missing or fails."""
    return compile_cubin(_ROW_KERNEL_SOURCE, arch, "row kernel")


class RowKernels:
    """The row-copy kernels loaded into one device's primary context (one per process)."""

    _loaded: ClassVar[dict[int, RowKernels | str]] = {}
    _images: ClassVar[dict[tuple[int, int], object]] = {}  # cuda.core ObjectCode per arch

    def __init__(self, bound: BoundKernels) -> None:
        self.bound = bound
        self.context = bound.context
        self.functions = bound.functions

    @classmethod
    def load(cls, device_index: int) -> RowKernels | str:
        """The kernels on this device (compiled and loaded once), or why there are none."""
        known = cls._loaded.get(device_index)
        if known is not None:
            return known
        result: RowKernels | str
        try:
            result = cls._load(device_index)
        except Exception as exc:  # cuda.core / NVRTC errors have no common base
            result = f"row kernels unavailable: {exc}"
        cls._loaded[device_index] = result
        return result

    @classmethod
    def _load(cls, device_index: int) -> RowKernels | str:
        arch = torch.cuda.get_device_capability(device_index)
        code = cls._images.get(arch)
        if code is None:
            code = cls._images[arch] = _compile_row_kernels(arch)
        bound = BoundKernels.bind(code, device_index, _NAMES)
        return bound if isinstance(bound, str) else cls(bound)

    def launch(self, name: str, blocks: int, threads: int, stream: int, params: int) -> None:
        """One `cuLaunchKernel` of `name` on `stream` with the argument block at `params`."""
        self.bound.launch(name, (blocks, 1), threads, stream, params)


class RowLaunch:
    """One engine's kernel arguments: five 8-byte slots (ids, rows, region, words, save)
    and the array of their addresses that `cuLaunchKernel` reads, both built once. The
    32-bit arguments read the low half of their slot (x86-64 and ARM64 are little-endian).
    """

    def __init__(self, kernels: RowKernels, region_ptr: int, block_size: int) -> None:
        self.kernels = kernels
        self.block_size = block_size
        self._values = np.zeros(5, dtype=np.uint64)
        self._values[2] = region_ptr
        base = int(self._values.ctypes.data)
        self._pointers = np.arange(5, dtype=np.uint64) * 8 + np.uint64(base)
        self.params = int(self._pointers.ctypes.data)

    def __call__(self, save: bool, ids: int, rows: int, count: int, word: int, stream: int) -> None:
        """Copy `count` rows: region row `ids[r]` <-> the row at address `rows[r]` (both
        device addresses of int64 arrays), in words of `word` bytes; one block per row."""
        words = self.block_size // word
        values = self._values
        values[0], values[1], values[3], values[4] = ids, rows, words, int(save)
        threads = min(256, max(32, ((words + 3) // 4 + 31) // 32 * 32))
        self.kernels.launch(f"kvh_rows{word}", count, threads, stream, self.params)
