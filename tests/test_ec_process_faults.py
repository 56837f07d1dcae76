"""The encoder-cache P2P tier under real process faults (issue 8): kill -9 a peer mid-way,
then restart it.

Every request resolves within its deadlines (it falls back to local encoding, never
hangs); after a restart no `/dev/shm` region leaks (the dead owner's is reaped at start,
B-02) and no pinned grant outlives its lease (R-E12); a dead agent is forgotten (B-08).
"""

from __future__ import annotations

import os
import queue
from typing import Any

import pytest
from test_ec_integration import (
    CONSUMER_TIMEOUTS,
    PRODUCER_TIMEOUTS,
    encode,
    make_side,
    next_event,
    poll_until,
    pull,
    region_file,
    start_child,
    start_producer,
    stop,
    unique,
)

from kvhandoff.adapters.shm.region import reap_stale_regions
from kvhandoff.demo.ec_requests import BLOCK_BYTES, encoding, matches
from kvhandoff.demo.launcher import relay, stop_all
from kvhandoff.machines.ec.consumer_read import IssueRead
from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.machines.ec.producer_grant import SendXferAck

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("when", ["before_post", "after_post"])
def test_kill_producer_mid_read_resolves_then_restart_reaps_and_serves(when: str) -> None:
    """kill -9 the producer right after its OK ack: before our READ is posted (it fails),
    or right after (the READ may have landed, but the lost peer is usually seen first:
    the destination is quarantined and the request falls back). Either way the request
    resolves within its deadlines, with verified bytes or a local encoding. The dead
    producer's region is reaped by the next starter (B-02): a restart at the same address
    (which the consumer reads from again) or a plain reaping pass."""
    engine_id = unique("producer-k")
    doomed = start_producer(engine_id)
    port = doomed.ready["port"]
    with make_side("ec_consumer") as side:
        warm = pull(side, "img-warm", encode(doomed, "img-warm", 3), 3)
        assert warm.via == "p2p"
        params = encode(doomed, "img-doomed", 6)

        def kill() -> None:
            doomed.proc.kill()
            doomed.proc.wait()

        def fault_at_read(inst: Any, effect: IssueRead) -> None:
            if when == "before_post":
                kill()
            side.issue_read(inst, effect)
            if when == "after_post":
                kill()

        side.scheduler.bus.handle(IssueRead, fault_at_read)
        try:
            got = pull(side, "img-doomed", params, 6)
        finally:
            side.scheduler.bus.handle(IssueRead, side.issue_read)
        assert doomed.proc.poll() is not None
        if got.via == "p2p":  # the READ finished before the producer died
            assert when == "after_post" and got.tensor is not None
            assert matches("img-doomed", got.tensor)
        else:
            assert got.reason in ("read_failed", "peer_disconnected", "read_timeout"), got.reason

        def settled() -> bool:  # quarantine over (if any), handles released, agent gone
            side.poll()
            return (
                not side.scheduler.cache.has("img-doomed", "awaiting_bytes")
                and side.reads_in_flight() == 0
                and side.loaded_agents() == {}
            )

        poll_until(settled, CONSUMER_TIMEOUTS["read_quarantine_s"] + 10.0, "the read to settle")
        if when != "before_post":  # one restart is enough (it costs a process start)
            stale = os.path.basename(region_file(engine_id))
            assert stale in reap_stale_regions() or not os.path.exists(region_file(engine_id))
            return
        # SIGKILL left the dead producer's region in /dev/shm. The restart reaps it (B-02):
        # the new region takes the same name, which O_EXCL creation refuses while it exists.
        reborn = start_producer(engine_id, port)
        try:
            assert reborn.ready["region"] == region_file(engine_id)
            assert os.path.basename(region_file(engine_id)) in reborn.ready["reaped"] or (
                reborn.ready["reaped"] == []  # another starter reaped it first: still no leak
            )
            got = pull(side, "img-reborn", encode(reborn, "img-reborn", 6), 6)
            assert got.via == "p2p", got.reason
            assert got.tensor is not None and matches("img-reborn", got.tensor)
        finally:
            stop(reborn)
    assert not os.path.exists(region_file(engine_id)), "no region leaks after the restart"


def test_kill_consumer_after_its_grant_pin_released_by_lease_then_restart() -> None:
    """The consumer dies with a grant pinned for it (no XferDone will ever come): the pin
    lease releases it; a restarted consumer reaps its old region and reads normally."""
    lease = PRODUCER_TIMEOUTS["pin_lease_s"]
    with make_side("ec_producer", listen=("127.0.0.1", 0)) as side:
        side.encoder_cache["img-p"] = encoding("img-p", 4)
        info = ECRequestInfo(
            "r-img-p", ("img-p",), mm_metadata={"img-p": {"modality": "x"}}, mm_tokens=(4,)
        )
        side.scheduler.update_state_after_alloc(info, 0, side.clock())
        side.engine_step()
        params = side.scheduler.request_finished(info, side.clock())
        assert params["img-p"]["size_bytes"] == 4 * BLOCK_BYTES
        consumer_id = unique("consumer-k")
        doomed = start_child("consumer", consumer_id, "--relay", config=CONSUMER_TIMEOUTS)

        def kill_then_ack(inst: Any, effect: SendXferAck) -> None:
            if str(effect.ack.status) == "OK":
                doomed.proc.kill()  # the grant is pinned; its consumer is gone
                doomed.proc.wait()
            side.send_ack(inst, effect)

        side.scheduler.bus.handle(SendXferAck, kill_then_ack)
        relay(doomed, {"client": "c1", "mm_hash": "img-p", "tokens": 4, "params": params})

        producer = side.scheduler.producer
        assert producer is not None

        def granted() -> bool:  # (the entry is pinned from publication on, R-E06's hold)
            side.engine_step()
            return bool(producer.grants())

        poll_until(granted, 30, "the grant for the doomed consumer")
        side.scheduler.bus.handle(SendXferAck, side.send_ack)
        assert doomed.proc.poll() is not None

        def released() -> bool:
            side.engine_step()
            return side.scheduler.cache.state("img-p") == "ready"

        poll_until(released, lease + 10.0, "the pins released by the lease and the hold's end")
        metrics = side.scheduler.bus.metrics
        assert metrics.get("ec.producer.lease_expired") == 1
        assert side.scheduler.producer is not None and side.scheduler.producer.grants() == []

        reborn = start_child("consumer", consumer_id, "--relay", config=CONSUMER_TIMEOUTS)
        try:
            assert os.path.basename(region_file(consumer_id)) in reborn.ready["reaped"] or (
                reborn.ready["reaped"] == []
            )
            relay(reborn, {"client": "c2", "mm_hash": "img-p", "tokens": 4, "params": params})
            received: dict[str, Any] = {}

            def served() -> bool:
                side.engine_step()  # the producer answers from its own engine step
                try:
                    event = reborn.events.get_nowait()
                except queue.Empty:
                    return False
                if event["event"] == "received":
                    received.update(event)
                return bool(received)

            poll_until(served, 30.0, "the restarted consumer's read")
            assert received["via"] == "p2p" and received["verified"]
            relay(reborn, {"op": "stop"})
            summary = next_event(reborn, "summary", 30.0)
            assert summary["verified"] == 1
        finally:
            stop_all([reborn])
        assert not os.path.exists(region_file(consumer_id)), "no region leaks"
