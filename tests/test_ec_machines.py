"""Encoder-cache tier machines of the local tier, one by one: pool, entry, copy batch,
request availability, worker region (issue 4). The P2P machines (consumer read, producer
grant) are in `test_ec_p2p_machines.py`."""

from __future__ import annotations

from typing import Any

import pytest

from kvhandoff.machines.ec.cache import EmbeddingCache
from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY, EncodingEvicted
from kvhandoff.machines.ec.copy_batch import (
    EC_COPY_BATCH,
    BatchCtx,
    CopyBlocks,
    CopyLanded,
    EndEvent,
    Report,
    Submit,
)
from kvhandoff.machines.ec.events import (
    Discard,
    Evict,
    Pin,
    Publish,
    Saved,
    Unpin,
)
from kvhandoff.machines.ec.meta import CopyItem
from kvhandoff.machines.ec.pool import BlockPool, FifoEvictionOrder
from kvhandoff.machines.ec.request import (
    EC_REQUEST,
    Available,
    FailRequest,
    FallBack,
    Finished,
    ReleaseSettlements,
    RequestCtx,
    Settled,
)
from kvhandoff.machines.ec.transfer import (
    EC_TRANSFER,
    Dispatch,
    LoadLost,
    RankReported,
    TransferCtx,
)
from kvhandoff.machines.ec.worker_region import (
    EC_WORKER_REGION,
    CloseRegion,
    RegionCtx,
    Register,
    Shutdown,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.effects import Effect, Emit
from kvhandoff.protocol.ec_config import ECLayout
from kvhandoff.protocol.ec_status import (
    compatibility_hash,
)
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

COMPAT = compatibility_hash("1.0", "model", "bfloat16", 8)


def isolated_bus() -> EventBus:
    """A bus on which `Emit`s to other machines are recorded instead of delivered."""
    bus = EventBus()
    bus.handle(Emit, lambda inst, effect: bus.outbox.append((inst, effect)))
    return bus


def effects(bus: EventBus) -> list[Effect]:
    return [effect for _, effect in bus.drain_outbox()]


def discards(out: list[Effect]) -> bool:
    return any(isinstance(e, Emit) and e.event == Discard() for e in out)


# -- block pool and FIFO order ------------------------------------------------------------


def test_R_E01_pool_is_sized_from_the_layout_block_count() -> None:
    layout = ECLayout.from_model(1024, 3, "bfloat16", 10 * 8192 + 5)
    pool = BlockPool(layout.num_blocks)
    assert layout.block_size_bytes == 1024 * 4 * 2
    assert pool.num_blocks == pool.free_count == 10


def test_R_E04_pool_never_hands_one_block_to_two_entries() -> None:
    pool = BlockPool(6)
    a = pool.allocate("a", 2)
    b = pool.allocate("b", 3)
    assert a is not None and b is not None and not set(a) & set(b)
    assert pool.allocate("c", 2) is None, "only one block left"
    assert pool.free_count == 1
    pool.free("a")
    c = pool.allocate("c", 3)
    assert c is not None and not set(c) & set(b)
    pool.check()
    with pytest.raises(LocalProtocolError, match="already holds"):
        pool.allocate("c", 1)
    with pytest.raises(LocalProtocolError, match="holds no blocks"):
        pool.free("a")


def test_R_E04_fifo_order_is_insertion_order_and_survives_pinning() -> None:
    order = FifoEvictionOrder()
    for key in "abc":
        order.add(key, 1)
    assert order.oldest() is None, "nothing evictable until ready"
    for key in "cba":
        order.set_evictable(key, True)
    assert order.oldest() == "a"
    order.set_evictable("a", False)  # pinned
    assert order.oldest() == "b"
    order.set_evictable("a", True)  # unpinned: back in its original place
    assert order.oldest() == "a"
    assert order.evictable_weight == 3
    order.remove("a")
    assert order.oldest() == "b" and order.evictable() == ["b", "c"]


def make_cache(num_blocks: int = 8) -> tuple[EventBus, EmbeddingCache, list[tuple[str, list[Any]]]]:
    bus = EventBus()
    seen: list[tuple[str, list[Any]]] = []
    cache = EmbeddingCache(bus, num_blocks, observer=lambda v, o: seen.append((v, o)))
    return bus, cache, seen


def test_R_E04_entry_lifecycle_allocated_ready_pinned_ready_evicted() -> None:
    _, cache, _ = make_cache()
    entry = cache.reserve("h", 3, 24, "save", 0.0)
    assert entry is not None and entry.state == "allocated" and not cache.is_loadable("h")
    assert entry.has("awaiting_bytes") and not entry.has("evictable")
    cache.deliver("h", Saved(), 0.0)
    assert entry.state == "ready" and cache.is_loadable("h") and entry.has("evictable")
    cache.deliver("h", Pin(), 0.0)
    cache.deliver("h", Pin(), 0.0)
    assert entry.state == "pinned" and entry.ctx.pins == 2
    assert entry.has("loadable") and not entry.has("evictable")
    cache.deliver("h", Unpin(), 0.0)
    assert entry.state == "pinned"
    cache.deliver("h", Unpin(), 0.0)
    assert entry.state == "ready" and entry.ctx.pins == 0
    with pytest.raises(LocalProtocolError, match="'evict' is not declared in state 'allocated'"):
        cache.reserve("g", 1, 8, "save", 0.0)
        cache.deliver("g", Evict(), 0.0)
    cache.deliver("h", Evict(), 0.0)
    assert cache.entry("h") is None and cache.pool.free_count == 7
    cache.check()


def test_R_E04_eviction_is_fifo_among_ready_and_unpinned_only() -> None:
    _, cache, seen = make_cache(6)
    for key in ("a", "b", "c"):
        assert cache.reserve(key, 2, 16, "save", 0.0) is not None
    cache.deliver("b", Saved(), 0.0)
    cache.deliver("c", Saved(), 0.0)
    cache.deliver("a", Saved(), 0.0)
    cache.deliver("b", Pin(), 0.0)  # b is older than c but pinned
    assert cache.reserve("d", 2, 16, "save", 0.0) is not None
    assert [victim for victim, _ in seen] == ["a"]
    assert cache.reserve("e", 2, 16, "save", 0.0) is not None
    assert [victim for victim, _ in seen] == ["a", "c"]
    assert cache.state("b") == "pinned"
    cache.check()


def test_R_E04_no_eviction_for_a_reservation_that_cannot_succeed() -> None:
    _, cache, seen = make_cache(4)
    cache.reserve("a", 2, 16, "save", 0.0)
    cache.reserve("b", 2, 16, "save", 0.0)
    cache.deliver("a", Saved(), 0.0)
    assert cache.reserve("big", 3, 24, "save", 0.0) is None, "b is not ready: only 2 can be freed"
    assert seen == [] and cache.state("a") == "ready"
    assert cache.reserve("a", 1, 8, "save", 0.0) is None, "one entry per mm_hash"


def test_B01_evicting_a_published_unconsumed_encoding_is_announced() -> None:
    bus, cache, _ = make_cache(4)
    announced: list[EncodingEvicted] = []
    bus.handle(EncodingEvicted, lambda inst, e: announced.append(e))
    for key in ("pub", "quiet", "used"):
        cache.reserve(key, 1, 8, "save", 0.0)
        cache.deliver(key, Saved(), 0.0)
    cache.deliver("pub", Publish(), 0.0)
    cache.deliver("used", Publish(), 0.0)
    cache.deliver("used", Pin(), 0.0)
    cache.deliver("used", Unpin(consumed=True), 0.0)  # a peer's READ completed: consumed
    for key in ("pub", "quiet", "used"):
        cache.deliver(key, Evict(), 0.0)
    assert announced == [EncodingEvicted("pub", "evicted")]


def test_B01_discarding_a_published_save_is_announced() -> None:
    bus, cache, _ = make_cache(4)
    cache.reserve("h", 1, 8, "save", 0.0)
    cache.deliver("h", Publish(), 0.0)
    cache.deliver("h", Discard(), 0.0)
    assert effects(bus) == [EncodingEvicted("h", "discarded")]


# -- copy batch ------------------------------------------------------------------------


def test_R_E05_copy_batch_submitted_end_event_reported() -> None:
    bus = EventBus()
    bus.register(EC_COPY_BATCH)
    items = (CopyItem("h", (1, 2), 2),)
    bus.create(EC_COPY_BATCH, BatchCtx(1, direction="save", items=items), 0.0)
    bus.dispatch(EC_COPY_BATCH, 1, Submit(), 0.0)
    assert effects(bus) == [CopyBlocks("save", 1, items)]
    assert [inst.key for inst in bus.tagged(EC_COPY_BATCH, "in_flight")] == [1]
    bus.dispatch(EC_COPY_BATCH, 1, EndEvent(), 0.0)
    assert effects(bus) == [CopyLanded("save", 1, ("h",), True, (0,))]
    assert bus.has_tag(EC_COPY_BATCH, 1, "reportable")
    bus.dispatch(EC_COPY_BATCH, 1, Report(), 0.0)
    assert bus.get(EC_COPY_BATCH, 1) is None
    with pytest.raises(LocalProtocolError):
        bus.dispatch(EC_COPY_BATCH, 1, Report(), 0.0)


# -- request availability ----------------------------------------------------------------


def test_B05_lost_announced_encoding_with_rewritten_media_fails_cleanly() -> None:
    bus = isolated_bus()
    bus.register(EC_REQUEST)
    ctx = RequestCtx("r1", mm_hashes=("other", "h"), metadata_only=frozenset({"h"}))
    bus.create(EC_REQUEST, ctx, 0.0)
    bus.dispatch(EC_REQUEST, "r1", Settled("other"), 0.0)
    bus.dispatch(EC_REQUEST, "r1", FallBack("h", "NACK_MISSING"), 0.0)
    inst = bus.get(EC_REQUEST, "r1")
    assert inst is not None and inst.state == "failed" and inst.has("failed_cleanly")
    out = effects(bus)
    assert isinstance(out[0], FailRequest) and out[0].request_id == "r1"
    assert "NACK_MISSING" in out[0].reason and "metadata-only" in out[0].reason
    assert ReleaseSettlements("r1", ("other", "h")) in out, "its settlements are released"
    bus.dispatch(EC_REQUEST, "r1", Finished(), 0.0)
    assert bus.get(EC_REQUEST, "r1") is None


def test_B05_lost_encoding_with_media_falls_back_locally() -> None:
    bus = isolated_bus()
    bus.register(EC_REQUEST)
    inst = bus.create(EC_REQUEST, RequestCtx("r1", mm_hashes=("h", "g")), 0.0)
    bus.dispatch(EC_REQUEST, "r1", FallBack("h", "NACK_MISSING"), 0.0)
    bus.dispatch(EC_REQUEST, "r1", Available(), 0.0)
    assert inst.has("unsettled"), "g is not settled yet: it keeps waiting"
    bus.dispatch(EC_REQUEST, "r1", Settled("g"), 0.0)
    bus.dispatch(EC_REQUEST, "r1", Available(), 0.0)
    assert inst.state == "available" and inst.ctx.local == {"h": "NACK_MISSING"}
    assert inst.has("schedulable")


# -- worker region -------------------------------------------------------------------------


@pytest.mark.parametrize("writer", [True, False])
def test_R_E03_shutdown_closes_and_only_the_owner_unlinks(writer: bool) -> None:
    bus = EventBus()
    bus.register(EC_WORKER_REGION)
    bus.create(EC_WORKER_REGION, RegionCtx("r", writer=writer), 0.0)
    bus.dispatch(EC_WORKER_REGION, "r", Register(4096), 0.0)
    assert bus.has_tag(EC_WORKER_REGION, "r", "usable")
    bus.dispatch(EC_WORKER_REGION, "r", Shutdown(), 0.0)
    assert effects(bus) == [CloseRegion(unlink=writer)]


# -- transfers across worker ranks (R-T02, R-T06) ---------------------------------------


def transfer_bus(direction: str = "load", ranks: frozenset[int] = frozenset({0, 1})) -> EventBus:
    bus = isolated_bus()
    bus.register(EC_TRANSFER)
    ctx = TransferCtx(
        7,
        mm_hash="h",
        direction="load" if direction == "load" else "save",
        request_id="r",
        participants=ranks,
        pending=set(ranks),
    )
    bus.create(EC_TRANSFER, ctx, 0.0)
    assert bus.has_tag(EC_TRANSFER, 7, "staged")
    bus.dispatch(EC_TRANSFER, 7, Dispatch(), 0.0)
    return bus


def test_R_T06_a_load_unpins_only_after_every_rank_reported() -> None:
    bus = transfer_bus()
    bus.dispatch(EC_TRANSFER, 7, RankReported(1, True), 0.0)
    assert effects(bus) == [] and bus.has_tag(EC_TRANSFER, 7, "in_flight")
    bus.dispatch(EC_TRANSFER, 7, RankReported(0, True), 0.0)
    out = effects(bus)
    assert Emit(EC_CACHE_ENTRY, "h", Unpin()) in out
    assert bus.get(EC_TRANSFER, 7) is None


def test_R_T06_a_save_is_ready_when_its_writer_reported() -> None:
    bus = transfer_bus("save", frozenset({0}))
    bus.dispatch(EC_TRANSFER, 7, RankReported(0, True), 0.0)
    assert Emit(EC_CACHE_ENTRY, "h", Saved()) in effects(bus)


def test_R_T02_a_failed_rank_fails_the_load_after_the_last_report_B05() -> None:
    bus = transfer_bus()
    bus.dispatch(EC_TRANSFER, 7, RankReported(0, False), 0.0)
    assert effects(bus) == [], "rank 1 may still be reading: nothing is released yet"
    bus.dispatch(EC_TRANSFER, 7, RankReported(1, True), 0.0)
    out = effects(bus)
    assert Emit(EC_CACHE_ENTRY, "h", Unpin()) in out and LoadLost("r", "h") in out


def test_R_T02_a_second_report_of_one_rank_is_refused_and_changes_nothing() -> None:
    bus = transfer_bus()
    bus.dispatch(EC_TRANSFER, 7, RankReported(0, True), 0.0)
    with pytest.raises(RemoteProtocolError):
        bus.dispatch(EC_TRANSFER, 7, RankReported(0, True), 0.0)
    with pytest.raises(RemoteProtocolError):
        bus.dispatch(EC_TRANSFER, 7, RankReported(5, True), 0.0)
    inst = bus.get(EC_TRANSFER, 7)
    assert inst is not None and inst.ctx.pending == {1}
