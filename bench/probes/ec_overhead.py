"""Where the encoder-cache CUDA engine's fixed per-batch time goes (issue 6, small batches).

`kvhandoff bench ec` times a batch from `submit` to the `poll()` that reports it; at 1,024
blocks (8 MiB, about 150 µs of PCIe copy) the fixed cost of a batch decides the ratio.
This probe, run on a GPU machine from the repository root, prints and writes as JSON:

1. timeline: for 1,024 scattered blocks, the host time (µs from just before `submit`,
   medians) at which each copy call (row-kernel launch, torch indexing kernel, DMA runs)
   starts and returns, when `submit` returns and when `poll()` reports the batch, with the
   pinned-copy baseline of the same bytes (`--timeline` engine specs);
2. e2e: the bench's own measurement (submit to poll, interleaved with the pinned-copy
   baseline, bytes verified) of the engine specs in `--engines` at each `--blocks`, with
   the SM clock read before each (`--warm-s` first keeps the GPU busy that long);
3. host: the host cost (µs, median) of the pieces of a submit (stream switch, events,
   pinned allocation, id conversion, uploads, torch kernel launches);
4. device: CUDA-event times of the copy primitives at 1,024 and 8,192 scattered rows
   (one DMA; torch index kernels with the ids on the device or read from mapped pinned
   memory; one launch per 512-row encoding);
5. cpu: the CPU row scatter / gather primitives on 64 MiB.

An engine spec is `new:<method>[:upload][:first=<rows>]` (`adapters/ec_copy_cuda.py`;
`upload`: ids uploaded instead of read through the pinned buffer's mapping) or
`old:<method>` (the `CudaCopyEngine` of the file given with `--old`, e.g. an earlier
commit's `git show <commit>:adapters/ec_copy_cuda.py`; skipped without `--old`).

`python3 bench/ec_overhead_probe.py --out probe.json [--old old.py] [--skip host,device,cpu]`
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import secrets
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, cast

import numpy as np
import torch

from kvhandoff.adapters.cuda.ec_copy import CopyMethod, CudaCopyEngine
from kvhandoff.adapters.cuda.runtime import CudaRuntime, DeviceArray
from kvhandoff.adapters.shm.region import SharedRegion
from kvhandoff.bench.ec import _measure, _Run, _Setup, config_for

_cuda: Any = torch.cuda


def _clock() -> int:
    try:
        return int(torch.cuda.clock_rate())
    except Exception:
        return -1


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


def _spin(seconds: float) -> None:
    """Keep the GPU busy (clocks up) for `seconds`."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a = a @ a
            a = a / a.abs().amax().clamp(min=1)
        torch.cuda.synchronize()


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
    rt = CudaRuntime.find()
    if rt is not None:
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


def _engine(spec: str, setup: Any, old: Any) -> Any:
    """`new:<method>[:upload][:first=<rows>]` or `old:<method>`."""
    which, method, *flags = spec.split(":")
    if which == "old":
        if old is None:
            return None
        return old.CudaCopyEngine(setup.region_tensor, setup.bs, method=method)
    first = [int(f.split("=")[1]) for f in flags if f.startswith("first=")]
    return CudaCopyEngine(
        setup.region_tensor,
        setup.bs,
        method=cast(CopyMethod, method),
        mapped_ids="upload" not in flags,
        first_rows=first[0] if first else 256,
    )


def timeline(specs: list[str], n: int, old: Any, reps: int) -> dict[str, Any]:
    """Host timeline of one batch (µs from just before `submit`, medians): each kernel
    launch's start and end, `submit`'s return, the `poll()` that reports the batch; the
    pinned-copy baseline of the same bytes alongside."""
    config = replace(config_for("cuda", blocks=n), reps=reps, warmup=3)
    name = f"kvhandoff_ec_probe_{secrets.token_hex(4)}.mmap"
    region = SharedRegion.create(name, 2 * n * config.block_size_bytes)
    out: dict[str, Any] = {}
    try:
        setup = _Setup(config, region)
        for spec in specs:
            engine = _engine(spec, setup, old)
            if engine is None:
                continue
            marks: list[float] = []
            for attr in ("_copy_kernel", "_launch_rows", "_copy_runs"):
                real = getattr(engine, attr, None)
                if real is None:
                    continue

                def wrapped(*args: Any, real: Any = real, marks: list[float] = marks) -> Any:
                    marks.append(time.perf_counter())
                    out = real(*args)
                    marks.append(time.perf_counter())
                    return out

                setattr(engine, attr, wrapped)
            print(f"{spec}: row kernel: {getattr(engine, 'row_kernel_unavailable', '?') or 'yes'}")
            try:
                for direction in ("save", "load"):
                    rows: list[list[float]] = []
                    base: list[float] = []
                    for rep in range(reps + 5):
                        setup.sync()
                        marks.clear()
                        t0 = time.perf_counter()
                        engine.submit(
                            rep + 1000 * len(out), direction, setup.items["scattered"], setup.cache
                        )
                        t1 = time.perf_counter()
                        while not engine.poll():
                            pass
                        t2 = time.perf_counter()
                        b = setup.baseline(direction)
                        if rep >= 5:
                            rows.append(
                                [(m - t0) * 1e6 for m in marks] + [(t1 - t0) * 1e6, (t2 - t0) * 1e6]
                            )
                            base.append(b * 1e6)
                    width = min(len(r) for r in rows)
                    med = [round(statistics.median(r[i] for r in rows), 1) for i in range(width)]
                    key = f"{spec} {direction}"
                    out[key] = {
                        "launch_marks_us": med[:-2],
                        "submit_us": med[-2],
                        "done_us": med[-1],
                        "baseline_us": round(statistics.median(base), 1),
                    }
                    print(f"timeline {key}: {out[key]}", flush=True)
            finally:
                engine.close()
        del setup
    finally:
        region.unlink()
        import gc

        gc.collect()
        with contextlib.suppress(Exception):
            region.close()
    return out


