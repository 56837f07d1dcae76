"""`kvhandoff bench ec`: the encoder-cache copy engine against one large pinned copy.

One process, one real `/dev/shm` region (`SharedRegion`, twice as many blocks as are
copied), one encoder cache of `blocks / tokens_per_item` encodings of
`[tokens_per_item, block_size_bytes / 2]` bf16 rows (one token row per block). Measured
in the same run and interleaved rep by rep:

- framework: the copy engine saves every encoding into its blocks (`submit(.., "save",
  ..)`) and then loads them back (`"load"`), each batch timed from just before `submit`
  to the `poll()` that reports it, as the worker sees it. On `cuda` the engine is
  `CudaCopyEngine` (host-registered region, pooled streams, end events); on `cpu` it is
  `ec_copy_cpu.CpuCopyEngine` where that module exists, else the batched path of `ec_cpu`.
- baseline: one copy of the same number of bytes between one contiguous buffer and the
  region (device <-> host-registered region on `cuda`: a pinned copy; a memcpy on `cpu`),
  timed the same way (to an end event seen by polling on `cuda`).
- per_block: the same batches copied one block per copy call, the approach a batch must
  beat.

The headline uses scattered blocks (a random subset of the region, as after churn);
`contiguous` repeats the measurement with each encoding in consecutive blocks. Bytes are
verified after every measured save and load: the region is cleared before a save and
compared with the sources, the encodings are poisoned before a load and compared with a
fresh pattern written into the region. Results are medians of the timed reps.

The parts live beside this module: `ec_config` (the configuration), `ec_cpu` (the CPU
copy paths) and `ec_measure` (the set-up, timed batches and the measurement); this one
runs the bench, summarises it and is `python -m kvhandoff.bench.ec`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import secrets
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

import torch

from kvhandoff.adapters.ec_copy_engine import CopyEngine
from kvhandoff.adapters.shm.region import SharedRegion
from kvhandoff.bench.ec_config import ECBenchConfig, Progress, config_for
from kvhandoff.bench.ec_cpu import BatchedCpuCopy, cpu_engine
from kvhandoff.bench.ec_measure import Run, Setup, measure

__all__ = ["BatchedCpuCopy", "ECBenchConfig", "config_for", "main", "print_summary", "run_ec_bench"]

# Earlier names of the measurement parts, still importable from here.
_Setup = Setup
_Run = Run
_measure = measure


def _cuda_engine(setup: Setup, method: str) -> tuple[CopyEngine, str]:
    from kvhandoff.adapters.cuda.ec_copy import METHODS, CudaCopyEngine

    if method not in METHODS:
        raise SystemExit(f"unknown CUDA copy method {method!r}; one of {', '.join(METHODS)}")
    engine = CudaCopyEngine(setup.region_tensor, setup.bs, method=method)
    return engine, f"CudaCopyEngine({method})"


def run_ec_bench(config: ECBenchConfig, progress: Progress = lambda _: None) -> dict[str, Any]:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench ec --device cuda: CUDA is not available here")
    if config.blocks < 1 or config.tokens_per_item < 1:
        raise SystemExit("bench ec: --blocks and tokens per item must be positive")
    name = f"kvhandoff_ec_bench_{os.getpid()}_{secrets.token_hex(4)}.mmap"
    region = SharedRegion.create(name, 2 * config.blocks * config.block_size_bytes)
    try:
        return _run(config, region, progress)
    finally:
        region.unlink()
        gc.collect()
        with contextlib.suppress(Exception):  # a view still alive: the exit unmaps it
            region.close()


def _run(config: ECBenchConfig, region: SharedRegion, progress: Progress) -> dict[str, Any]:
    setup = Setup(config, region)
    run = Run(setup)
    device_name = torch.cuda.get_device_name() if config.device == "cuda" else "cpu"
    progress(
        f"bench ec on {device_name}: {config.blocks} blocks of {config.block_size_bytes} B "
        f"({setup.nbytes / 2**20:.0f} MiB) in {len(setup.names)} encodings"
    )

    def engine_for(method: str) -> tuple[CopyEngine, str]:
        if config.device == "cuda":
            return _cuda_engine(setup, method)
        if method == "per_block":
            return BatchedCpuCopy(setup.region_tensor, setup.bs, per_block=True), "per_block"
        if method == "batched":
            return BatchedCpuCopy(setup.region_tensor, setup.bs), BatchedCpuCopy.name
        return cpu_engine(setup.region_tensor, setup.bs)

    engine, engine_name = engine_for(config.method)
    try:
        main = measure(
            run,
            engine,
            ("scattered", "contiguous"),
            config.reps,
            config.warmup,
            progress,
            engine_name,
        )
    finally:
        engine.close()
    engine, _ = engine_for("per_block")
    try:
        per_block = measure(
            run, engine, ("scattered",), config.per_block_reps, 1, progress, "per_block"
        )["scattered"]
    finally:
        engine.close()
    methods: dict[str, Any] = {}
    for method in config.sweep:
        try:
            engine, label = engine_for(method)
        except Exception as exc:  # a method this machine cannot run: say why, keep going
            methods[method] = {"error": str(exc)}
            progress(f"{method}: unavailable ({exc})")
            continue
        try:
            reps = config.per_block_reps if method == "per_block" else config.reps
            methods[method] = measure(
                run, engine, ("scattered", "contiguous"), reps, config.warmup, progress, label
            )
        except Exception as exc:
            methods[method] = {"error": f"{type(exc).__name__}: {exc}"}
            progress(f"{method}: failed ({exc})")
        finally:
            engine.close()

    scattered = main["scattered"]
    verified = all(
        all(part["verified"].values()) for part in (scattered, main["contiguous"], per_block)
    )
    result: dict[str, Any] = {}
    for direction in ("save", "load"):
        part = scattered[direction]
        result[direction] = {key: part[key] for key in ("framework_gbps", "baseline_gbps", "ratio")}
        result[direction]["device"] = device_name
    result["submit_ms"] = {d: scattered[d]["submit_ms"] for d in ("save", "load")}
    result["per_block"] = {
        direction: {
            "gbps": per_block[direction]["framework_gbps"],
            "baseline_gbps": per_block[direction]["baseline_gbps"],
            "ratio": per_block[direction]["ratio"],
            "framework_speedup": round(
                scattered[direction]["framework_gbps"] / per_block[direction]["framework_gbps"], 2
            ),
        }
        for direction in ("save", "load")
    }
    result["contiguous"] = {d: main["contiguous"][d] for d in ("save", "load")}
    result["verified"] = verified
    result["engine"] = engine_name
    result["layout"] = "scattered"
    result["bytes"] = setup.nbytes
    result["encodings"] = len(setup.names)
    result["config"] = asdict(config)
    if methods:
        result["methods"] = methods
    return result


def print_summary(result: Mapping[str, Any]) -> None:
    print(
        f"ec on {result['save']['device']}: {result['config']['blocks']} blocks of "
        f"{result['config']['block_size_bytes']} B ({result['bytes'] / 2**20:.0f} MiB), "
        f"{result['engine']}, scattered blocks"
    )
    for direction in ("save", "load"):
        part, pb = result[direction], result["per_block"][direction]
        print(
            f"{direction}: framework {part['framework_gbps']} GB/s, pinned copy "
            f"{part['baseline_gbps']} GB/s, ratio {part['ratio']}; per-block "
            f"{pb['gbps']} GB/s (framework x{pb['framework_speedup']}); contiguous ratio "
            f"{result['contiguous'][direction]['ratio']}"
        )
    print("bytes verified" if result["verified"] else "bytes NOT verified")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kvhandoff.bench.ec`: the same bench with the CUDA method knobs exposed."""
    parser = argparse.ArgumentParser(prog="python -m kvhandoff.bench.ec")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--blocks", type=int, default=None)
    parser.add_argument("--tokens-per-item", type=int, default=None)
    parser.add_argument("--method", default="auto")
    parser.add_argument("--sweep", default=None, help="comma-separated copy paths to add")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    config = config_for(args.device, args.quick, args.blocks)
    if args.sweep is not None:
        config = replace(config, sweep=tuple(filter(None, args.sweep.split(","))))
    config = replace(config, method=args.method)
    if args.tokens_per_item:
        config = replace(config, tokens_per_item=args.tokens_per_item)
    if args.reps:
        config = replace(config, reps=args.reps)
    result = run_ec_bench(config, lambda m: print(m, file=sys.stderr, flush=True))
    if not args.json:
        print_summary(result)
    print(json.dumps(result) if args.json else "")
    return 0 if result["verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
