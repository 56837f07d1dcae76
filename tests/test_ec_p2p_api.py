"""Engine-facing API of the encoder-cache P2P tier: a producer and a consumer over the
seeded in-memory planes of `sim/ec/plane.py` on a virtual clock, whose time every call
is given (issue 4). The local-tier halves are tested in `test_ec_api.py`."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest
from test_ec_api import META, NOW, request

from kvhandoff.machines.ec.cache_entry import EncodingEvicted
from kvhandoff.machines.ec.consumer_read import IssueRead, SendXferDone, SendXferReq
from kvhandoff.machines.ec.events import Saved
from kvhandoff.machines.ec.producer_grant import SendXferAck
from kvhandoff.machines.ec.request import EC_REQUEST
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.protocol.ec_publication import parse_ec_transfer_params
from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, XferStatus
from kvhandoff.protocol.ec_wire import (
    XferAck,
    XferDone,
    XferReq,
    decode_xfer_ack,
    encode_xfer_ack,
    encode_xfer_done,
    encode_xfer_req,
)
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.sim.ec.plane import BLOCK_BYTES, COMPAT, layout, transfer_config
from kvhandoff.sim.ec.plane import SimECPlane as Sim

# -- P2P: publication, reads, NACKs ------------------------------------------------------


def step_both(sim: Sim) -> None:
    sim.engine_step(sim.producer, [])
    sim.engine_step(sim.consumer, [])


PRODUCER = "producer.sim:5601"
"""The producer's side channel, as the consumer's DEALER to it names it."""


def produce(sim: Sim, mm_hash: str, tokens: int = 2, *, land: bool = True) -> dict[str, Any]:
    req = request(f"p-{mm_hash}", mm_hash, tokens=tokens, mm_metadata={mm_hash: META})
    sim.engine_step(sim.producer, [(req, 0)])
    if land:
        sim.advance(1.0, step=lambda: step_both(sim))
    return sim.producer.scheduler.request_finished(req, sim.clock.now)


def consume(
    sim: Sim, rid: str, params: dict[str, Any], *, metadata_only: bool = False, budget: float = 5.0
) -> bool:
    req = request(
        rid,
        *params,
        tokens=tokens_of(params),
        ec_transfer_params=params,
        metadata_only=frozenset(params) if metadata_only else frozenset(),
    )
    scheduler = sim.consumer.scheduler
    waited = 0.0
    while not scheduler.ensure_cache_available(req, 0, sim.clock.now):
        if scheduler.bus.has_tag(EC_REQUEST, rid, "failed_cleanly"):
            sim.consumer.failed.extend(scheduler.take_failed_requests())
            return False
        assert waited <= budget, f"{rid} still waits after {waited} s"
        sim.advance(0.1, step=lambda: step_both(sim))
        waited += 0.1
    return True


def tokens_of(params: dict[str, Any]) -> int:
    """The encoder tokens of the (first) published encoding: the consumer's own request
    names the same count (S-04)."""
    for entry in params.values():
        if isinstance(entry, dict) and isinstance(entry.get("size_bytes"), int):
            return max(1, entry["size_bytes"] // BLOCK_BYTES)
    return 2


def consumer_request(rid: str, params: dict[str, Any]) -> Any:
    return request(rid, *params, tokens=tokens_of(params), ec_transfer_params=params)


def test_R_E06_publication_metadata_and_address_together_or_neither() -> None:
    sim = Sim(1, producer_blocks=4)
    params = produce(sim, "h", 3)
    assert params == {
        "h": {
            "metadata": META,
            "peer_host": "producer.sim",
            "peer_port": 5601,
            "size_bytes": 24,
            "item_indices": [0],
            "shape": [3, layout(4).hidden_dim],
        }
    }
    parsed = parse_ec_transfer_params(params)["h"]
    assert parsed is not None and parsed.size_bytes == 3 * BLOCK_BYTES
    too_big = produce(sim, "big", 5)  # the region holds 4 blocks: never stored
    assert too_big == {"big": {"metadata": {}, "item_indices": [0]}}
    no_metadata = request("p-x", "h")  # resident, but the model gave no metadata
    assert sim.producer.scheduler.request_finished(no_metadata, sim.clock.now) == {
        "h": {"metadata": {}, "item_indices": [0]}
    }
    assert parse_ec_transfer_params(too_big) == {"big": None}


def test_R_E07_consumer_defers_until_the_read_completes() -> None:
    sim = Sim(2)
    params = produce(sim, "h", 3)
    req = consumer_request("c1", params)
    assert not sim.consumer.scheduler.ensure_cache_available(req, 0, sim.clock.now)
    assert sim.consumer.scheduler.consumer.read("h").state == "xfer_req_sent"  # type: ignore[union-attr]
    assert consume(sim, "c1", params)
    assert sim.consumer.scheduler.has_cache_item("h")
    assert sim.reads_landed == 1
    sim.advance(1.0, step=lambda: step_both(sim))  # the XferDone reaches the producer
    entry = sim.producer.scheduler.cache.entry("h")
    assert entry is not None and entry.state == "ready" and entry.ctx.consumed


def test_R_E08_not_ready_retries_next_step_and_evicts_nothing_B04() -> None:
    sim = Sim(3, consumer_blocks=4, copy_delay=(3.0, 3.0))
    scheduler = sim.consumer.scheduler
    for filler in ("f1", "f2"):  # fill the consumer's tier with ready entries
        scheduler.cache.reserve(filler, 1, BLOCK_BYTES, "save", sim.clock.now)
        scheduler.cache.deliver(filler, Saved(), sim.clock.now)
    params = produce(sim, "h", 2, land=False)  # the producer's save lands in 3 s
    assert consume(sim, "c1", params)
    retries = sum(1 for _, _, status in sim.delivered_acks if status == "NACK_NOT_READY")
    assert retries >= 2, "the consumer asked again on later steps"
    assert scheduler.counters()["evictions"] == 0, "no ready entry evicted per retry (B-04)"
    assert scheduler.cache.state("f1") == scheduler.cache.state("f2") == "ready"
    assert sim.consumer.failed == [] and sim.remote_errors == []


def test_R_E08_missing_encoding_falls_back_locally() -> None:
    sim = Sim(4)
    params = produce(sim, "h")
    sim.restart_producer()  # the new producer does not hold h
    assert consume(sim, "c1", params)
    assert not sim.consumer.scheduler.has_cache_item("h")
    assert sim.consumer.scheduler.local_reason("c1", "h") == "NACK_MISSING"
    assert sim.consumer.scheduler.cache.pool.free_count == 16, "destination freed"


def test_R_E12_ack_timeout_falls_back_and_quarantine_keeps_the_destination() -> None:
    sim = Sim(5, consumer_blocks=2)
    params = produce(sim, "h", 2)
    sim.drop_next = 1  # the XferReq is lost
    assert consume(sim, "c1", params, budget=2.5)
    assert sim.consumer.scheduler.local_reason("c1", "h") == "ack_timeout"
    sim.read_faults.append("hang")
    assert consume(sim, "c2", params, budget=21.0)
    scheduler = sim.consumer.scheduler
    assert scheduler.consumer.read("h").state == "quarantined"  # type: ignore[union-attr]
    assert scheduler.cache.state("h") == "allocated" and scheduler.cache.pool.free_count == 0
    sim.advance(59.0, step=lambda: step_both(sim))
    assert scheduler.cache.state("h") == "allocated", "not evicted during quarantine"
    sim.advance(2.0, step=lambda: step_both(sim))
    assert scheduler.cache.state("h") is None and scheduler.cache.pool.free_count == 2


def test_R_E12_unclaimed_grant_is_unpinned_after_the_lease() -> None:
    sim = Sim(6)
    produce(sim, "h")
    ack = producer_answers(sim, encode_xfer_req(a_request()))  # a consumer that never reads
    assert ack.status is XferStatus.OK and ack.lease_s == 30.0
    entry = sim.producer.scheduler.cache.entry("h")
    assert entry is not None and entry.state == "pinned"
    sim.advance(29.9, step=lambda: step_both(sim))
    assert entry.state == "pinned"
    sim.advance(0.2, step=lambda: step_both(sim))
    assert entry.state == "ready" and not entry.ctx.consumed
    assert sim.producer.scheduler.producer.grants() == []  # type: ignore[union-attr]


def test_R_E11_restarted_producer_is_read_with_the_metadata_of_its_ack() -> None:
    sim = Sim(7)
    produce(sim, "old")
    sim.restart_producer()
    params = produce(sim, "h")
    reads: list[Any] = []
    handler = sim.consumer.scheduler.bus._handlers[IssueRead]
    sim.consumer.scheduler.bus.handle(IssueRead, lambda i, e: (reads.append(e), handler(i, e)))
    assert consume(sim, "c1", params)
    assert reads[0].producer_agent_metadata == b"md-producer-1"
    assert sim.consumer.scheduler.has_cache_item("h")


# -- B-01, B-05 ----------------------------------------------------------------------------


def test_B01_eviction_of_a_published_encoding_is_announced_to_the_orchestrator() -> None:
    sim = Sim(8, producer_blocks=4)
    produce(sim, "a", 2)  # held (R-E06): half of the tier
    produce(sim, "b", 2)  # holds pin at most half of the tier: published unheld
    produce(sim, "c", 2)  # evicts b, FIFO among the unpinned
    assert sim.producer.evicted == [EncodingEvicted("b", "evicted")]
    assert sim.producer.scheduler.counters()["publications_unheld"] == 2  # b and c


def test_R_E06_B01_a_published_encoding_is_held_until_read_or_producer_publish_pin_s() -> None:
    sim = Sim(8, producer_blocks=8, machine_config={"producer_publish_pin_s": 10.0})
    scheduler = sim.producer.scheduler
    params = produce(sim, "a", 2)
    for name in ("b", "c", "d", "e"):  # pressure past the tier: FIFO would take a first
        produce(sim, name, 2)
    assert scheduler.cache.state("a") == "pinned", "held: eviction took the others first"
    assert EncodingEvicted("a", "evicted") not in sim.producer.evicted
    assert consume(sim, "r-a", params), "a consumer that asks promptly is served"
    # Its completed READ ended the hold: the entry is evictable again, as before.
    sim.advance(0.5, step=lambda: step_both(sim))
    assert scheduler.cache.state("a") == "ready"
    assert scheduler.counters()["publication_holds"] <= 1
    # A publication nobody reads is held for producer_publish_pin_s, then let go.
    produce(sim, "f", 2)
    assert scheduler.cache.state("f") == "pinned"
    sim.advance(10.5, step=lambda: step_both(sim))
    assert scheduler.cache.state("f") == "ready" and scheduler.counters()["publication_holds"] == 0


def test_B05_lost_encoding_with_rewritten_media_fails_the_request_cleanly() -> None:
    sim = Sim(9)
    params = produce(sim, "h")
    sim.restart_producer()
    assert not consume(sim, "c1", params, metadata_only=True)
    (failure,) = sim.consumer.failed
    assert failure.request_id == "c1" and "NACK_MISSING" in failure.reason
    assert not sim.consumer.scheduler.ensure_cache_available(request("c1", "h"), 0, sim.clock.now)
    sim.consumer.scheduler.request_finished(request("c1", "h"), sim.clock.now)
    assert sim.consumer.scheduler.bus.get(EC_REQUEST, "c1") is None


# -- bad input ------------------------------------------------------------------------------


def a_request(**overrides: Any) -> XferReq:
    fields: dict[str, Any] = {
        "version": EC_CONNECTOR_VERSION,
        "transfer_id": "t1",
        "mm_hash": "h",
        "compat_hash": COMPAT,
        "consumer_engine_id": "c",
        "consumer_agent_name": "c",
        "num_blocks": 2,
        "size_bytes": 2 * BLOCK_BYTES,
    }
    fields.update(overrides)
    return XferReq(**fields)


def producer_answers(sim: Sim, data: bytes) -> XferAck:
    sent: list[SendXferAck] = []
    sim.producer.scheduler.bus.handle(SendXferAck, lambda i, e: sent.append(e))
    sim.producer.scheduler.on_producer_message(b"peer", data, sim.clock.now)
    (effect,) = sent
    return decode_xfer_ack(encode_xfer_ack(effect.ack))


@pytest.mark.parametrize(
    ("overrides", "status"),
    [
        ({"version": 7}, XferStatus.NACK_VERSION),
        ({"compat_hash": "f" * 64}, XferStatus.NACK_INCOMPAT),
        ({"mm_hash": "unknown"}, XferStatus.NACK_MISSING),
    ],
)
def test_R_E09_R_E10_bad_requests_get_the_right_nack(
    overrides: dict[str, Any], status: XferStatus
) -> None:
    sim = Sim(10)
    produce(sim, "h")
    before = sim.producer.scheduler.cache.state("h")
    data = encode_xfer_req(a_request(**overrides))
    assert producer_answers(sim, data).status is status
    assert sim.producer.scheduler.cache.state("h") == before, "no state change"
    assert sim.producer.scheduler.bus.metrics[f"ec.producer.{status}"] == 1.0


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"\x93\x01\x02\x03",
        encode_xfer_ack(XferAck("h", XferStatus.OK, transfer_id="t")),
    ],
)
def test_R_E09_malformed_producer_input_is_a_counted_remote_error(data: bytes) -> None:
    sim = Sim(11)
    produce(sim, "h")
    with pytest.raises(RemoteProtocolError):
        sim.producer.scheduler.on_producer_message(b"peer", data, sim.clock.now)
    assert sim.producer.scheduler.counters()["producer_remote_errors"] == 1
    assert sim.producer.scheduler.producer.grants() == []  # type: ignore[union-attr]


def test_R_E09_duplicate_transfer_and_unknown_done_are_remote_errors() -> None:
    sim = Sim(12)
    produce(sim, "h")
    sim.producer.scheduler.on_producer_message(b"peer", encode_xfer_req(a_request()), sim.clock.now)
    with pytest.raises(RemoteProtocolError, match="already granted"):
        sim.producer.scheduler.on_producer_message(
            b"peer", encode_xfer_req(a_request()), sim.clock.now
        )
    done = XferDone(mm_hash="h", transfer_id="t1", ok=True)
    with pytest.raises(RemoteProtocolError, match="no live grant"):
        sim.producer.scheduler.on_producer_message(
            b"other-peer", encode_xfer_done(done), sim.clock.now
        )
    assert sim.producer.scheduler.counters()["producer_remote_errors"] == 2
    assert sim.producer.scheduler.cache.state("h") == "pinned", "the real grant is untouched"


def test_R_E08_malformed_or_unknown_acks_are_counted_and_change_nothing() -> None:
    sim = Sim(13)
    params = produce(sim, "h")
    sim.drop_next = 1
    scheduler = sim.consumer.scheduler
    scheduler.ensure_cache_available(consumer_request("c1", params), 0, sim.clock.now)
    read = scheduler.consumer.read("h")  # type: ignore[union-attr]
    assert read is not None and read.state == "xfer_req_sent"
    tid = read.ctx.transfer_id
    assert len(tid) == 32 and int(tid, 16) >= 0, "128 random bits: nobody guesses it (S-02)"
    bad_status = msgspec.msgpack.encode({"type": "ack", "mm_hash": "h", "status": 9})
    cases = [
        b"junk",
        bad_status,  # unknown status
        encode_xfer_ack(XferAck("unknown", XferStatus.NACK_MISSING, transfer_id=tid)),
        encode_xfer_ack(XferAck("h", XferStatus.NACK_MISSING, transfer_id="someone-else")),
    ]
    for data in cases:
        with pytest.raises(RemoteProtocolError):
            scheduler.on_xfer_ack(data, sim.clock.now, peer=PRODUCER)
    assert scheduler.counters()["consumer_remote_errors"] == len(cases)
    assert read.state == "xfer_req_sent" and read.ctx.transfer_id == tid
    not_ready = XferAck("h", XferStatus.NACK_NOT_READY, transfer_id=tid)
    scheduler.on_xfer_ack(encode_xfer_ack(not_ready), sim.clock.now, peer=PRODUCER)
    scheduler.build_connector_meta(sim.clock.now)  # the next step asks again, a fresh id
    assert read.ctx.transfer_id != tid and read.ctx.past_ids == [tid]
    scheduler.on_xfer_ack(encode_xfer_ack(not_ready), sim.clock.now, peer=PRODUCER)
    assert scheduler.counters()["stale_acks"] == 1, "an earlier attempt's ack is only stale"


def test_R_E08_wrong_version_ack_falls_back() -> None:
    sim = Sim(14)
    params = produce(sim, "h")
    sim.ack_faults.append("NACK_VERSION")
    assert consume(sim, "c1", params)
    assert sim.consumer.scheduler.local_reason("c1", "h") == "NACK_VERSION"


def test_R_E06_malformed_ec_transfer_params_are_counted_and_encoded_locally() -> None:
    sim = Sim(15)
    half = {"h": {"metadata": META, "peer_host": "p"}}
    assert consume(sim, "c1", half)  # type: ignore[arg-type]
    assert sim.consumer.scheduler.counters()["bad_params"] == 1
    assert not consume(sim, "c2", half, metadata_only=True)  # type: ignore[arg-type]
    assert "malformed ec_transfer_params" in sim.consumer.failed[0].reason


def test_R_E07_a_landed_read_is_held_for_its_waiting_requests() -> None:
    sim = Sim(16, consumer_blocks=3)
    params = produce(sim, "h", 3)
    scheduler = sim.consumer.scheduler
    assert not scheduler.ensure_cache_available(consumer_request("c1", params), 0, sim.clock.now)
    sim.advance(2.0, step=lambda: step_both(sim))  # the read lands; c1 has not come back
    assert scheduler.cache.state("h") == "pinned", "held: pressure cannot evict it first"
    scheduler.cache.reserve("x", 3, 24, "save", sim.clock.now)
    assert scheduler.cache.state("h") == "pinned"
    assert scheduler.ensure_cache_available(consumer_request("c1", params), 0, sim.clock.now)


def test_B05_synchronous_send_failure_fails_a_rewritten_request_without_crashing() -> None:
    config = transfer_config("ec_consumer", 8, engine_id="c")
    scheduler = ECScheduler(config, layout(8), compat_hash=COMPAT)
    # A ZMQ adapter whose connect is refused reports the disconnect from inside the send.
    scheduler.bus.handle(
        SendXferReq, lambda inst, e: scheduler.on_peer_disconnected(e.peer_host, e.peer_port, NOW)
    )
    entry = {"metadata": META, "peer_host": "p", "peer_port": 1, "size_bytes": 8}
    req = request(
        "r",
        "a",
        "b",
        tokens=1,
        ec_transfer_params={"a": entry, "b": entry},
        metadata_only=frozenset("ab"),
    )
    assert not scheduler.ensure_cache_available(req, 0, NOW)
    (failure,) = scheduler.take_failed_requests()
    assert "peer_disconnected" in failure.reason
    assert scheduler.cache.pool.free_count == 8
    assert not scheduler.ensure_cache_available(req, 0, NOW), "stays failed until finished"


def test_R_E12_an_ack_that_arrives_after_its_timeout_starts_no_read() -> None:
    """Found by `kvhandoff simulate ec`: the consumer stalled while a grant's OK ack
    waited in its socket; on waking it must not READ a grant whose lease may be over.
    Every inbound message meets machines whose due timeouts have already fired."""
    sim = Sim(17)
    params = produce(sim, "h", 2)
    req = consumer_request("c1", params)
    scheduler = sim.consumer.scheduler
    assert not scheduler.ensure_cache_available(req, 0, sim.clock.now)  # the XferReq is sent
    read = scheduler.consumer.read("h")  # type: ignore[union-attr]
    assert read is not None and read.state == "xfer_req_sent"
    ack = producer_answers(sim, encode_xfer_req(read.ctx.request()))
    assert ack.status is XferStatus.OK
    sim.clock.advance(31.0)  # the consumer stalls past its ack timeout and the lease
    sent: list[SendXferDone] = []
    scheduler.bus.handle(SendXferDone, lambda inst, e: sent.append(e))
    with pytest.raises(RemoteProtocolError, match="answers no request"):  # a stale ack
        scheduler.on_xfer_ack(encode_xfer_ack(ack), sim.clock.now, peer=PRODUCER)
    assert read.state == "fallback_local" and read.ctx.reason == "ack_timeout"
    assert sim.reads_started == 0, "no READ of a grant whose lease may be over"
    (done,) = sent  # the late OK is released at once, not after the 30 s lease
    assert (done.done.transfer_id, done.done.ok) == (ack.transfer_id, False)


def test_C_03_stock_consumer_grant_released_by_read_notif_and_hostile_notifs_counted() -> None:
    """A stock vLLM consumer's request (no transfer id) is granted under its session; the
    NIXL notif `<session_id>:<mm_hash>` its READ carries releases the grant once; a notif
    that is not UTF-8 or names nothing is counted, never raised past the adapter."""
    sim = Sim(31)
    produce(sim, "h")
    scheduler = sim.producer.scheduler
    stock = XferReq("h", COMPAT, "sess-9")
    ack = producer_answers(sim, encode_xfer_req(stock))
    assert ack.status is XferStatus.OK and ack.session_id == "sess-9"
    assert ack.mem_descriptor, "a consumer without `region_base` gets vLLM's descriptor list"
    assert sim.producer.scheduler.cache.state("h") == "pinned"
    # Asked again under the same session (its ack wait ran out): the old pin goes first.
    producer_answers(sim, encode_xfer_req(stock))
    assert scheduler.producer.superseded == 1  # type: ignore[union-attr]
    assert scheduler.on_read_notif("agent-c", b"sess-9:h", sim.clock.now)
    assert sim.producer.scheduler.cache.state("h") == "ready", "unpinned, once"
    assert not scheduler.on_read_notif("agent-c", b"sess-9:h", sim.clock.now)  # late
    for junk in (b"\xff\xfe", b"no-colon", b"x" * 600):
        with pytest.raises(RemoteProtocolError):
            scheduler.on_read_notif("evil", junk, sim.clock.now)
    counters = scheduler.producer  # type: ignore[union-attr]
    assert counters is not None and (counters.late_notifs, counters.remote_errors) == (1, 3)


def test_R_E07_an_input_already_computed_triggers_no_remote_read() -> None:
    """vLLM 0.33: a feature whose positions the engine computed (`num_computed_tokens`
    at or past its end) is not read from the producer; the request is schedulable."""
    sim = Sim(41)
    params = produce(sim, "h", 2)
    scheduler = sim.consumer.scheduler
    asked: list[SendXferReq] = []
    scheduler.bus.handle(SendXferReq, lambda _inst, effect: asked.append(effect))
    req = dataclasses.replace(
        request("c1", *params, tokens=tokens_of(params), ec_transfer_params=params),
        mm_ends=(10,),
    )
    assert scheduler.ensure_cache_available(req, 10, sim.clock.now)
    assert scheduler.consumer is not None and not scheduler.consumer.has_reads()
    assert asked == [] and scheduler.local_reason("c1", "h") == ""
    fresh = dataclasses.replace(req, request_id="c2")
    assert not scheduler.ensure_cache_available(fresh, 9, sim.clock.now), "one token short"
    assert scheduler.consumer.has_reads() and len(asked) == 1
