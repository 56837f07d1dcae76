"""The embedding cache: entry machines over the block pool, with FIFO eviction (R-E04).

`EmbeddingCache` registers the `ec.cache_entry` machine on a bus and executes the
bookkeeping effects of its entries (`ReleaseBlocks`, `MarkEvictable`). It never changes
an entry's state itself: it reserves blocks and creates entries, and delivers events.

When blocks are needed and too few are free, `reserve` evicts ready and unpinned entries
oldest first (insertion order), and only when that frees enough: it never evicts for a
reservation that would fail anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvhandoff.machines.ec.cache_entry import (
    EC_CACHE_ENTRY,
    ENTRY_KIND,
    MarkEvictable,
    ReleaseBlocks,
)
from kvhandoff.machines.ec.pool import BlockPool, FifoEvictionOrder
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance

__all__ = ["EmbeddingCache", "EvictionObserver"]

EvictionObserver = Callable[[str, list[Any]], None]
"""`observer(victim, evictable_oldest_first)`, called before each eviction (tests)."""

LOADABLE_STATES = frozenset({"ready", "pinned"})


class EmbeddingCache:
    """Entries keyed by `mm_hash` in a pool of `num_blocks` blocks, on `bus`."""

    def __init__(
        self,
        bus: EventBus,
        num_blocks: int,
        *,
        observer: EvictionObserver | None = None,
    ) -> None:
        self.bus = bus
        self.pool = BlockPool(num_blocks)
        self.order = FifoEvictionOrder()
        self.observer = observer
        self.evictions = 0
        bus.register(EC_CACHE_ENTRY)
        bus.handle(ReleaseBlocks, self._release)
        bus.handle(MarkEvictable, self._mark)

    # -- reading -------------------------------------------------------------------------

    def entry(self, mm_hash: str) -> Instance | None:
        """The live entry of `mm_hash`, if any."""
        return self.bus.get(ENTRY_KIND, mm_hash)

    def state(self, mm_hash: str) -> str | None:
        """`allocated`, `ready`, `pinned`, or None when the tier does not hold it."""
        inst = self.bus.get(ENTRY_KIND, mm_hash)
        return None if inst is None else inst.state

    def is_loadable(self, mm_hash: str) -> bool:
        """True when the bytes are in the tier (ready or pinned)."""
        return self.state(mm_hash) in LOADABLE_STATES

    def entries(self) -> list[Instance]:
        return list(self.bus.instances(ENTRY_KIND))

    # -- reserving -----------------------------------------------------------------------

    def reserve(
        self, mm_hash: str, num_blocks: int, size_bytes: int, origin: str
    ) -> Instance | None:
        """A new `allocated` entry of `num_blocks` blocks, evicting FIFO if needed.

        None (and nothing evicted) when the tier cannot make room, or when `mm_hash`
        already has an entry.
        """
        if self.bus.get(ENTRY_KIND, mm_hash) is not None:
            return None
        if num_blocks > self.pool.free_count + self.order.evictable_weight:
            return None
        while num_blocks > self.pool.free_count:
            victim = self.order.oldest()
            assert victim is not None, "evictable_weight promised room"
            if self.observer is not None:
                self.observer(str(victim), self.order.evictable())
            self.evictions += 1
            self.bus.dispatch(ENTRY_KIND, victim, "evict")
        blocks = self.pool.allocate(mm_hash, num_blocks)
        assert blocks is not None
        self.order.add(mm_hash, num_blocks)
        return self.bus.create(
            ENTRY_KIND, mm_hash, blocks=blocks, size_bytes=size_bytes, origin=origin
        )

    # -- delivering ----------------------------------------------------------------------

    def deliver(self, mm_hash: str, event: str, payload: Any = None) -> None:
        """Deliver `event` to the entry of `mm_hash` (`LocalProtocolError` if illegal)."""
        self.bus.dispatch(ENTRY_KIND, mm_hash, event, payload)

    # -- effects of the entries ---------------------------------------------------------

    def _release(self, inst: Instance, effect: ReleaseBlocks) -> None:
        self.pool.free(effect.mm_hash)
        self.order.remove(effect.mm_hash)

    def _mark(self, inst: Instance, effect: MarkEvictable) -> None:
        self.order.set_evictable(effect.mm_hash, effect.evictable)

    def check(self) -> None:
        """Raise unless the pool, the eviction order and the entries agree (tests)."""
        self.pool.check()
        live = {inst.key: inst for inst in self.bus.instances(ENTRY_KIND)}
        assert set(self.pool.owners()) == set(live), "pool owners differ from live entries"
        assert len(self.order) == len(live), "eviction order differs from live entries"
        for key, inst in live.items():
            assert self.pool.blocks_of(key) == inst.ctx.blocks, f"{key}: blocks differ"
        evictable = {k for k, inst in live.items() if inst.state == "ready"}
        assert set(self.order.evictable()) == evictable, "evictable set differs from ready"
