"""The measurement of `kvhandoff bench ec` (see `bench/ec.py`): the region, encoder cache
and block layouts of one run (`Setup`), one timed and one verified batch (`Run`), and the
interleaved framework / baseline measurement of an engine (`measure`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvhandoff.adapters.ec_copy_engine import CopyDirection, CopyEngine
from kvhandoff.adapters.shm.region import SharedRegion
from kvhandoff.bench.ec_config import ECBenchConfig, Layout, Progress
from kvhandoff.machines.ec.meta import CopyItem

__all__ = ["Run", "Setup", "measure"]

_cuda: Any = torch.cuda  # its Stream and Event carry no type annotations


class Setup:
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


class Run:
    def __init__(self, setup: Setup) -> None:
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


def measure(
    run: Run,
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
