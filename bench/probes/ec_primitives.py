"""The costs of the encoder-cache copy primitives without the engine (GPU only), for
`ec_overhead` (sections 3 to 5 of its report):

- `host_costs`: the host µs (median) of the pieces of a submit (stream switch, events,
  pinned allocation, id conversion, uploads, torch kernel launches);
- `device_costs`: CUDA-event µs of the copy primitives on `n` scattered rows (one DMA;
  torch index kernels with the ids on the device or read from mapped pinned memory; one
  launch per 512-row encoding);
- `cpu_costs`: GB/s of the CPU row scatter / gather primitives on 64 MiB.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvhandoff.adapters.cuda.runtime import CudaRuntime, DeviceArray

__all__ = ["cpu_costs", "device_costs", "host_costs"]

_cuda: Any = torch.cuda


def _us(fn: Callable[[], object], reps: int = 300, sync: bool = False) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        if sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return round(statistics.median(times) * 1e6, 2)


def _dev_us(fn: Callable[[], object], reps: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = _cuda.Event(enable_timing=True), _cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) * 1e3)
    return round(statistics.median(times), 1)


def host_costs(region: torch.Tensor, bs: int) -> dict[str, float]:
    out: dict[str, float] = {}
    stream = _cuda.Stream()
    caller = torch.cuda.current_stream()
    ev = _cuda.Event()
    out["current_stream"] = _us(lambda: torch.cuda.current_stream())
    out["current_device"] = _us(lambda: torch.cuda.current_device())

    def set_restore() -> None:
        torch.cuda.set_stream(stream)
        torch.cuda.set_stream(caller)

    out["set_stream_and_back"] = _us(set_restore)

    def ctx() -> None:
        with torch.cuda.device(0), torch.cuda.stream(stream):
            pass

    out["device_and_stream_ctx"] = _us(ctx)
    out["event_new_record"] = _us(lambda: _cuda.Event().record(stream))
    out["event_record"] = _us(lambda: ev.record(stream))
    out["event_query"] = _us(lambda: ev.query())

    def wait() -> None:
        ev.record(caller)
        stream.wait_event(ev)

    out["record_and_wait_event"] = _us(wait)
    out["wait_stream"] = _us(lambda: stream.wait_stream(caller))
    out["pinned_empty_1024"] = _us(lambda: torch.empty(1024, dtype=torch.int64, pin_memory=True))
    host = torch.empty(1024, dtype=torch.int64, pin_memory=True)
    dev = torch.empty(1024, dtype=torch.int64, device="cuda")
    out["to_device_nonblocking_1024"] = _us(lambda: host.to("cuda", non_blocking=True))
    out["copy_nonblocking_1024"] = _us(lambda: dev.copy_(host, non_blocking=True))
    rt = CudaRuntime.load()
    if not isinstance(rt, str):
        handle = stream.cuda_stream
        hp, dp = host.data_ptr(), dev.data_ptr()
        out["raw_memcpy_8KiB"] = _us(lambda: rt.memcpy(dp, hp, 8192, handle))
    gen = np.random.default_rng(0)
    blocks = tuple(int(b) for b in gen.permutation(region.numel() // bs)[:512])
    ids = host.numpy()

    def fill() -> None:
        ids[0:512] = blocks
        ids[512:1024] = blocks

    out["ids_fill_2x512"] = _us(fill)
    out["ids_fromiter_512"] = _us(lambda: np.fromiter(blocks, np.int64, 512))
    out["ids_max_check_1024"] = _us(lambda: int(ids.view(np.uint64).max()))
    out["ids_diff_breaks_1024"] = _us(lambda: np.flatnonzero(np.diff(ids) != 1))
    mapped = torch.as_tensor(DeviceArray(region.data_ptr(), region.numel()), device="cuda")
    rows = mapped[: (region.numel() // bs) * bs].view(-1, bs).view(torch.complex128)
    src = torch.empty((512, bs), dtype=torch.uint8, device="cuda").view(torch.complex128)
    index = dev[:512].copy_(torch.from_numpy(ids[:512].copy()))
    out["index_copy_launch_512"] = _us(lambda: rows.index_copy_(0, index, src), 100, sync=True)
    out["index_select_launch_512"] = _us(
        lambda: torch.index_select(rows, 0, index, out=src), 100, sync=True
    )
    out["view_dtype"] = _us(lambda: src.view(torch.complex128))
    return out


def device_costs(region: torch.Tensor, bs: int, n: int) -> dict[str, float]:
    """CUDA-event µs of the primitives on `n` scattered rows (region already registered)."""
    blocks = region.numel() // bs
    host_rows = region[: blocks * bs].view(blocks, bs)
    mapped = torch.as_tensor(DeviceArray(region.data_ptr(), blocks * bs), device="cuda")
    rows = mapped.view(blocks, bs).view(torch.complex128)
    dev = torch.randint(0, 256, (n, bs), dtype=torch.uint8, device="cuda")
    dev_w = dev.view(torch.complex128)
    perm = torch.randperm(blocks)[:n]
    index = perm.cuda()
    pinned_ids = perm.clone().pin_memory()
    index_mapped = torch.as_tensor(DeviceArray(pinned_ids.data_ptr(), n * 8), device="cuda").view(
        torch.int64
    )
    flat = host_rows[:n].view(-1)
    out: dict[str, float] = {}
    out["dma_save"] = _dev_us(lambda: flat.copy_(dev.view(-1), non_blocking=True))
    out["dma_load"] = _dev_us(lambda: dev.view(-1).copy_(flat, non_blocking=True))

    def gather(idx: torch.Tensor) -> None:
        torch.index_select(rows, 0, idx, out=dev_w)

    def scatter(idx: torch.Tensor) -> None:
        rows.index_copy_(0, idx, dev_w)

    out["index_save"] = _dev_us(lambda: scatter(index))
    out["index_load"] = _dev_us(lambda: gather(index))
    out["index_mapped_ids_save"] = _dev_us(lambda: scatter(index_mapped))
    out["index_mapped_ids_load"] = _dev_us(lambda: gather(index_mapped))

    def per_item(save: bool) -> None:
        for i in range(0, n, 512):
            part, idx = dev_w[i : i + 512], index[i : i + 512]
            if save:
                rows.index_copy_(0, idx, part)
            else:
                torch.index_select(rows, 0, idx, out=part)

    out["index_per512_save"] = _dev_us(lambda: per_item(True))
    out["index_per512_load"] = _dev_us(lambda: per_item(False))
    staging = torch.empty_like(dev_w)
    out["stage_d2d_8MiB_equiv"] = _dev_us(lambda: staging.copy_(dev_w))
    return out


def cpu_costs() -> dict[str, float]:
    bs, n = 8192, 8192
    region = torch.zeros(2 * n * bs, dtype=torch.uint8).view(2 * n, bs)
    data = torch.randint(0, 256, (n, bs), dtype=torch.uint8)
    ids = np.random.default_rng(1).permutation(2 * n)[:n].astype(np.int64)
    idx = torch.from_numpy(ids)
    r64, d64 = region.view(torch.int64), data.view(torch.int64)
    rn, dn = region.numpy(), data.numpy()

    def gbps(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return round(n * bs / statistics.median(times) / 1e9, 2)

    return {
        "threads": torch.get_num_threads(),
        "memcpy": gbps(lambda: region[:n].copy_(data)),
        "save_index_copy_u8": gbps(lambda: region.index_copy_(0, idx, data)),
        "save_index_copy_i64": gbps(lambda: r64.index_copy_(0, idx, d64)),
        "save_numpy_assign": gbps(lambda: rn.__setitem__(ids, dn)),
        "load_index_select_u8": gbps(lambda: torch.index_select(region, 0, idx, out=data)),
        "load_index_select_i64": gbps(lambda: torch.index_select(r64, 0, idx, out=d64)),
    }
