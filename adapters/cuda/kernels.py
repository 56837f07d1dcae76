"""Kernels compiled at run time by `cuda.core` (its `Program`, NVRTC as cuda-python finds
it) and launched with `cuLaunchKernel` through `cuda.bindings` over an argument block the
caller prepared (the `gpu` extra; GPU only). Shared by the encoder-cache row kernel
(`row_kernel.py`) and the CUDA IPC gather-scatter kernel (`ipc_gather.py`).

- `compile_cubin(source, arch, what)`: the source as object code for `sm_<arch>` (no GPU
  needed); raises `CudaError` where cuda.core is missing, whatever NVRTC raises on failure.
- `BoundKernels.bind(code, device, names)`: those functions of the object code in the
  device's primary context (or why not); `launch` makes that context current in a thread
  that has not used it yet, then launches one grid.
"""

from __future__ import annotations

from typing import Any

import torch

from kvhandoff.adapters.cuda import bindings
from kvhandoff.adapters.cuda.bindings import CudaError

__all__ = ["BoundKernels", "compile_cubin", "kernel_function"]


def compile_cubin(source: str, arch: tuple[int, int], what: str) -> object:
    """`source` (C++) as `cuda.core` object code (a cubin) for `sm_<arch>`."""
    core = bindings.core()
    if core is None:
        raise CudaError(f"the {what} {bindings.MISSING} (cuda.core)")
    options = core.ProgramOptions(arch=f"sm_{arch[0]}{arch[1]}", std="c++17")
    return core.Program(source, code_type="c++", options=options).compile("cubin")


def kernel_function(drv: Any, code: Any, name: str) -> object:
    """`name` of the object code as a CUfunction of the current (primary) context."""
    kernel = code.get_kernel(name)
    handle = getattr(kernel, "handle", None)
    if handle is None:
        handle = kernel._handle  # cuda.core before 0.2
    address = bindings.as_int(handle)
    if "CUfunction" in type(handle).__name__:  # loaded as a module (old drivers)
        return drv.CUfunction(address)
    (function,) = bindings.call(drv, "cuKernelGetFunction", drv.CUkernel(address))
    return function


class BoundKernels:
    """Functions of one object code in one device's primary context."""

    def __init__(self, drv: Any, context: Any, functions: dict[str, object]) -> None:
        self.context = context
        self.context_id = bindings.as_int(context)
        self.functions = functions
        self._success: object = drv.CUresult.CUDA_SUCCESS
        self._launch: Any = drv.cuLaunchKernel
        self._current: Any = drv.cuCtxGetCurrent
        self._set_current: Any = drv.cuCtxSetCurrent

    @classmethod
    def bind(cls, code: object, device: int, names: tuple[str, ...]) -> BoundKernels | str:
        """`names` of `code` in `device`'s primary context, or why they cannot be."""
        drv = bindings.driver()
        with torch.cuda.device(device):
            torch.cuda.current_stream().synchronize()  # the primary context is current
            (context,) = bindings.call(drv, "cuCtxGetCurrent")
            if not bindings.as_int(context):
                return "no current CUDA context for the driver API"
            functions = {name: kernel_function(drv, code, name) for name in names}
        return cls(drv, context, functions)

    def launch(
        self, name: str, grid: tuple[int, int], threads: int, stream: int, params: int
    ) -> None:
        """One `cuLaunchKernel` of `name` over `grid` (x, y) on `stream`, with the argument
        block at `params` (an array of pointers to the arguments)."""
        err, current = self._current()
        if err != self._success or int(current) != self.context_id:
            self._set_current(self.context)  # a thread that has not used this device yet
        fn = self.functions[name]
        x, y = grid
        err = self._launch(fn, x, y, 1, threads, 1, 1, 0, stream, params, 0)[0]
        if err != self._success:
            raise CudaError(f"cuLaunchKernel failed with CUDA error {err!r}")
