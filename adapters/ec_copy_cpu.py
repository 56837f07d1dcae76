"""The CPU copy engine of the encoder-cache tier (R-E05): batched token-row copies between
encoder outputs held in CPU tensors and the `/dev/shm` region. The demo and CI use it.

`CpuCopyEngine` implements `ec_copy_engine.CopyEngine` over a `[num_blocks,
block_size_bytes]` uint8 view of the flat region tensor:

- a save gathers every item's token rows (each encoder output viewed as raw bytes,
  `[num_tokens, block_size_bytes]`) into one tensor and writes them with one
  `index_copy_` into the region rows named by the items' blocks;
- a load reads every item's blocks with one `index_select` and copies each item's slice
  into its encoder-cache tensor (one copy per encoding, never one per block).

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

import torch

from kvhandoff.machines.ec_meta import CopyDirection, CopyItem
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
        self._rows: torch.Tensor | None = region[: self.num_blocks * block_size_bytes].view(
            self.num_blocks, block_size_bytes
        )
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
        except (LocalProtocolError, KeyError, IndexError, RuntimeError, ValueError) as exc:
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

    def _index(self, items: tuple[CopyItem, ...]) -> torch.Tensor:
        ids = [block for item in items for block in item.blocks[: item.num_tokens]]
        index = torch.tensor(ids, dtype=torch.long)
        if ids and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise LocalProtocolError(f"a block id lies outside the region of {self.num_blocks}")
        return index

    def _save(self, items: tuple[CopyItem, ...], cache: Mapping[str, torch.Tensor]) -> None:
        if not items:
            return
        region = self._region_rows()
        sources = [self._rows_of(item, cache[item.mm_hash]) for item in items]
        index = self._index(items)
        data = sources[0] if len(sources) == 1 else torch.cat(sources)
        region.index_copy_(0, index, data)

    def _load(self, items: tuple[CopyItem, ...], cache: Mapping[str, torch.Tensor]) -> None:
        if not items:
            return
        region = self._region_rows()
        targets = [self._rows_of(item, cache[item.mm_hash]) for item in items]
        gathered = region.index_select(0, self._index(items))
        start = 0
        for target in targets:
            stop = start + target.shape[0]
            target.copy_(gathered[start:stop])
            start = stop
