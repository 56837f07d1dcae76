"""Descriptor numbering of NIXL block lists (`BlockLayout`), used by `agent.NixlAgent`.

A layout is an ordered list of regions, each `(base_addr, block_len, num_blocks)`; block
`b` of region `r` starts at `base_addr + b * block_len`, and its descriptor index is
`offset[r] + b`, where `offset[r]` is the sum of `num_blocks` over the regions before `r`.
When every region has the same `num_blocks = N` this is `r * N + b`; regions of different
capacity (R-P14) are allowed.

One descriptor per block is enough: NIXL's `make_prepped_xfer` merges every run of index
pairs that is consecutive on both sides into one descriptor before the backend sees it
(its debug log says "merged 1024 indices into 64 descriptors" for a 16-block request in
64 regions). Coarser lists prepared here would not lower what the backend posts
(bench/RESULTS.md, "## Push", descriptor coalescing).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["BlockLayout", "BlockRegion", "IndexList"]

IndexList = Sequence[int] | npt.NDArray[np.integer[Any]]


class BlockRegion(NamedTuple):
    """One registered region cut into `num_blocks` contiguous blocks of `block_len` bytes."""

    base_addr: int
    block_len: int
    num_blocks: int


class BlockLayout:
    """Descriptor numbering of an ordered list of block regions (see the module docstring)."""

    __slots__ = ("_num_blocks", "_offsets", "_selections", "num_descs", "regions")

    def __init__(self, regions: Iterable[tuple[int, int, int]]) -> None:
        parsed = tuple(BlockRegion(*region) for region in regions)
        if not parsed:
            raise LocalProtocolError("a block layout needs at least one region")
        for idx, region in enumerate(parsed):
            if region.base_addr < 0 or region.block_len <= 0 or region.num_blocks <= 0:
                raise LocalProtocolError(f"region {idx} is empty or negative: {region}")
        self.regions = parsed
        counts = np.array([r.num_blocks for r in parsed], dtype=np.int64)
        self._num_blocks = counts
        self._offsets = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        self.num_descs = int(counts.sum())
        # Per region selection (None: all regions): descriptor offsets as an int32 column and
        # the smallest capacity among the selected regions. A transfer path asks for the
        # same few selections on every WRITE, so they are validated and computed once.
        self._selections: dict[tuple[int, ...] | None, tuple[npt.NDArray[np.int32], int]] = {}

    def index(self, region: int, block: int) -> int:
        """Descriptor index of block `block` of region `region`."""
        if not 0 <= region < len(self.regions):
            raise LocalProtocolError(f"region {region} out of range 0..{len(self.regions) - 1}")
        if not 0 <= block < self.regions[region].num_blocks:
            raise LocalProtocolError(
                f"block {block} out of range for region {region} "
                f"({self.regions[region].num_blocks} blocks)"
            )
        return int(self._offsets[region]) + block

    def indices_for_blocks(
        self, block_ids: IndexList, regions: Sequence[int] | None = None
    ) -> npt.NDArray[np.int32]:
        """Indices of the same `block_ids` in each region, region-major (all regions if None).

        The result lists region `regions[0]`'s blocks first, in `block_ids` order, then the
        next region's: the order two sides must agree on for a WRITE or READ.
        """
        offsets, capacity = self._selection(regions)
        if isinstance(block_ids, list | tuple):
            # Short Python lists are the common case: min/max on the list beat two numpy
            # reductions, and the sum below stays in int32 once the range is checked.
            low, high = (min(block_ids), max(block_ids)) if block_ids else (0, -1)
            ids = np.array(block_ids, dtype=np.int64).reshape(-1)
        else:
            ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
            low, high = (int(ids.min()), int(ids.max())) if ids.size else (0, -1)
        if ids.size and (low < 0 or high >= capacity):
            raise LocalProtocolError("block id out of range for at least one region")
        return (offsets + ids.astype(np.int32)).reshape(-1)

    def _selection(self, regions: Sequence[int] | None) -> tuple[npt.NDArray[np.int32], int]:
        key = regions if regions is None or isinstance(regions, tuple) else tuple(regions)
        hit = self._selections.get(key)
        if hit is not None:
            return hit
        picked = np.arange(len(self.regions)) if key is None else np.asarray(key, dtype=np.int64)
        if picked.size and (picked.min() < 0 or picked.max() >= len(self.regions)):
            raise LocalProtocolError(f"region index out of range in {list(picked)}")
        capacity = int(self._num_blocks[picked].min()) if picked.size else 0
        offsets = self._offsets[picked].astype(np.int32).reshape(-1, 1)
        if len(self._selections) >= 64:  # a bound, for callers that vary the selection
            self._selections.clear()
        self._selections[key] = (offsets, capacity)
        return offsets, capacity

    def descriptor_rows(self, device_id: int = 0) -> npt.NDArray[np.uint64]:
        """The N x 3 `(addr, len, device_id)` rows NIXL prepares, in descriptor order."""
        rows = np.empty((self.num_descs, 3), dtype=np.uint64)
        for region, offset in zip(self.regions, self._offsets, strict=True):
            start = int(offset)
            stop = start + region.num_blocks
            steps = np.arange(region.num_blocks, dtype=np.uint64)
            rows[start:stop, 0] = np.uint64(region.base_addr) + steps * np.uint64(region.block_len)
            rows[start:stop, 1] = region.block_len
            rows[start:stop, 2] = device_id
        return rows
