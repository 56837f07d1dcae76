"""Hostile peers at the engine-facing API of the encoder-cache P2P tier (S-02, S-04, S-06),
over the seeded in-memory planes of `sim/ec/plane.py` on a virtual clock."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Any

import pytest
from test_ec_p2p_api import PRODUCER, consumer_request, produce, tokens_of

from kvhandoff.adapters.ec_side_consumer import ConsumerEdges
from kvhandoff.adapters.nixl.ec_reader import ECNixlReader
from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ, IssueRead, SendXferReq
from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.machines.ec.p2p import random_transfer_id
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.machines.runtime.rejections import OTHER_PEERS, RejectionLog
from kvhandoff.protocol.ec_status import XferStatus
from kvhandoff.protocol.ec_wire import XferAck, encode_xfer_ack
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.sim.ec.plane import BLOCK_BYTES, COMPAT, layout, transfer_config
from kvhandoff.sim.ec.plane import SimECPlane as Sim

EVIL = "evil.sim:6000"


def nack_for(transfer_id: str, mm_hash: str, status: XferStatus) -> bytes:
    return encode_xfer_ack(XferAck(mm_hash, status, transfer_id=transfer_id))


def test_S_02_an_ack_from_another_producer_changes_nothing() -> None:
    sim = Sim(11)
    params = produce(sim, "h", 3)
    scheduler = sim.consumer.scheduler
    assert not scheduler.ensure_cache_available(consumer_request("c1", params), 0, sim.clock.now)
    read = scheduler.consumer.read("h")  # type: ignore[union-attr]
    assert read is not None and read.has("awaiting_ack")
    forged = nack_for(read.ctx.transfer_id, "h", XferStatus.NACK_MISSING)
    with pytest.raises(RemoteProtocolError, match="the request went to"):
        scheduler.on_xfer_ack(forged, sim.clock.now, peer=EVIL)
    assert scheduler.consumer.read("h") is read and read.has("awaiting_ack")  # type: ignore[union-attr]
    assert scheduler.counters()["consumer_remote_errors"] == 1
    # The producer the request went to is still heard: its answer settles the read.
    scheduler.on_xfer_ack(forged, sim.clock.now, peer=PRODUCER)
    assert scheduler.consumer.read("h") is None  # type: ignore[union-attr]
    assert scheduler.local_reason("c1", "h") == "NACK_MISSING"


def test_S_02_transfer_ids_are_128_random_bits_by_default() -> None:
    ids = {random_transfer_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    scheduler = ECScheduler(
        transfer_config("ec_consumer", 8, engine_id="c"), layout(8), compat_hash=COMPAT
    )
    assert scheduler.consumer is not None
    assert scheduler.consumer.transfer_ids is random_transfer_id


@pytest.mark.parametrize("factor", [0, 2, 1000])
def test_S_04_an_announced_size_off_the_layout_reserves_and_evicts_nothing(factor: int) -> None:
    sim = Sim(12, consumer_blocks=4)
    params = produce(sim, "h", 2)
    tokens = tokens_of(params)
    params["h"]["size_bytes"] = tokens * BLOCK_BYTES * factor + (1 if factor == 2 else 0)
    scheduler = sim.consumer.scheduler
    free = scheduler.cache.pool.free_count
    req = consumer_request("c1", {"h": params["h"]})
    req = dataclasses.replace(req, mm_tokens=(tokens,))  # the request's own token count
    assert scheduler.ensure_cache_available(req, 0, sim.clock.now)  # encoded locally
    assert "size_bytes" in scheduler.local_reason("c1", "h")
    assert scheduler.bus.get(EC_CONSUMER_READ, "h") is None
    assert scheduler.cache.pool.free_count == free and scheduler.cache.evictions == 0


class FakeClient:
    """A DEALER whose replies are what a hostile producer sent."""

    def __init__(self, replies: list[bytes]) -> None:
        self.replies = replies
        self.disconnects = 0

    def poll_replies(self) -> list[bytes]:
        out, self.replies = self.replies, []
        return out

    def poll_events(self) -> None:
        return None


class Edges(ConsumerEdges):
    def __init__(self, scheduler: ECScheduler, clients: dict[tuple[str, int], Any]) -> None:
        self.scheduler = scheduler
        self.reader = None
        self.rejections = RejectionLog(logging.getLogger("kvhandoff.ec.side"), what="ack")
        self.read_outcomes = OrderedDict()
        self._clients = clients


def test_S_06_rejected_acks_are_counted_per_peer_and_warned_rate_limited(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = ECScheduler(
        transfer_config("ec_consumer", 8, engine_id="c"), layout(8), compat_hash=COMPAT
    )
    junk = [b"\x91" * 4000, b"\xc1", nack_for("nobody", "h", XferStatus.NACK_MISSING)]
    client = FakeClient(junk * 5)
    edges = Edges(scheduler, {("evil.sim", 6000): client})
    with caplog.at_level(logging.WARNING, logger="kvhandoff.ec.side"):
        assert edges._poll_clients(1.0) == 15  # nothing raised out of the step
        client.replies = list(junk)
        edges._poll_clients(2.0)
    assert edges.rejections.total == 18
    assert edges.rejections.count(EVIL) == 18
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, "one warning per peer per interval"


class StubAgent:
    """Enough of a `NixlAgent` for READs that never reach NIXL."""

    def prep_local_blocks(self, regions: list[tuple[int, int, int]]) -> object:
        return object()


def test_R_E08_a_READ_that_cannot_be_posted_is_reported_failed_once() -> None:
    reader = ECNixlReader(StubAgent(), 0, BLOCK_BYTES, 4, clock=VirtualClock())  # type: ignore[arg-type]
    bad = IssueRead(
        mm_hash="h",
        transfer_id="t1",
        peer_host="p",
        peer_port=1,
        producer_agent_name="agent",
        producer_agent_metadata=b"",
        remote_base_addr=0,
        src_blocks=(0,),
        dst_blocks=(1,),
        block_size_bytes=BLOCK_BYTES + 1,
        size_bytes=BLOCK_BYTES,
    )
    with pytest.raises(RemoteProtocolError, match="byte blocks"):
        reader.read(bad)
    reader.refused(dataclasses.replace(bad, mm_hash="g", transfer_id="t2"))  # a fault
    assert reader.in_flight() == 0 and reader.post_failures == 1
    assert reader.poll(lambda mm_hash, transfer_id: True) == [
        ("h", "t1", False),
        ("g", "t2", False),
    ]
    assert reader.poll(lambda mm_hash, transfer_id: True) == []


def _asked_sessions(scheduler: ECScheduler, peers: list[tuple[str, int]]) -> list[str]:
    sent: list[SendXferReq] = []
    scheduler.bus.handle(SendXferReq, lambda _inst, effect: sent.append(effect))
    for i, (host, port) in enumerate(peers):
        params = {
            f"img-{i}": {
                "metadata": {"m": 1},
                "peer_host": host,
                "peer_port": port,
                "size_bytes": BLOCK_BYTES,
            }
        }
        info = ECRequestInfo(f"r{i}", (f"img-{i}",), ec_transfer_params=params, mm_tokens=(1,))
        assert not scheduler.ensure_cache_available(info, 0, 0.0)
    return [effect.req.session_id for effect in sent]


def test_S_02_a_consumer_has_one_unguessable_session_per_producer() -> None:
    """A producer learns the consumer's session for itself only: it cannot name the
    consumer's grants on another producer (their READ notifs carry the session)."""
    peers = [("10.0.0.1", 5601), ("10.0.0.2", 5601), ("10.0.0.1", 5602), ("10.0.0.1", 5601)]
    scheduler = ECScheduler(
        transfer_config("ec_consumer", 8, engine_id="c"), layout(8), compat_hash=COMPAT
    )
    sessions = _asked_sessions(scheduler, peers)
    assert len(set(sessions[:3])) == 3, "one session per producer"
    assert sessions[3] == sessions[0], "stable for one producer, as vLLM's"
    assert all(len(s) == 32 and int(s, 16) >= 0 for s in sessions)
    again = ECScheduler(
        transfer_config("ec_consumer", 8, engine_id="c"), layout(8), compat_hash=COMPAT
    )
    assert set(_asked_sessions(again, peers)).isdisjoint(sessions), "random per consumer"


