"""The CPU copy paths of `kvhandoff bench ec` (see `bench/ec.py`): a batched CPU copy
(used when `ec_copy_cpu` is not there, and as the `batched` sweep path), the same one
block per copy call (the `per_block` path), and the choice of the CPU engine.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvhandoff.adapters.ec_copy_engine import CopyDirection, CopyEngine
from kvhandoff.machines.ec.meta import CopyItem

__all__ = ["BatchedCpuCopy", "cpu_engine"]


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


def cpu_engine(region: torch.Tensor, block_size: int) -> tuple[CopyEngine, str]:
    """`ec_copy_cpu.CpuCopyEngine` where it exists, else the batched path above."""
    try:
        module: Any = importlib.import_module("kvhandoff.adapters.ec_copy_cpu")
        engine: CopyEngine = module.CpuCopyEngine(region, block_size)
    except (ImportError, AttributeError, TypeError):
        return BatchedCpuCopy(region, block_size), BatchedCpuCopy.name
    return engine, "CpuCopyEngine"