def e2e(
    engines: list[str], sizes: list[int], old: Any, reps: int, warm_s: float
) -> list[dict[str, Any]]:
    results = []
    for n in sizes:
        config = replace(config_for("cuda", blocks=n), reps=reps, warmup=3)
        name = f"kvhandoff_ec_probe_{secrets.token_hex(4)}.mmap"
        region = SharedRegion.create(name, 2 * n * config.block_size_bytes)
        try:
            setup = _Setup(config, region)
            run = _Run(setup)
            for spec in engines:
                for warm in (0.0, warm_s) if spec == engines[0] and warm_s else (0.0,):
                    if warm:
                        _spin(warm)
                    clock = _clock()
                    engine = _engine(spec, setup, old)
                    if engine is None:
                        continue
                    try:
                        label = f"{spec}@{n}" + (f" after {warm}s spin" if warm else "")
                        res = _measure(
                            run,
                            engine,
                            ("scattered", "contiguous"),
                            reps,
                            3,
                            lambda m: print(m, flush=True),
                            label,
                        )
                    finally:
                        engine.close()
                    results.append(
                        {"engine": spec, "blocks": n, "spin_s": warm, "sm_mhz": clock, **res}
                    )
                    print(f"   sm clock before: {clock} MHz, after: {_clock()} MHz", flush=True)
            del setup, run
        finally:
            region.unlink()
            import gc

            gc.collect()
            with contextlib.suppress(Exception):
                region.close()
    return results


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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="ec_probe.json")
    parser.add_argument("--old", default=None, help="path of an earlier ec_copy_cuda.py")
    parser.add_argument("--engines", default="new:auto,new:kernel,old:auto")
    parser.add_argument(
        "--timeline",
        default="new:row_kernel,new:kernel,old:kernel",
    )
    parser.add_argument("--blocks", default="1024,8192")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warm-s", type=float, default=0.0)
    parser.add_argument("--skip", default="")
    args = parser.parse_args()
    old: Any = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_ec_copy_cuda", args.old)
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_ec_copy_cuda"] = old
        spec.loader.exec_module(old)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "sm_mhz_start": _clock()}
    skip = set(args.skip.split(","))
    engines = [e for e in args.engines.split(",") if e]
    sizes = [int(b) for b in args.blocks.split(",") if b]

    def save() -> None:
        with open(args.out, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=1)

    if "timeline" not in skip:
        result["timeline"] = timeline(
            [e for e in args.timeline.split(",") if e], 1024, old, args.reps
        )
        save()
    if "e2e" not in skip:
        result["e2e"] = e2e(engines, sizes, old, args.reps, args.warm_s)
        save()
    bs = 8192
    region = torch.zeros(2 * 8192 * bs, dtype=torch.uint8)
    cudart = _cuda.cudart()
    assert cudart.cudaHostRegister(region.data_ptr(), region.numel(), 3) == 0
    try:
        if "host" not in skip:
            result["host_us"] = host_costs(region, bs)
            print("host µs:", json.dumps(result["host_us"]), flush=True)
            save()
        if "device" not in skip:
            for n in (1024, 8192):
                result[f"device_us_{n}"] = device_costs(region, bs, n)
                print(f"device µs @{n}:", json.dumps(result[f"device_us_{n}"]), flush=True)
            save()
    finally:
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(region.data_ptr())
    if "cpu" not in skip:
        result["cpu_gbps"] = cpu_costs()
        print("cpu GB/s:", json.dumps(result["cpu_gbps"]), flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
