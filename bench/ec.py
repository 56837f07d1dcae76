"""`kvhandoff bench ec`: the encoder-cache copy engine against one large pinned copy.

One process, one real `/dev/shm` region (`SharedRegion`, twice as many blocks as are
copied), one encoder cache of `blocks / tokens_per_item` encodings of
`[tokens_per_item, block_size_bytes / 2]` bf16 rows (one token row per block). Measured
in the same run and interleaved rep by rep:

- framework: the copy engine saves every encoding into its blocks (`submit(.., "save",
  ..)`) and then loads them back (`"load"`), each batch timed from just before `submit`
  to the `poll()` that reports it, as the worker sees it. On `cuda` the engine is
  `CudaCopyEngine` (host-registered region, pooled streams, end events); on `cpu` it is
  `ec_copy_cpu.CpuCopyEngine` where that module exists, else a batched CPU path here.
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
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import itertools
import json
import os
import secrets
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np
import torch

from kvhandoff.adapters.ec_copy_engine import CopyDirection, CopyEngine
from kvhandoff.adapters.shm.region import SharedRegion
from kvhandoff.machines.ec.meta import CopyItem

Device = Literal["cpu", "cuda"]
Layout = Literal["scattered", "contiguous"]
Progress = Callable[[str], None]

_cuda: Any = torch.cuda  # its Stream and Event carry no type annotations

__all__ = ["ECBenchConfig", "config_for", "main", "run_ec_bench"]


@dataclass(frozen=True, slots=True)
class ECBenchConfig:
    device: Device = "cpu"
    blocks: int = 8192
    block_size_bytes: int = 8192
    tokens_per_item: int = 512
    reps: int = 15
    warmup: int = 3
    per_block_reps: int = 3
    method: str = "auto"
    """CUDA copy method of the framework measurement (`ec_copy_cuda.METHODS`)."""
    sweep: tuple[str, ...] = ()
    """More copy paths to measure on both layouts, each against its own baseline: CUDA
    methods on `cuda`; `batched` (`BatchedCpuCopy`) or `per_block` on `cpu`."""
    seed: int = 1


def config_for(device: Device, quick: bool = False, blocks: int | None = None) -> ECBenchConfig:
    sweep = ("row_kernel", "kernel", "runs") if device == "cuda" else ("batched",)
    config = ECBenchConfig(device=device, sweep=sweep)
    if quick:
        config = replace(config, blocks=1024, reps=3, warmup=1, per_block_reps=1)
    if blocks is not None:
        config = replace(config, blocks=blocks, tokens_per_item=min(config.tokens_per_item, blocks))
    return config


# -- a batched CPU copy path (used when ec_copy_cpu is not there) and a per-block one --------


def _token_rows(tensor: torch.Tensor, item: CopyItem, block_size: int) -> torch.Tensor:
    n = item.num_tokens
    rows = tensor[:n]
    if n > len(item.blocks) or rows.numel() * rows.element_size() != n * block_size:
        raise ValueError(f"{item.mm_hash}: rows do not match {n} blocks of {block_size} bytes")
    return rows.reshape(n, -1).view(torch.uint8).view(n, block_size)


def _widest(block_size: int, *tensors: torch.Tensor) -> torch.dtype:
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if block_size % size == 0 and all(t.data_ptr() % size == 0 for t in tensors):
            return dtype
    return torch.uint8


class BatchedCpuCopy:
    """CPU copies, one indexing operation (or one slice copy per long run) per encoding."""

    name = "BatchedCpuCopy"

    def __init__(self, region: torch.Tensor, block_size_bytes: int, per_block: bool = False):
        self.block_size_bytes = block_size_bytes
        self.num_blocks = region.numel() // block_size_bytes
        self._rows = region[: self.num_blocks * block_size_bytes].view(self.num_blocks, -1)
        self._per_block = per_block
        self._done: list[tuple[int, bool]] = []

    def submit(
        self,
        batch_id: int,
        direction: CopyDirection,
        items: Sequence[CopyItem],
        encoder_cache: Mapping[str, torch.Tensor],
    ) -> None:
        try:
            for item in items:
                rows = _token_rows(encoder_cache[item.mm_hash], item, self.block_size_bytes)
                blocks = item.blocks[: item.num_tokens]
                if self._per_block:
                    self._copy_per_block(direction, blocks, rows)
                else:
                    self._copy(direction, np.asarray(blocks, dtype=np.int64), rows)
        except (KeyError, ValueError, IndexError, RuntimeError):
            self._done.append((batch_id, False))
            return
        self._done.append((batch_id, True))

    def _copy_per_block(
        self, direction: CopyDirection, blocks: Sequence[int], rows: torch.Tensor
    ) -> None:
        for token, block in enumerate(blocks):
            if direction == "save":
                self._rows[block].copy_(rows[token])
            else:
                rows[token].copy_(self._rows[block])

    def _copy(self, direction: CopyDirection, blocks: np.ndarray[Any, Any], rows: Any) -> None:
        breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
        if (breaks.size + 1) * 64 <= blocks.size:  # long runs: one slice copy per run
            bounds = [0, *breaks.tolist(), blocks.size]
            for start, end in itertools.pairwise(bounds):
                first = int(blocks[start])
                part = self._rows[first : first + end - start]
                if direction == "save":
                    part.copy_(rows[start:end])
                else:
                    rows[start:end].copy_(part)
            return
        word = _widest(self.block_size_bytes, rows, self._rows)
        region = self._rows.view(word)
        words = rows.view(word)
        if direction == "save":  # numpy's row scatter is a memcpy per row
            region.numpy()[blocks] = words.numpy()
        else:
            torch.index_select(region, 0, torch.from_numpy(blocks), out=words)

    def poll(self) -> list[tuple[int, bool]]:
        done, self._done = self._done, []
        return done

    def close(self) -> None:
        self._done.clear()


def _cpu_engine(region: torch.Tensor, block_size: int) -> tuple[CopyEngine, str]:
    """`ec_copy_cpu.CpuCopyEngine` where it exists, else the batched path above."""
    try:
        module: Any = importlib.import_module("kvhandoff.adapters.ec_copy_cpu")
        engine: CopyEngine = module.CpuCopyEngine(region, block_size)
    except (ImportError, AttributeError, TypeError):
        return BatchedCpuCopy(region, block_size), BatchedCpuCopy.name
    return engine, "CpuCopyEngine"


# -- the run -------------------------------------------------------------------------------


class _Setup:
    """The region, the encoder cache and the block layouts of one run."""

    def __init__(self, config: ECBenchConfig, region: SharedRegion) -> None:
        self.config = config
        self.bs = config.block_size_bytes
        self.n = config.blocks
        self.nbytes = self.n * self.bs
        self.device = torch.device("cuda" if config.device == "cuda" else "cpu")
        self.region_tensor = region.as_tensor()
        self.region_blocks = self.region_tensor.numel() // self.bs
        self.host_rows = self.region_tensor[: self.region_blocks * self.bs].view(-1, self.bs)
        gen = np.random.default_rng(config.seed)
        sizes = [config.tokens_per_item] * (self.n // config.tokens_per_item)
        if self.n % config.tokens_per_item:
            sizes.append(self.n % config.tokens_per_item)
        self.names = [f"mm-{i:04d}" for i in range(len(sizes))]
        scattered = gen.permutation(self.region_blocks)[: self.n]
        contiguous = np.arange(self.n)
        self.items: dict[Layout, tuple[CopyItem, ...]] = {
            "scattered": self._items(scattered, sizes),
            "contiguous": self._items(contiguous, sizes),
        }
        self.order: dict[Layout, torch.Tensor] = {
            "scattered": torch.from_numpy(scattered.astype(np.int64)),
            "contiguous": torch.from_numpy(contiguous.astype(np.int64)),
        }
        hidden = self.bs // 2
        self.cache: dict[str, torch.Tensor] = {
            name: torch.empty((size, hidden), dtype=torch.bfloat16, device=self.device)
            for name, size in zip(self.names, sizes, strict=True)
        }
        self.flat = torch.empty(self.nbytes, dtype=torch.uint8, device=self.device)
        self._fill_random()
        self.flat.copy_(self._gen_bytes(self.nbytes).to(self.device))
        self._stream = _cuda.Stream() if self.device.type == "cuda" else None

    def _items(self, blocks: np.ndarray[Any, Any], sizes: list[int]) -> tuple[CopyItem, ...]:
        items, start = [], 0
        for name, size in zip(self.names, sizes, strict=True):
            part = tuple(int(b) for b in blocks[start : start + size])
            items.append(CopyItem(name, part, size))
            start += size
        return tuple(items)

    @staticmethod
    def _gen_bytes(count: int) -> torch.Tensor:
        return torch.randint(0, 256, (count,), dtype=torch.uint8)

    def _fill_random(self) -> torch.Tensor:
        """Fresh random bytes in every encoding; returns them (CPU, `[n, bs]`, item order)."""
        data = self._gen_bytes(self.nbytes).view(self.n, self.bs)
        start = 0
        for name in self.names:
            tensor = self.cache[name]
            rows = tensor.shape[0]
            tensor.view(torch.uint8).view(rows, self.bs).copy_(data[start : start + rows])
            start += rows
        return data

    def cache_bytes(self) -> torch.Tensor:
        parts = [t.view(torch.uint8).view(t.shape[0], self.bs) for t in self.cache.values()]
        return torch.cat(parts).cpu()

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def baseline(self, direction: CopyDirection) -> float:
        """Seconds for one copy of all the bytes between `flat` and the region."""
        region = self.region_tensor[: self.nbytes]
        self.sync()
        start = time.perf_counter()
        if self._stream is None:
            (region.copy_(self.flat) if direction == "save" else self.flat.copy_(region))
            return time.perf_counter() - start
        with torch.cuda.stream(self._stream):
            if direction == "save":
                region.copy_(self.flat, non_blocking=True)
            else:
                self.flat.copy_(region, non_blocking=True)
            event = _cuda.Event()
            event.record(self._stream)
        while not event.query():
            pass
        return time.perf_counter() - start


class _Run:
    def __init__(self, setup: _Setup) -> None:
        self.setup = setup
        self._ids = 0
        self.submit_seconds = 0.0

    def timed(self, engine: CopyEngine, direction: CopyDirection, layout: Layout) -> float:
        """Seconds from `submit` to the `poll()` that reports the batch."""
        self.setup.sync()
        self._ids += 1
        batch_id = self._ids
        start = time.perf_counter()
        engine.submit(batch_id, direction, self.setup.items[layout], self.setup.cache)
        self.submit_seconds = time.perf_counter() - start
        while True:
            done = engine.poll()
            if done:
                break
        elapsed = time.perf_counter() - start
        if done != [(batch_id, True)]:
            raise RuntimeError(f"copy batch {batch_id} ({direction}) reported {done}")
        return elapsed

    def verify(self, engine: CopyEngine, layout: Layout) -> dict[str, bool]:
        """Save then load one batch each, with the bytes checked after each."""
        s = self.setup
        order = s.order[layout]
        s.sync()
        s.host_rows.index_fill_(0, order, 0)
        expected = s._fill_random()
        self.timed(engine, "save", layout)
        saved = bool(torch.equal(s.host_rows.index_select(0, order), expected))
        pattern = s._gen_bytes(s.nbytes).view(s.n, s.bs)
        s.host_rows.index_copy_(0, order, pattern)
        for tensor in s.cache.values():
            tensor.view(torch.uint8).fill_(0xA5)
        self.timed(engine, "load", layout)
        loaded = bool(torch.equal(s.cache_bytes(), pattern))
        return {"save": saved, "load": loaded}


def _gbps(nbytes: int, seconds: Sequence[float]) -> float:
    return round(nbytes / statistics.median(seconds) / 1e9, 3)


def _measure(
    run: _Run,
    engine: CopyEngine,
    layouts: Sequence[Layout],
    reps: int,
    warmup: int,
    progress: Progress,
    label: str,
) -> dict[str, Any]:
    """Framework and baseline, interleaved, for each layout and direction."""
    setup = run.setup
    out: dict[str, Any] = {}
    for layout in layouts:
        verified = run.verify(engine, layout)
        samples: dict[str, list[float]] = {
            key: [] for key in ("save", "load", "base_save", "base_load", "sub_save", "sub_load")
        }
        for rep in range(warmup + reps):
            for direction in ("save", "load"):
                framework = run.timed(engine, direction, layout)
                submit = run.submit_seconds
                baseline = setup.baseline(direction)
                if rep >= warmup:
                    samples[direction].append(framework)
                    samples[f"base_{direction}"].append(baseline)
                    samples[f"sub_{direction}"].append(submit)
        per_layout: dict[str, Any] = {"verified": verified}
        for direction in ("save", "load"):
            fw = _gbps(setup.nbytes, samples[direction])
            base = _gbps(setup.nbytes, samples[f"base_{direction}"])
            per_layout[direction] = {
                "framework_gbps": fw,
                "baseline_gbps": base,
                "ratio": round(fw / base, 3),
                "submit_ms": round(statistics.median(samples[f"sub_{direction}"]) * 1e3, 3),
            }
        out[layout] = per_layout
        progress(
            f"{label} [{layout}]: save {per_layout['save']['framework_gbps']} GB/s "
            f"(ratio {per_layout['save']['ratio']}), load {per_layout['load']['framework_gbps']} "
            f"GB/s (ratio {per_layout['load']['ratio']}), verified {verified}"
        )
    return out


def _cuda_engine(setup: _Setup, method: str) -> tuple[CopyEngine, str]:
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
    setup = _Setup(config, region)
    run = _Run(setup)
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
        return _cpu_engine(setup.region_tensor, setup.bs)

    engine, engine_name = engine_for(config.method)
    try:
        main = _measure(
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
        per_block = _measure(
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
            methods[method] = _measure(
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
