"""What an encoder-cache instance still holds when its role ends, for soaks and tests.

An entry that is `ready` is the tier doing its job (a cached encoding), never a leak.
Everything else that outlives the traffic is: a block owned by no ready entry, an entry
still `allocated` (a save or READ destination) or `pinned`, a producer grant, a consumer
read, a request lifecycle, a copy batch, a READ handle. `settled(side)` says whether the
instance has nothing in flight any more; `audit(side)` counts what is left.
"""

from __future__ import annotations

from typing import Any

from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.copy_batch import EC_COPY_BATCH
from kvhandoff.machines.ec.notices import EC_REQUEST_FAILURE


def _transient(side: ECSide) -> int:
    """Lifecycles that end by themselves (timeouts, completions) once traffic stops (a
    failure notice the engine has not taken yet is owed to it, not in flight)."""
    bus = side.scheduler.bus
    kinds = [bus.machine_named(name).decl for name in bus.kinds()]
    quiet = (EC_CACHE_ENTRY, EC_REQUEST_FAILURE)
    live = sum(bus.live(kind) for kind in kinds if kind not in quiet)
    live += sum(not inst.has("evictable") for inst in side.scheduler.cache.entries())
    copies = 0 if side.worker is None else side.worker.bus.live(EC_COPY_BATCH)
    return live + copies + side.reads_in_flight()


def settled(side: ECSide) -> bool:
    """Nothing in flight: no grant, read, request, unsaved entry, copy or READ."""
    return _transient(side) == 0


def audit(side: ECSide) -> dict[str, Any]:
    """`leaked_blocks`, `live_lifecycles`, `pinned_grants` (all 0 when clean) and whether
    the pool, the eviction order and the entries agree."""
    sched = side.scheduler
    cache = sched.cache
    cached = [e for e in cache.entries() if e.has("evictable")]
    cached_blocks = sum(len(e.ctx.blocks) for e in cached)
    try:
        cache.check()
        consistent = True
    except AssertionError:
        consistent = False
    producer = sched.producer
    return {
        "leaked_blocks": cache.pool.num_blocks - cache.pool.free_count - cached_blocks,
        "live_lifecycles": _transient(side),
        "pinned_grants": 0 if producer is None else len(producer.grants()),
        "cached_entries": len(cached),
        "pool_consistent": consistent,
    }
