"""The fixed block pool of the encoder-cache CPU tier and its FIFO eviction order (R-E04).

Pure bookkeeping, no I/O: the region itself lives in an adapter; here a block is an index
in `range(num_blocks)` (one token row of an encoder output, `ECLayout.block_size_bytes`).

- `BlockPool` hands out block indices per owner (an `mm_hash`). A block belongs to at
  most one owner at a time; the blocks of one owner need not be contiguous.
- `FifoEvictionOrder` remembers the order entries entered the cache and which of them are
  evictable (ready and unpinned); `oldest()` is the next victim. An entry keeps its place
  when it is pinned and unpinned again: the order is insertion order, not recency.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Iterator

from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["BlockPool", "FifoEvictionOrder"]


class BlockPool:
    """`num_blocks` block indices, each owned by at most one owner at a time."""

    __slots__ = ("_free", "_owned", "_owner", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise LocalProtocolError(f"a block pool needs num_blocks >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # A stack whose top is the lowest free index: fresh pools hand out 0, 1, 2, ...
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._owner: list[Hashable | None] = [None] * num_blocks
        self._owned: dict[Hashable, tuple[int, ...]] = {}

    @property
    def free_count(self) -> int:
        """Blocks owned by nobody."""
        return len(self._free)

    def blocks_of(self, owner: Hashable) -> tuple[int, ...]:
        """The blocks `owner` holds (empty when it holds none)."""
        return self._owned.get(owner, ())

    def owner_of(self, block: int) -> Hashable | None:
        """Who holds `block`, or None when it is free."""
        return self._owner[block]

    def owners(self) -> Iterator[Hashable]:
        return iter(list(self._owned))

    def allocate(self, owner: Hashable, count: int) -> tuple[int, ...] | None:
        """`count` free blocks for `owner`, or None (and no change) when fewer are free."""
        if owner in self._owned:
            raise LocalProtocolError(f"block pool: {owner!r} already holds blocks")
        if count < 1:
            raise LocalProtocolError(f"block pool: cannot allocate {count} blocks")
        if count > len(self._free):
            return None
        free = self._free
        blocks = tuple(free.pop() for _ in range(count))
        for block in blocks:
            if self._owner[block] is not None:  # pragma: no cover - the free list is ours
                raise LocalProtocolError(f"block pool: block {block} handed out twice")
            self._owner[block] = owner
        self._owned[owner] = blocks
        return blocks

    def free(self, owner: Hashable) -> tuple[int, ...]:
        """Return every block of `owner` to the pool; the blocks it held."""
        blocks = self._owned.pop(owner, None)
        if blocks is None:
            raise LocalProtocolError(f"block pool: {owner!r} holds no blocks")
        for block in reversed(blocks):
            self._owner[block] = None
            self._free.append(block)
        return blocks

    def check(self) -> None:
        """Raise `LocalProtocolError` unless every block has exactly one home."""
        seen: dict[int, Hashable] = {}
        for owner, blocks in self._owned.items():
            for block in blocks:
                if block in seen:
                    raise LocalProtocolError(
                        f"block {block} held by both {seen[block]!r} and {owner!r}"
                    )
                if self._owner[block] != owner:
                    raise LocalProtocolError(f"block {block} index disagrees about {owner!r}")
                seen[block] = owner
        free = set(self._free)
        if len(free) != len(self._free) or free & seen.keys():
            raise LocalProtocolError("a free block is listed twice or also owned")
        if len(free) + len(seen) != self.num_blocks:
            raise LocalProtocolError("blocks are missing from the pool")


class FifoEvictionOrder:
    """Insertion order of cache entries, and which of them may be evicted now.

    `add` records an entry (not evictable yet) with its weight in blocks; `set_evictable`
    toggles it; `oldest()` is the earliest-added evictable entry. `evictable_weight` is
    the number of blocks evicting every evictable entry would free.
    """

    __slots__ = ("_entries", "_heap", "_seq", "evictable_weight")

    def __init__(self) -> None:
        # key -> [sequence number, weight, evictable]
        self._entries: dict[Hashable, list[int | bool]] = {}
        # (sequence number, key); stale entries are skipped lazily. Sequence numbers are
        # unique per `add`, so two heap entries never compare their keys unless equal.
        self._heap: list[tuple[int, Hashable]] = []
        self._seq = itertools.count()
        self.evictable_weight = 0

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: Hashable, weight: int) -> None:
        if key in self._entries:
            raise LocalProtocolError(f"eviction order: {key!r} is already tracked")
        self._entries[key] = [next(self._seq), weight, False]

    def set_evictable(self, key: Hashable, evictable: bool) -> None:
        record = self._entries.get(key)
        if record is None:
            raise LocalProtocolError(f"eviction order: {key!r} is not tracked")
        if bool(record[2]) == evictable:
            return
        record[2] = evictable
        weight = int(record[1])
        self.evictable_weight += weight if evictable else -weight
        if evictable:
            heapq.heappush(self._heap, (int(record[0]), key))
            if len(self._heap) > 64 + 2 * len(self._entries):
                self._compact()

    def remove(self, key: Hashable) -> None:
        record = self._entries.pop(key, None)
        if record is None:
            raise LocalProtocolError(f"eviction order: {key!r} is not tracked")
        if record[2]:
            self.evictable_weight -= int(record[1])

    def oldest(self) -> Hashable | None:
        """The earliest-added evictable entry, or None when nothing may be evicted."""
        heap = self._heap
        while heap:
            seq, key = heap[0]
            record = self._entries.get(key)
            if record is not None and record[2] and record[0] == seq:
                return key
            heapq.heappop(heap)
        return None

    def evictable(self) -> list[Hashable]:
        """Every evictable entry, oldest first (for tests and diagnostics)."""
        return [k for k, r in sorted(self._entries.items(), key=lambda kv: kv[1][0]) if r[2]]

    def _compact(self) -> None:
        self._heap = [(int(r[0]), k) for k, r in self._entries.items() if r[2]]
        heapq.heapify(self._heap)
