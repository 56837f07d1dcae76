"""The CPU copy engine of the encoder-cache tier (R-E05): batched token-row copies between
encoder outputs held in CPU tensors and the `/dev/shm` region. The demo and CI use it.

`CpuCopyEngine` implements `ec_copy_engine.CopyEngine` over a `[num_blocks,
block_size_bytes]` uint8 view of the flat region tensor:

- a save writes each item's token rows (its encoder output viewed as raw bytes,
  `[num_tokens, block_size_bytes]`) into the region rows named by its blocks with one
  `index_copy_`;
- a load reads each item's blocks straight into its encoder-cache tensor with one
  `index_select(..., out=)` (no staging tensor, no per-block call);
- both view the rows as 8-byte words where the row size and the addresses allow (torch's
  CPU indexing kernels move one element at a time, so wider elements are fewer steps);
- an item whose blocks form long runs of consecutive ids (on average at least
  `run_min_blocks`) is copied with one slice copy per run instead (a plain memcpy).

Every item of a batch is checked (tensor, shape, block ids) before any byte is written,
so a failed batch writes nothing.

The copy runs on the caller's thread inside `submit`; its end event is reported by the
next `poll()` as `(batch_id, ok)`. An optional `release(batch_id, direction, items)`
predicate holds a batch's end event back until it returns True (a slow save, for demos
and fault tests); the bytes are already in place by then, as with an asynchronous copy
whose end event has not fired yet. Errors in a batch (a missing or misshaped tensor, a
block outside the region) never raise: the batch is reported `(batch_id, False)`.

Part of the local tier: imports torch, never nixl, zmq or msgspec (R-E02).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvhandoff.machines.ec.meta import CopyDirection, CopyItem
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["CpuCopyEngine", "ReleasePredicate", "as_rows"]

log = logging.getLogger("kvhandoff.ec.copy_cpu")

ReleasePredicate = Callable[[int, CopyDirection, tuple[CopyItem, ...]], bool]
"""`release(batch_id, direction, items)`: may this batch's end event be reported now?"""


def as_rows(tensor: torch.Tensor, block_size_bytes: int) -> torch.Tensor:
    """`tensor`'s bytes as `[rows, block_size_bytes]` uint8, sharing its memory.

    The tensor must be a contiguous CPU tensor whose size is a whole number of rows.
    """
    if tensor.device.type != "cpu":
        raise LocalProtocolError(f"encoder output on {tensor.device}, expected a CPU tensor")
    if not tensor.is_contiguous():
        raise LocalProtocolError("encoder output is not contiguous")
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() % block_size_bytes:
        raise LocalProtocolError(
            f"encoder output of {flat.numel()} bytes is not whole rows of {block_size_bytes}"
        )
    return flat.view(-1, block_size_bytes)


@dataclass(slots=True)
class _Landed:
    batch_id: int
    direction: CopyDirection
    items: tuple[CopyItem, ...]
    ok: bool


