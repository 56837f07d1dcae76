"""The batching of the CUDA encoder-cache copy engine: a batch is cut into groups of
rows, a group's block ids are packed into the lane's pinned buffer and checked, and each
piece of the group takes its copy method (`auto` picks DMA runs or the row kernel by the
run lengths of its blocks); row-kernel pieces in a row are one launch.

`BatchCopies` is a base of `ec_copy.CudaCopyEngine`, above `ItemCopies`.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvhandoff.adapters.cuda.copy_methods import CopyMethod
from kvhandoff.adapters.cuda.item_copies import ItemCopies
from kvhandoff.adapters.cuda.lanes import Batch, IdBuffer, Lane
from kvhandoff.adapters.cuda.row_kernel import RowLaunch
from kvhandoff.machines.ec.meta import CopyItem
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["BatchCopies"]


class BatchCopies(ItemCopies):
    """One batch of items enqueued group by group on a lane's stream."""

    method: CopyMethod
    dma_min_run_blocks: int
    group_rows: int
    first_rows: int
    _packers: dict[int, struct.Struct]
    _row_launch: RowLaunch | None

    def _id_buffer(self, lane: Lane, total: int, batch: Batch) -> IdBuffer:
        """A pinned buffer for the batch's `total` block ids (and row addresses): the
        lane's own when no unfinished batch still reads it, else one for this batch."""
        if total > lane.ids.capacity:
            batch.keep.append(lane.ids)  # earlier batches on this stream may still read it
            lane.ids = self._new_ids(total)
        elif not lane.host_free():
            own = self._new_ids(total)
            batch.keep.append(own)
            return own
        lane.last = batch
        return lane.ids

    def _upload(self, lane: Lane, ids: IdBuffer, start: int, stop: int) -> None:
        """Copy ids `[start, stop)` from the pinned buffer into the lane's device buffer."""
        lane.device_ids(ids.capacity)
        self._runtime.memcpy(
            lane.dev_ptr + 8 * start, ids.ptr + 8 * start, 8 * (stop - start), lane.handle
        )

    def _copy_batch(
        self,
        lane: Lane,
        save: bool,
        items: Sequence[CopyItem],
        encoder_cache: Mapping[str, torch.Tensor],
        batch: Batch,
    ) -> None:
        """Enqueue every item's copy on the current (the lane's) stream.

        The batch goes in groups of pieces (an item, or a slice of its rows): first the
        first `first_rows` rows of the first item alone, so the device starts as early as
        possible, then groups of at least `group_rows` rows. A group's block ids are
        packed into the pinned buffer (one `struct.pack_into` per piece) and checked;
        then the group's row-kernel pieces are one launch per run of them, and every other
        piece is one torch indexing kernel or one DMA per run of blocks. The host work of
        a group overlaps the device work of the groups before it.
        """
        todo = [item for item in items if item.num_tokens > 0]
        total = 0
        for item in todo:
            if item.num_tokens > len(item.blocks):
                raise LocalProtocolError(
                    f"{item.mm_hash}: {item.num_tokens} tokens, {len(item.blocks)} blocks"
                )
            total += item.num_tokens
        if not todo:
            return
        pieces = [(item, 0, item.num_tokens) for item in todo]
        head, cut = todo[0], self.first_rows
        if cut < head.num_tokens:
            pieces[0:1] = [(head, 0, cut), (head, cut, head.num_tokens)]
        buf = self._id_buffer(lane, total, batch)
        ids, cap, bs = buf.array, buf.capacity, self.block_size_bytes
        raw: Any = ids  # written through the buffer protocol
        keep = batch.keep
        method = self.method
        rows_launch = self._row_launch if buf.mapped_ptr else None
        if method == "row_kernel" and rows_launch is None:
            raise LocalProtocolError(f"row kernel unavailable: {self.row_kernel_unavailable}")
        offset = first = 0
        while first < len(pieces):
            last, rows_in_group = first + 1, pieces[first][2] - pieces[first][1]
            while first > 0 and last < len(pieces) and rows_in_group < self.group_rows:
                rows_in_group += pieces[last][2] - pieces[last][1]
                last += 1
            group = pieces[first:last]
            start = offset
            for item, lo, hi in group:  # the block ids (the one per-element Python cost)
                self._pack(raw, offset, item, lo, hi)
                offset += hi - lo
            part = ids[start:offset]
            if int(part.view(np.uint64).max()) >= self.num_blocks:
                bad = sorted({item.mm_hash for item, _, _ in group})  # negatives wrap high
                raise LocalProtocolError(f"a block id of {bad} lies outside the region")
            steps = np.diff(part) != 1 if method in ("auto", "runs", "batch_memcpy") else None
            uploaded = False
            span, word = start, 16  # the pending row-kernel launch: rows [span, at)
            at = start
            for item, lo, hi in group:
                n = hi - lo
                tensor = encoder_cache[item.mm_hash]
                keep.append(tensor)  # its memory stays allocated until the end event fires
                how = method
                inner = None if steps is None else steps[at - start : at - start + n - 1]
                if how == "auto":
                    assert inner is not None
                    long_runs = (int(np.count_nonzero(inner)) + 1) * self.dma_min_run_blocks <= n
                    if long_runs or self._device_rows is None:
                        how = "runs"
                    else:
                        how = "row_kernel" if rows_launch is not None else "kernel"
                if how == "row_kernel":
                    assert rows_launch is not None
                    rows = self._rows(item, tensor, save, torch.uint8)
                    ptr = rows.data_ptr()
                    if ptr != tensor.data_ptr():
                        keep.append(rows)  # a contiguous copy of a strided tensor (a save)
                    np.add(self._row_offsets(n), ptr + lo * bs, out=ids[cap + at : cap + at + n])
                    while ptr % word or bs % word:
                        word //= 2
                    at += n
                    continue
                if at > span:  # rows of the row kernel before this piece
                    assert rows_launch is not None
                    self._launch_rows(rows_launch, save, buf, span, at, word, lane.handle)
                span, word = at + n, 16
                if how == "kernel":
                    if buf.mapped is not None:  # the kernel reads the ids from pinned memory
                        index = buf.mapped[at : at + n]
                    else:
                        if not uploaded:
                            self._upload(lane, buf, start, offset)
                            uploaded = True
                        index = lane.dev_ids[at : at + n]
                    self._copy_kernel(save, item, tensor, lo, hi, index, keep)
                else:
                    blocks = ids[at : at + n]
                    rows = self._rows(item, tensor, save, torch.uint8)[lo:hi]
                    keep.append(rows)
                    assert inner is not None or how == "per_block"
                    if how == "runs":
                        assert inner is not None
                        self._copy_runs(save, blocks, np.flatnonzero(inner), rows, lane.handle)
                    elif how == "batch_memcpy":
                        self._copy_batch_memcpy(save, blocks, rows, keep, lane.handle)
                    else:
                        self._copy_per_block(save, blocks, rows)
                at += n
            if at > span:
                assert rows_launch is not None
                self._launch_rows(rows_launch, save, buf, span, at, word, lane.handle)
            first = last

    def _pack(self, raw: Any, offset: int, item: CopyItem, lo: int, hi: int) -> None:
        """Block ids `[lo, hi)` of `item` into the id buffer at `offset` (int64)."""
        n = hi - lo
        packer = self._packers.get(n)
        if packer is None:
            packer = self._packers.setdefault(n, struct.Struct(f"{n}q"))
        seq = item.blocks if lo == 0 and len(item.blocks) == n else item.blocks[lo:hi]
        packer.pack_into(raw, 8 * offset, *seq)

    def _launch_rows(
        self,
        launch: RowLaunch,
        save: bool,
        buf: IdBuffer,
        start: int,
        stop: int,
        word: int,
        stream: int,
    ) -> None:
        """One row-kernel launch over rows `[start, stop)` of the id buffer."""
        base = buf.mapped_ptr
        ids, rows = base + 8 * start, base + 8 * (buf.capacity + start)
        launch(save, ids, rows, stop - start, word, stream)
