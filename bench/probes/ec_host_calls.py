"""`python -m kvhandoff.bench.probes.ec_host_calls`: the host cost of the encoder-cache
copy engine's CUDA calls through cuda-python (issue 18, item 4), bytes verified.

- Row-kernel launch (compiled by `cuda.core`, `row_kernel.RowKernels`), two ways:
  `prepared` as the engine does (`row_kernel.RowLaunch`: one `cuLaunchKernel` through
  `cuda.bindings` with an argument block built once and rewritten in place) and
  `cuda_core` (`cuda.core.launch(stream, LaunchConfig, kernel, *args)`). Each copies
  `--rows` rows of 8 KiB from device rows into a device region.
- `runtime.CudaRuntime` (cuda.bindings): one 8 KiB `memcpy` from pinned memory to the
  device, and one `wait_for` (event record + stream wait). With `--old-runtime PATH` (an
  earlier `adapters/cuda/runtime.py`, e.g. the ctypes one) the same calls through it.

Host µs per call: median of `--reps` timed loops of `--calls` calls, the device drained
between loops. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from typing import Any

import numpy as np
import torch

from kvhandoff.adapters.cuda import bindings
from kvhandoff.adapters.cuda.row_kernel import RowKernels, RowLaunch
from kvhandoff.adapters.cuda.runtime import CudaRuntime

BS = 8192
_cuda: Any = torch.cuda  # its Stream carries no type annotations


class _ForeignStream:
    """A torch stream handle as cuda.core's `__cuda_stream__` protocol."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _time(fn: Any, calls: int, reps: int) -> float:
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) * 1e6 / calls)
    torch.cuda.synchronize()
    return round(statistics.median(samples), 2)


def _launches(out: dict[str, Any], n: int, calls: int, reps: int, handle: int) -> None:
    kernels = RowKernels.load(0)
    if isinstance(kernels, str):
        out["launch_error"] = kernels
        return
    region = torch.zeros((2 * n, BS), dtype=torch.uint8, device="cuda")
    src = torch.randint(0, 256, (n, BS), dtype=torch.uint8, device="cuda")
    ids = torch.randperm(2 * n, device="cuda")[:n].to(torch.int64)
    rows = torch.arange(n, dtype=torch.int64, device="cuda") * BS + src.data_ptr()
    launch = RowLaunch(kernels, region.data_ptr(), BS)

    def prepared() -> None:
        launch(True, ids.data_ptr(), rows.data_ptr(), n, 16, handle)

    out["launch_prepared_us"] = _time(prepared, calls, reps)
    out["launch_prepared_verified"] = bool(torch.equal(region[ids], src))
    core = bindings.core()
    try:
        assert core is not None
        code: Any = RowKernels._images[torch.cuda.get_device_capability(0)]
        kernel = code.get_kernel("kvh_rows16")
        device = core.Device(0)
        device.set_current()
        core_stream = device.create_stream(_ForeignStream(handle))
        config = core.LaunchConfig(grid=n, block=128)
        args = (
            np.uint64(ids.data_ptr()),
            np.uint64(rows.data_ptr()),
            np.uint64(region.data_ptr()),
            np.uint32(BS // 16),
            np.int32(1),
        )
        region.zero_()
        out["launch_cuda_core_us"] = _time(
            lambda: core.launch(core_stream, config, kernel, *args), calls, reps
        )
        out["launch_cuda_core_verified"] = bool(torch.equal(region[ids], src))
    except Exception as exc:  # a cuda.core version whose launch API differs
        out["launch_cuda_core_error"] = f"{type(exc).__name__}: {exc}"


def _runtime_calls(rt: Any, prefix: str, out: dict[str, Any], calls: int, reps: int) -> None:
    host = torch.arange(BS, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(BS, dtype=torch.uint8, device="cuda")
    stream = _cuda.Stream()
    other = torch.cuda.current_stream()
    handle, other_handle = int(stream.cuda_stream), int(other.cuda_stream)
    event = rt.new_event()
    hp, dp = host.data_ptr(), dev.data_ptr()
    out[f"{prefix}_memcpy_8KiB_us"] = _time(lambda: rt.memcpy(dp, hp, BS, handle), calls, reps)
    out[f"{prefix}_memcpy_verified"] = bool(torch.equal(dev.cpu(), host))
    out[f"{prefix}_wait_for_us"] = _time(
        lambda: rt.wait_for(handle, other_handle, event), calls, reps
    )
    rt.destroy_event(event)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--old-runtime", default="", help="an earlier runtime.py to compare")
    args = parser.parse_args()
    out: dict[str, Any] = {"rows": args.rows, "row_bytes": BS, "calls": args.calls}
    handle = int(torch.cuda.current_stream().cuda_stream)
    _launches(out, args.rows, args.calls, args.reps, handle)
    rt = CudaRuntime.load()
    if isinstance(rt, str):
        out["runtime_error"] = rt
    else:
        _runtime_calls(rt, "cuda_bindings", out, args.calls, args.reps)
    if args.old_runtime:
        spec = importlib.util.spec_from_file_location("old_runtime", args.old_runtime)
        assert spec is not None and spec.loader is not None
        old: Any = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        old_rt = old.CudaRuntime.find()
        if old_rt is None:
            out["old_runtime_error"] = "libcudart not found"
        else:
            _runtime_calls(old_rt, "old", out, args.calls, args.reps)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