class CpuCopyEngine:
    """Batched copies between CPU encoder outputs and the region, reported by `poll()`."""

    def __init__(
        self,
        region: torch.Tensor,
        block_size_bytes: int,
        *,
        release: ReleasePredicate | None = None,
        run_min_blocks: int = 64,
    ) -> None:
        if region.device.type != "cpu" or region.dtype != torch.uint8 or region.dim() != 1:
            raise LocalProtocolError("the region must be a flat CPU uint8 tensor")
        if not region.is_contiguous():
            raise LocalProtocolError("the region tensor must be contiguous")
        if block_size_bytes <= 0 or region.numel() < block_size_bytes:
            raise LocalProtocolError(
                f"a region of {region.numel()} bytes holds no block of {block_size_bytes} bytes"
            )
        self.block_size_bytes = block_size_bytes
        self.num_blocks = region.numel() // block_size_bytes
        self.release = release
        self.run_min_blocks = max(1, run_min_blocks)
        self._rows: torch.Tensor | None = region[: self.num_blocks * block_size_bytes].view(
            self.num_blocks, block_size_bytes
        )
        self._words: dict[torch.dtype, torch.Tensor] = {}
        # The device stand-in's end events not reported yet (a CUDA stream's recorded
        # events); each batch's lifecycle is its `ec.copy_batch`.
        self._pending: list[_Landed] = []
        self.failed_batches = 0

    # -- CopyEngine ----------------------------------------------------------------------

    def submit(
        self,
        batch_id: int,
        direction: CopyDirection,
        items: Sequence[CopyItem],
        encoder_cache: Mapping[str, torch.Tensor],
    ) -> None:
        """Copy the batch now; its end event is reported by a later `poll()`."""
        batch = tuple(items)
        ok = True
        try:
            if direction == "save":
                self._save(batch, encoder_cache)
            elif direction == "load":
                self._load(batch, encoder_cache)
            else:
                raise LocalProtocolError(f"unknown copy direction {direction!r}")
        except (
            LocalProtocolError,
            KeyError,
            IndexError,
            RuntimeError,
            ValueError,
            TypeError,
            OverflowError,
        ) as exc:
            ok = False
            self.failed_batches += 1
            log.warning("%s batch %s failed: %s", direction, batch_id, exc)
        self._pending.append(_Landed(batch_id, direction, batch, ok))

    def poll(self) -> list[tuple[int, bool]]:
        """`(batch_id, ok)` of every batch whose end event may be reported now."""
        if not self._pending:
            return []
        release = self.release
        done: list[tuple[int, bool]] = []
        held: list[_Landed] = []
        for landed in self._pending:
            if (
                not landed.ok
                or release is None
                or release(landed.batch_id, landed.direction, landed.items)
            ):
                done.append((landed.batch_id, landed.ok))
            else:
                held.append(landed)
        self._pending = held
        return done

    def pending(self) -> int:
        """Batches copied whose end event has not been reported yet."""
        return len(self._pending)

    def close(self) -> None:
        """Drop the region view (so the mapping can be closed). Idempotent."""
        self._rows = None
        self._words.clear()
        self._pending.clear()

    # -- the copies ----------------------------------------------------------------------

    def _region_rows(self) -> torch.Tensor:
        if self._rows is None:
            raise LocalProtocolError("the copy engine is closed")
        return self._rows

    def _rows_of(self, item: CopyItem, tensor: torch.Tensor) -> torch.Tensor:
        rows = as_rows(tensor, self.block_size_bytes)
        n = item.num_tokens
        if n <= 0 or n > len(item.blocks) or n > rows.shape[0]:
            raise LocalProtocolError(
                f"{item.mm_hash}: {n} tokens do not fit {len(item.blocks)} blocks and a "
                f"tensor of {rows.shape[0]} rows"
            )
        return rows[:n]

    def _blocks_of(self, item: CopyItem) -> np.ndarray[Any, Any]:
        n = item.num_tokens
        ids = np.asarray(item.blocks if len(item.blocks) == n else item.blocks[:n], np.int64)
        if ids.size and int(ids.view(np.uint64).max()) >= self.num_blocks:  # negatives wrap
            raise LocalProtocolError(f"a block id lies outside the region of {self.num_blocks}")
        return ids

    def _plan(
        self, items: tuple[CopyItem, ...], cache: Mapping[str, torch.Tensor]
    ) -> list[tuple[torch.Tensor, np.ndarray[Any, Any]]]:
        """Every item's rows and block ids, all checked before any byte moves."""
        return [(self._rows_of(item, cache[item.mm_hash]), self._blocks_of(item)) for item in items]

    def _runs(self, ids: np.ndarray[Any, Any]) -> list[tuple[int, int, int]] | None:
        """`(offset, first block, length)` per run when the runs are long, else None."""
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        if (breaks.size + 1) * self.run_min_blocks > ids.size:
            return None
        bounds = [0, *breaks.tolist(), int(ids.size)]
        firsts = ids[bounds[:-1]].tolist()
        return [(a, f, b - a) for a, b, f in zip(bounds[:-1], bounds[1:], firsts, strict=True)]

    def _save(self, items: tuple[CopyItem, ...], cache: Mapping[str, torch.Tensor]) -> None:
        region = self._region_rows()
        for rows, ids in self._plan(items, cache):
            runs = self._runs(ids)
            if runs is None:
                word = _word_dtype(self.block_size_bytes, rows.data_ptr(), region.data_ptr())
                _scatter_rows(self._region_words(word), ids, rows.view(word))
                continue
            for offset, first, length in runs:
                region[first : first + length].copy_(rows[offset : offset + length])

    def _load(self, items: tuple[CopyItem, ...], cache: Mapping[str, torch.Tensor]) -> None:
        region = self._region_rows()
        for rows, ids in self._plan(items, cache):
            runs = self._runs(ids)
            if runs is None:
                word = _word_dtype(self.block_size_bytes, rows.data_ptr(), region.data_ptr())
                _gather_rows(self._region_words(word), ids, rows.view(word))
                continue
            for offset, first, length in runs:
                rows[offset : offset + length].copy_(region[first : first + length])

    def _region_words(self, word: torch.dtype) -> torch.Tensor:
        view = self._words.get(word)
        if view is None:
            view = self._region_rows().view(word)
            self._words[word] = view
        return view


def _word_dtype(block_size: int, *ptrs: int) -> torch.dtype:
    """The widest word (8, 4, 2 or 1 bytes) dividing the row size and aligning each address."""
    for size, dtype in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if block_size % size == 0 and all(p % size == 0 for p in ptrs):
            return dtype
    return torch.uint8


def _scatter_rows(region: torch.Tensor, ids: np.ndarray[Any, Any], rows: torch.Tensor) -> None:
    """`region[ids[k]] = rows[k]` for every k: one `index_copy_`."""
    region.index_copy_(0, torch.from_numpy(ids), rows)


def _gather_rows(region: torch.Tensor, ids: np.ndarray[Any, Any], rows: torch.Tensor) -> None:
    """`rows[k] = region[ids[k]]` for every k: one `index_select` into `rows`."""
    torch.index_select(region, 0, torch.from_numpy(ids), out=rows)