def test_S_06_the_rejection_log_keeps_naming_new_peers_after_invented_names(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer that invents 5,000 names fills no table for good: a real peer seen after it
    is still counted under its own name; lines are bounded and capped per interval."""
    rejections = RejectionLog(logging.getLogger("kvhandoff.test.rejections"), interval=10.0)
    with caplog.at_level(logging.WARNING, logger="kvhandoff.test.rejections"):
        for i in range(5000):
            rejections.reject(f"invented-{i}", "junk: " + "x" * 100_000, 1.0)
        rejections.reject("real-peer", "bad notif: y", 2.0)
        rejections.reject("real-peer", "bad notif: y", 12.0)  # the next interval
    assert rejections.count("real-peer") == 2
    assert rejections.total == 5002
    assert (
        rejections.count(OTHER_PEERS) + sum(rejections.count(f"invented-{i}") for i in range(5000))
        == 5000
    )
    assert rejections.reasons() == {"junk": 5000, "bad notif": 2}
    lines = [r.getMessage() for r in caplog.records]
    assert 1 <= len(lines) <= 2 * rejections.max_lines, "capped per interval in all"
    assert all(len(line) <= rejections.max_line_chars for line in lines)
    assert any("real-peer" in line for line in lines), "the real peer is heard next interval"
    assert any("suppressed" in line for line in lines), "what was suppressed is said"
