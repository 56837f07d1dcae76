"""The embedding cache: entry machines over the block pool, with FIFO eviction (R-E04).

`EmbeddingCache` registers the `ec.cache_entry` machine on a bus and executes the
bookkeeping effects of its entries (`ReleaseBlocks`, `MarkEvictable`). It never changes
an entry's state itself: it reserves blocks and creates entries, and delivers events at
the time its caller gives.

When blocks are needed and too few are free, `reserve` evicts ready and unpinned entries
oldest first (insertion order), and only when that frees enough: it never evicts for a
reservation that would fail anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvhandoff.machines.ec.cache_entry import (
    EC_CACHE_ENTRY,
    EntryCtx,
    MarkEvictable,
    ReleaseBlocks,
)
from kvhandoff.machines.ec.events import Evict
from kvhandoff.machines.ec.pool import BlockPool, FifoEvictionOrder
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.events import Event

__all__ = ["EmbeddingCache", "Entry", "EvictionObserver"]

Entry = Instance[EntryCtx]
EvictionObserver = Callable[[str, list[Hashable]], None]
"""`observer(victim, evictable_oldest_first)`, called before each eviction (tests)."""


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
        bus.watch(EC_CACHE_ENTRY, "held")  # asked every engine step (`has_held`)
        bus.handle(ReleaseBlocks, self._release)
        bus.handle(MarkEvictable, self._mark)

    # -- reading -------------------------------------------------------------------------

    def entry(self, mm_hash: str) -> Entry | None:
        """The live entry of `mm_hash`, if any."""
        return self.bus.get(EC_CACHE_ENTRY, mm_hash)

    def state(self, mm_hash: str) -> str | None:
        """The entry's state name (`allocated`, `ready`, `pinned`; for logs and tests), or
        None when the tier does not hold it. Decisions ask `has`."""
        inst = self.bus.get(EC_CACHE_ENTRY, mm_hash)
        return None if inst is None else inst.state

    def has_held(self) -> bool:
        """Whether any entry is held: a save or READ not landed, or a pin (a load not
        confirmed, a grant, a request waiting for its load)."""
        return bool(self.bus.tagged(EC_CACHE_ENTRY, "held"))

    def has(self, mm_hash: str, tag: str) -> bool:
        """Whether the entry of `mm_hash` is live and its state carries `tag`."""
        return self.bus.has_tag(EC_CACHE_ENTRY, mm_hash, tag)

    def is_loadable(self, mm_hash: str) -> bool:
        """True when the bytes are in the tier (ready or pinned)."""
        return self.bus.has_tag(EC_CACHE_ENTRY, mm_hash, "loadable")

    def entries(self) -> list[Entry]:
        return self.bus.instances(EC_CACHE_ENTRY)

    # -- reserving -----------------------------------------------------------------------

    def reserve(
        self, mm_hash: str, num_blocks: int, size_bytes: int, origin: str, now: float
    ) -> Entry | None:
        """A new `allocated` entry of `num_blocks` blocks, evicting FIFO if needed.

        None (and nothing evicted) when the tier cannot make room, or when `mm_hash`
        already has an entry.
        """
        bus = self.bus
        bus.advance(now)  # what is due first (a quarantine that ended frees its blocks)
        if bus.get(EC_CACHE_ENTRY, mm_hash) is not None:
            return None
        if num_blocks > self.pool.free_count + self.order.evictable_weight:
            return None
        while num_blocks > self.pool.free_count:
            victim = self.order.oldest()
            assert victim is not None, "evictable_weight promised room"
            if self.observer is not None:
                self.observer(str(victim), self.order.evictable())
            self.evictions += 1
            bus.dispatch(EC_CACHE_ENTRY, victim, Evict(), now)
        blocks = self.pool.allocate(mm_hash, num_blocks)
        assert blocks is not None
        self.order.add(mm_hash, num_blocks)
        ctx = EntryCtx(mm_hash, blocks=blocks, size_bytes=size_bytes, origin=origin)
        return bus.create(EC_CACHE_ENTRY, ctx, now)

    # -- delivering ----------------------------------------------------------------------

    def deliver(self, mm_hash: str, event: Event, now: float) -> None:
        """Deliver `event` to the entry of `mm_hash` (`LocalProtocolError` if illegal)."""
        self.bus.dispatch(EC_CACHE_ENTRY, mm_hash, event, now)

    # -- effects of the entries ---------------------------------------------------------

    def _release(self, inst: Entry | None, effect: ReleaseBlocks) -> None:
        self.pool.free(effect.mm_hash)
        self.order.remove(effect.mm_hash)

    def _mark(self, inst: Entry | None, effect: MarkEvictable) -> None:
        self.order.set_evictable(effect.mm_hash, effect.evictable)

    def check(self) -> None:
        """Raise unless the pool, the eviction order and the entries agree (tests)."""
        self.pool.check()
        live = {inst.key: inst for inst in self.bus.instances(EC_CACHE_ENTRY)}
        assert set(self.pool.owners()) == set(live), "pool owners differ from live entries"
        assert len(self.order) == len(live), "eviction order differs from live entries"
        for key, inst in live.items():
            assert self.pool.blocks_of(key) == inst.ctx.blocks, f"{key}: blocks differ"
        evictable = {inst.key for inst in self.bus.tagged(EC_CACHE_ENTRY, "evictable")}
        assert set(self.order.evictable()) == evictable, "evictable set differs from ready"
