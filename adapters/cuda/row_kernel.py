"""The encoder-cache row-copy kernel: compiled at run time with NVRTC, launched through the
CUDA driver API (GPU only).

`RowKernels.load(device)` compiles the kernels once per process for the device's
architecture (or returns why it cannot: no NVRTC, no driver API); `RowLaunch` holds one
engine's reusable ctypes arguments and launches one kernel over `count` rows, each row
copied whole in 16-, 8-, 4-, 2- or 1-byte words between an encoder row and the region's
device mapping. Used by `ec_copy_cuda.CudaCopyEngine` (method `row_kernel`).
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import os
import sys
from typing import Any, ClassVar, Final

import torch

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


def _find_nvrtc() -> ctypes.CDLL | None:
    """libnvrtc: by soname, then where CUDA wheels (`nvidia/*/lib`), torch or a toolkit put
    it, the CUDA major version torch was built with first."""
    major = (torch.version.cuda or "").split(".")[0]
    names = [f"libnvrtc.so.{major}"] if major else []
    names += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    roots = [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]
    found: list[str] = []
    for root in roots:
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so*")))
    found += sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libnvrtc*")))
    found += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))
    found = [f for f in found if "builtins" not in f and ".alt." not in f]
    found.sort(key=lambda f: f"libnvrtc.so.{major}" not in f)
    for name in [*names, *found]:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        # NVRTC opens its builtins library by soname when it compiles: load the one beside
        # it first (wheels set no search path for it).
        for builtins in sorted(
            glob.glob(os.path.join(os.path.dirname(name), "libnvrtc-builtins.so.*"))
        ):
            if ".alt." not in builtins:
                with contextlib.suppress(OSError):
                    ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        return lib
    return None


def _compile_row_kernels(arch: tuple[int, int]) -> tuple[bytes, str]:
    """The row-copy kernels as a cubin for `sm_<arch>` (NVRTC; no GPU needed), or
    `(b"", reason)`."""
    nvrtc = _find_nvrtc()
    if nvrtc is None:
        return b"", "libnvrtc not found"
    prog = ctypes.c_void_p()
    err = nvrtc.nvrtcCreateProgram(
        ctypes.byref(prog), _ROW_KERNEL_SOURCE.encode(), b"kvh_rows.cu", 0, None, None
    )
    if err != 0:
        return b"", f"nvrtcCreateProgram failed ({err})"
    try:
        opts = [f"--gpu-architecture=sm_{arch[0]}{arch[1]}".encode(), b"-std=c++17"]
        options = (ctypes.c_char_p * len(opts))(*opts)
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), options)
        if err != 0:
            size = ctypes.c_size_t(0)
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            text = ctypes.create_string_buffer(size.value + 1)
            nvrtc.nvrtcGetProgramLog(prog, text)
            return b"", f"nvrtc compile failed ({err}): {text.value.decode(errors='replace')[:500]}"
        size = ctypes.c_size_t(0)
        if nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0 or size.value == 0:
            return b"", "nvrtc produced no cubin"
        image = ctypes.create_string_buffer(size.value)
        if nvrtc.nvrtcGetCUBIN(prog, image) != 0:
            return b"", "nvrtcGetCUBIN failed"
        return image.raw, ""
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


class RowKernels:
    """The row-copy kernels loaded into one device's primary context (one per process)."""

    _loaded: ClassVar[dict[int, RowKernels | str]] = {}
    _images: ClassVar[dict[tuple[int, int], tuple[bytes, str]]] = {}

    def __init__(self, lib: ctypes.CDLL, context: int, functions: dict[str, int]) -> None:
        self.lib = lib
        self.context = context
        self.functions = functions
        self._launch: Any = lib.cuLaunchKernel
        self._launch.restype = ctypes.c_int
        u = ctypes.c_uint
        self._launch.argtypes = (
            ctypes.c_void_p,
            *(u,) * 7,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
        )
        self._current: Any = lib.cuCtxGetCurrent
        self._current.argtypes = (ctypes.POINTER(ctypes.c_void_p),)
        self._set_current: Any = lib.cuCtxSetCurrent
        self._set_current.argtypes = (ctypes.c_void_p,)

    @classmethod
    def load(cls, device_index: int) -> RowKernels | str:
        """The kernels on this device (compiled and loaded once), or why there are none."""
        known = cls._loaded.get(device_index)
        if known is not None:
            return known
        result: RowKernels | str
        try:
            result = cls._load(device_index)
        except (OSError, AttributeError, RuntimeError, ValueError) as exc:
            result = f"row kernels unavailable: {exc}"
        cls._loaded[device_index] = result
        return result

    @classmethod
    def _load(cls, device_index: int) -> RowKernels | str:
        arch = torch.cuda.get_device_capability(device_index)
        if arch not in cls._images:
            cls._images[arch] = _compile_row_kernels(arch)
        image, reason = cls._images[arch]
        if not image:
            return reason
        lib = ctypes.CDLL("libcuda.so.1")
        with torch.cuda.device(device_index):
            torch.cuda.current_stream().synchronize()  # the primary context is current
            context = ctypes.c_void_p(0)
            if lib.cuCtxGetCurrent(ctypes.byref(context)) != 0 or not context.value:
                return "no current CUDA context for the driver API"
            module = ctypes.c_void_p(0)
            err = lib.cuModuleLoadData(ctypes.byref(module), image)
            if err != 0:
                return f"cuModuleLoadData failed ({err})"
            functions: dict[str, int] = {}
            for name in (f"kvh_rows{word}" for word in _ROW_WORDS):
                fn = ctypes.c_void_p(0)
                err = lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode())
                if err != 0 or not fn.value:
                    return f"cuModuleGetFunction({name}) failed ({err})"
                functions[name] = fn.value
        return cls(lib, context.value, functions)

    def launch(self, name: str, blocks: int, threads: int, stream: int, params: int) -> None:
        current = ctypes.c_void_p(0)
        self._current(ctypes.byref(current))
        if current.value != self.context:  # a thread that has not used this device yet
            self._set_current(self.context)
        fn = self.functions[name]
        err = int(self._launch(fn, blocks, 1, 1, threads, 1, 1, 0, stream, params, None))
        if err != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")


class RowLaunch:
    """One engine's kernel arguments (ctypes values reused from launch to launch)."""

    def __init__(self, kernels: RowKernels, region_ptr: int, block_size: int) -> None:
        self.kernels = kernels
        self.block_size = block_size
        self.ids = ctypes.c_uint64(0)
        self.rows = ctypes.c_uint64(0)
        self.region = ctypes.c_uint64(region_ptr)
        self.words = ctypes.c_uint32(0)
        self.save = ctypes.c_int32(0)
        values = (self.ids, self.rows, self.region, self.words, self.save)
        self._params = (ctypes.c_void_p * len(values))(*(ctypes.addressof(v) for v in values))
        self.params = ctypes.addressof(self._params)

    def __call__(self, save: bool, ids: int, rows: int, count: int, word: int, stream: int) -> None:
        """Copy `count` rows: region row `ids[r]` <-> the row at address `rows[r]` (both
        device addresses of int64 arrays), in words of `word` bytes; one block per row."""
        words = self.block_size // word
        self.ids.value, self.rows.value = ids, rows
        self.words.value, self.save.value = words, int(save)
        threads = min(256, max(32, ((words + 3) // 4 + 31) // 32 * 32))
        self.kernels.launch(f"kvh_rows{word}", count, threads, stream, self.params)
