"""The per-item copies of the CUDA encoder-cache copy engine: an item's encoder rows as
a view of words, and the copy paths for a slice of them (one torch indexing kernel, one
DMA per run of blocks, one `cudaMemcpyBatchAsync`, or one copy per block).

`ItemCopies` is a base of `ec_copy.CudaCopyEngine`, above `RegionMapping`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvhandoff.adapters.cuda.copy_methods import runs_of, word
from kvhandoff.adapters.cuda.region_mapping import RegionMapping
from kvhandoff.machines.ec.meta import CopyItem
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["ItemCopies"]


class ItemCopies(RegionMapping):
    """Copies of one item's rows, each enqueued on the current (a lane's) stream."""

    _host_rows: torch.Tensor
    _widest: int
    _word_size: int
    _word_dtype: torch.dtype

    def _rows(self, item: CopyItem, tensor: torch.Tensor, save: bool, dtype: torch.dtype) -> Any:
        """The item's first `num_tokens` rows of its encoder tensor as `[n, words]` of `dtype`
        (one view in the common case: a contiguous `[tokens, hidden]` tensor; for a save
        from strided rows, a contiguous copy made on the engine's stream)."""
        n, bs = item.num_tokens, self.block_size_bytes
        if tensor.device != self.device:
            raise LocalProtocolError(
                f"{item.mm_hash}: tensor on {tensor.device}, not {self.device}"
            )
        if (
            tensor.dim() == 2
            and tensor.shape[0] >= n
            and tensor.shape[1] * tensor.element_size() == bs
            and tensor.is_contiguous()
        ):
            words = tensor.view(dtype)
            return words if tensor.shape[0] == n else words[:n]
        if tensor.dim() < 1 or tensor.shape[0] < n:
            raise LocalProtocolError(f"{item.mm_hash}: tensor {tuple(tensor.shape)} < {n} rows")
        rows = tensor[:n]
        if rows.numel() * rows.element_size() != n * bs:
            raise LocalProtocolError(
                f"{item.mm_hash}: rows of {rows.numel() * rows.element_size() // n} bytes, "
                f"blocks of {bs}"
            )
        if not rows.is_contiguous():
            if not save:
                raise LocalProtocolError(f"{item.mm_hash}: cannot load into a strided tensor")
            rows = rows.contiguous()
        return rows.reshape(n, -1).view(torch.uint8).view(n, bs).view(dtype)

    def _copy_kernel(
        self,
        save: bool,
        item: CopyItem,
        tensor: torch.Tensor,
        lo: int,
        hi: int,
        index: torch.Tensor,
        keep: list[object],
    ) -> None:
        """One torch indexing kernel for rows `[lo, hi)` of the item."""
        while True:
            ptr = tensor.data_ptr()
            if ptr % self._word_size == 0:
                size, dtype = self._word_size, self._word_dtype
            else:
                size, dtype = word(self.block_size_bytes, ptr, widest=self._widest)
            words = self._rows(item, tensor, save, dtype)
            if words.data_ptr() != ptr:
                keep.append(words)  # a contiguous copy of a strided tensor (a save)
            if lo or hi != words.shape[0]:
                words = words[lo:hi]
            region = self._kernel_view(dtype)
            try:
                if save:
                    region.index_copy_(0, index, words)
                else:
                    torch.index_select(region, 0, index, out=words)
                return
            except RuntimeError:
                if size == 1:
                    raise
                self._widest = size // 2  # this word type is not supported: go narrower
                self._word_size, self._word_dtype = word(self.block_size_bytes, widest=self._widest)

    def _copy_runs(
        self,
        save: bool,
        blocks: np.ndarray[Any, Any],
        breaks: np.ndarray[Any, Any],
        rows: torch.Tensor,
        stream: int,
    ) -> None:
        """One DMA per run of consecutive blocks (`breaks`: where `blocks` steps by != 1,
        as offsets of the step's left element)."""
        bs = self.block_size_bytes
        if breaks.size == 0:  # one run: the common case for a contiguous encoding
            starts: list[int] = [0]
            lengths: list[int] = [int(blocks.size)]
        else:
            cut = (breaks + 1).tolist()
            starts = [0, *cut]
            lengths = [b - a for a, b in zip(starts, [*cut, int(blocks.size)], strict=True)]
        firsts = blocks[starts].tolist()
        runtime = self._runtime
        if rows.is_contiguous():
            host, dev = self._host_ptr, rows.data_ptr()
            for start, length, first in zip(starts, lengths, firsts, strict=True):
                h, d = host + first * bs, dev + start * bs
                if save:
                    runtime.memcpy(h, d, length * bs, stream)
                else:
                    runtime.memcpy(d, h, length * bs, stream)
            return
        host_rows = self._host_rows
        for start, length, first in zip(starts, lengths, firsts, strict=True):
            region_part = host_rows[first : first + length]
            rows_part = rows[start : start + length]
            if save:
                region_part.copy_(rows_part, non_blocking=True)
            else:
                rows_part.copy_(region_part, non_blocking=True)

    def _copy_per_block(self, save: bool, blocks: np.ndarray[Any, Any], rows: torch.Tensor) -> None:
        host = self._host_rows
        for token, block in enumerate(blocks.tolist()):
            if save:
                host[block].copy_(rows[token], non_blocking=True)
            else:
                rows[token].copy_(host[block], non_blocking=True)

    def _copy_batch_memcpy(
        self,
        save: bool,
        blocks: np.ndarray[Any, Any],
        rows: torch.Tensor,
        keep: list[object],
        stream: int,
    ) -> None:
        starts, lengths = runs_of(blocks)
        bs = self.block_size_bytes
        host = (self._host_ptr + blocks[starts] * bs).astype(np.uint64)
        dev = (rows.data_ptr() + starts * bs).astype(np.uint64)
        sizes = (lengths * bs).astype(np.uint64)
        dsts, srcs = (host, dev) if save else (dev, host)
        keep.extend((dsts, srcs, sizes))
        self._runtime.memcpy_batch(dsts, srcs, sizes, save, self._index, stream)
