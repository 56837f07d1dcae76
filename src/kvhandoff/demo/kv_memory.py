"""KV cache memory for the demo roles: regions, a block allocator, patterns to verify.

Each region is one layer's K or V cache: `num_blocks` blocks of `block_len` bytes in one
DRAM allocation (numpy), registered with NIXL once. P fills a request's blocks with a
pattern derived from the client request id, the region and the block's ordinal; D checks
every byte against the same pattern after the push.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.member_routing import LocalRegion


@dataclass(frozen=True, slots=True)
class KVShape:
    layers: int = 4
    num_blocks: int = 512
    block_len: int = 16 * 1024

    @property
    def regions(self) -> int:
        return 2 * self.layers  # K and V

    def member_names(self) -> list[str]:
        return [f"layers.{i}.{kv}" for i in range(self.layers) for kv in ("k", "v")]


class KVMemory:
    def __init__(self, shape: KVShape) -> None:
        self.shape = shape
        self.arrays: list[npt.NDArray[np.uint8]] = [
            np.zeros(shape.num_blocks * shape.block_len, dtype=np.uint8)
            for _ in range(shape.regions)
        ]
        self._free = list(range(shape.num_blocks - 1, -1, -1))

    def local_regions(self) -> list[LocalRegion]:
        names = self.shape.member_names()
        return [
            LocalRegion(
                int(a.ctypes.data), (names[i],), self.shape.block_len, self.shape.num_blocks
            )
            for i, a in enumerate(self.arrays)
        ]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise LocalProtocolError(f"out of KV blocks: need {count}, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(block_ids)

    def _block(self, region: int, block_id: int) -> npt.NDArray[np.uint8]:
        start = block_id * self.shape.block_len
        return self.arrays[region][start : start + self.shape.block_len]

    def fill(self, client_id: str, block_ids: Sequence[int]) -> None:
        """P's prefill: write the request's pattern into every region of its blocks."""
        for region in range(self.shape.regions):
            for ordinal, block_id in enumerate(block_ids):
                self._block(region, block_id).view(np.uint64)[:] = _word(client_id, region, ordinal)

    def clear(self, block_ids: Sequence[int]) -> None:
        for region in range(self.shape.regions):
            for block_id in block_ids:
                self._block(region, block_id)[:] = 0

    def verify(self, client_id: str, block_ids: Sequence[int]) -> bool:
        """D: every byte of every region of the request's blocks holds P's pattern."""
        for region in range(self.shape.regions):
            for ordinal, block_id in enumerate(block_ids):
                words = self._block(region, block_id).view(np.uint64)
                if not np.all(words == _word(client_id, region, ordinal)):
                    return False
        return True


def _word(client_id: str, region: int, ordinal: int) -> np.uint64:
    digest = hashlib.blake2b(f"{client_id}/{region}/{ordinal}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))
