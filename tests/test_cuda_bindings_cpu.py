"""The CUDA adapters' cuda-python layer without a GPU (issue 18): nothing imports
cuda-python before it is used, a missing `gpu` extra is a clear reason (never an
ImportError), cuda.bindings results are checked into the caller's error type, and the
row kernel's argument block holds what `cuLaunchKernel` must read.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest

from kvhandoff.adapters.cuda import bindings
from kvhandoff.adapters.cuda.ipc_runtime import IpcError
from kvhandoff.adapters.cuda.row_kernel import RowKernels, RowLaunch
from kvhandoff.adapters.cuda.runtime import CudaError, CudaRuntime


def test_cuda_adapters_import_without_cuda_python(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import kvhandoff.adapters.cuda.ec_copy, kvhandoff.adapters.cuda.ipc_transport\n"
        "print(sorted(m for m in sys.modules if m == 'cuda' or m.startswith('cuda.')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.skipif(bindings.available(), reason="cuda-python is installed here")
def test_missing_gpu_extra_is_a_reason_not_an_import_error() -> None:
    reason = CudaRuntime.load()
    assert isinstance(reason, str) and "kvhandoff[gpu]" in reason
    with pytest.raises(IpcError, match=r"kvhandoff\[gpu\]"):
        bindings.runtime(IpcError)


class _Err:
    def __init__(self, value: int) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"<err {self.value}>"


def test_check_returns_values_and_raises_the_callers_error() -> None:
    assert bindings.check("f", (_Err(0), 7, "x")) == (7, "x")
    assert bindings.check("f", (0,)) == ()
    with pytest.raises(CudaError, match="f failed: <err 1>"):
        bindings.check("f", (_Err(1), 7))
    with pytest.raises(IpcError, match="g failed"):
        bindings.check("g", 2, IpcError)


class _Kernels:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, int, list[int]]] = []

    def launch(self, name: str, blocks: int, threads: int, stream: int, params: int) -> None:
        pointers = (ctypes.c_void_p * 5).from_address(params)
        args = [
            ctypes.c_uint64.from_address(pointers[0] or 0).value,
            ctypes.c_uint64.from_address(pointers[1] or 0).value,
            ctypes.c_uint64.from_address(pointers[2] or 0).value,
            ctypes.c_uint32.from_address(pointers[3] or 0).value,
            ctypes.c_int32.from_address(pointers[4] or 0).value,
        ]
        self.calls.append((name, blocks, threads, stream, args))


def test_row_launch_argument_block() -> None:
    kernels = _Kernels()
    launch = RowLaunch(kernels, region_ptr=0x7F0012340000, block_size=8192)  # type: ignore[arg-type]
    launch(True, ids=0x1000, rows=0x2000, count=300, word=16, stream=42)
    launch(False, ids=0x3000, rows=0x4000, count=7, word=2, stream=43)
    assert kernels.calls == [
        ("kvh_rows16", 300, 128, 42, [0x1000, 0x2000, 0x7F0012340000, 512, 1]),
        ("kvh_rows2", 7, 256, 43, [0x3000, 0x4000, 0x7F0012340000, 4096, 0]),
    ]


def test_row_kernels_without_a_gpu_give_a_reason() -> None:
    RowKernels._loaded.pop(99, None)
    reason = RowKernels.load(99)
    assert isinstance(reason, str) and reason.startswith("row kernels unavailable")
    RowKernels._loaded.pop(99, None)


def test_gather_kernel_without_a_gpu_gives_a_reason() -> None:
    """Issue 18: the IPC path's cuda.core kernel, like the row kernels, answers with why it
    cannot load (the caller then keeps the Triton kernel); nothing raises."""
    from kvhandoff.adapters.cuda.ipc_gather import GatherKernel

    GatherKernel._loaded.pop(99, None)
    reason = GatherKernel.load(99)
    assert isinstance(reason, str) and "gather kernel" in reason
    GatherKernel._loaded.pop(99, None)
