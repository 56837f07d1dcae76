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

An engine spec is `new:<method>[:upload][:first=<rows>]` (`adapters/cuda/ec_copy.py`;
`upload`: ids uploaded instead of read through the pinned buffer's mapping) or
`old:<method>` (the `CudaCopyEngine` of the file given with `--old`, e.g. an earlier
commit's `git show <commit>:adapters/cuda/ec_copy.py`, a single file up to
the split of that engine into modules; skipped without `--old`).

Sections 3 to 5 are `ec_primitives`.

`python3 -m kvhandoff.bench.probes.ec_overhead --out probe.json [--old old.py]
[--skip host,device,cpu]`
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
from dataclasses import replace
from typing import Any, cast

import torch

from kvhandoff.adapters.cuda.ec_copy import CopyMethod, CudaCopyEngine
from kvhandoff.adapters.shm.region import SharedRegion
from kvhandoff.bench.ec_config import config_for
from kvhandoff.bench.ec_measure import Run, Setup, measure
from kvhandoff.bench.probes.ec_primitives import cpu_costs, device_costs, host_costs

_cuda: Any = torch.cuda


def _clock() -> int:
    try:
        return int(torch.cuda.clock_rate())
    except Exception:
        return -1


def _spin(seconds: float) -> None:
    """Keep the GPU busy (clocks up) for `seconds`."""
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            a = a @ a
            a = a / a.abs().amax().clamp(min=1)
        torch.cuda.synchronize()


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
        setup = Setup(config, region)
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
            setup = Setup(config, region)
            run = Run(setup)
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
                        res = measure(
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
