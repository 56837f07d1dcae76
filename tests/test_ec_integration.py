"""The encoder-cache P2P tier over real NIXL (UCX, DRAM) and real ZMQ, between processes.

The test process runs one instance as an `ECSide` and steps its engine loop itself; the
other is a `kvhandoff run producer|consumer` child, driven with JSON lines on stdin.
Every wait is bounded polling of the engine step against a deadline, never a sleep used
as synchronisation; the timeouts that settle a request are the protocol's own, made
short through the extra config.
"""

from __future__ import annotations

import itertools
import json
import os
import secrets
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest
import torch

from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.demo.ec_requests import BLOCK_BYTES, COMPAT, DTYPE, HIDDEN, encoding, matches
from kvhandoff.demo.launcher import RoleProcess, relay, start_role, stop_all, wait_ready
from kvhandoff.machines.ec.consumer_read import SendXferReq
from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.protocol.ec_config import ECLayout, ECRole, ECTransferConfig
from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, compatibility_hash
from kvhandoff.protocol.ec_wire import XferAck, encode_xfer_ack, encode_xfer_req

pytestmark = pytest.mark.integration

NUM_BLOCKS = 64  # what `kvhandoff run producer --requests 0` allocates
CONSUMER_TIMEOUTS = {
    "consumer_ack_timeout_s": 2.5,
    "nixl_read_timeout_s": 5.0,
    "read_quarantine_s": 1.0,
    "zmq_heartbeat_timeout_s": 10.0,  # a SIGSTOPped producer is found by the ack wait
    "zmq_heartbeat_ttl_s": 20.0,
}
PRODUCER_TIMEOUTS = {"pin_lease_s": 2.0}
_ids = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"


def poll_until(step: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Step until `step()` is true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not step():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.0005)  # yield the CPU to the peer process between engine steps


# -- the in-process side -----------------------------------------------------------------


def make_side(
    role: ECRole,
    engine_id: str | None = None,
    *,
    compat: str = COMPAT,
    listen: tuple[str, int] | None = None,
    **extra: Any,
) -> ECSide:
    timeouts = CONSUMER_TIMEOUTS if role == "ec_consumer" else PRODUCER_TIMEOUTS
    config = ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role=role,
        ec_connector_extra_config={
            "ec_cpu_bytes": NUM_BLOCKS * BLOCK_BYTES,
            "ec_enable_nixl": True,
            **timeouts,
            **extra,
        },
        engine_id=engine_id or unique(role.removeprefix("ec_")),
    )
    layout = ECLayout(HIDDEN, 2, NUM_BLOCKS * BLOCK_BYTES)
    return ECSide(config, layout, compat_hash=compat, listen=listen)


@dataclass
class Pulled:
    via: str
    """`p2p` (loaded from the tier after a READ) or `local` (encoded here)."""
    reason: str
    tensor: torch.Tensor | None
    not_ready: int
    attempts: int
    elapsed_s: float


def pull(
    side: ECSide,
    mm_hash: str,
    params: dict[str, Any] | None,
    tokens: int,
    timeout_s: float = 30,
) -> Pulled:
    """One consumer request for `mm_hash`, stepped like an engine until it is served."""
    sched = side.scheduler
    info = ECRequestInfo(
        f"req-{next(_ids)}", (mm_hash,), ec_transfer_params=params, mm_tokens=(tokens,)
    )
    start = time.monotonic()

    def available() -> bool:
        side.engine_step()
        return sched.ensure_cache_available(info, 0, side.clock())

    poll_until(available, timeout_s, f"{mm_hash} to be available or settled locally")
    elapsed = time.monotonic() - start
    outcome = side.read_outcomes.get(mm_hash)
    not_ready = outcome.not_ready if outcome else 0
    attempts = outcome.attempts if outcome else 0
    if not sched.has_cache_item(mm_hash):
        reason = sched.local_reason(info.request_id, mm_hash)
        sched.request_finished(info, side.clock())
        return Pulled("local", reason, None, not_ready, attempts, elapsed)
    side.encoder_cache[mm_hash] = torch.empty(tokens, HIDDEN, dtype=DTYPE)
    sched.update_state_after_alloc(info, 0, side.clock())
    loaded: set[str] = set()

    def landed() -> bool:
        loaded.update(side.engine_step().loaded)
        return mm_hash in loaded

    poll_until(landed, timeout_s, f"{mm_hash} loaded from the tier")
    sched.request_finished(info, side.clock())
    tensor = side.encoder_cache.pop(mm_hash)
    return Pulled("p2p", "", tensor, not_ready, attempts, elapsed)


# -- the child processes -----------------------------------------------------------------


def start_child(role: str, engine_id: str, *args: str, config: dict[str, Any]) -> RoleProcess:
    argv = ["run", role, "--engine-id", engine_id, "--requests", "0", "--deadline", "300"]
    proc = start_role(role, [*argv, "--config", json.dumps(config), *args])
    wait_ready(proc, 120.0)
    return proc


def start_producer(engine_id: str | None = None, port: int = 0) -> RoleProcess:
    return start_child(
        "producer",
        engine_id or unique("producer"),
        "--listen",
        f"127.0.0.1:{port}",
        config=PRODUCER_TIMEOUTS,
    )


def next_event(
    proc: RoleProcess,
    kind: str,
    timeout_s: float = 30.0,
    where: Callable[[dict[str, Any]], bool] = lambda e: True,
) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (event := proc.next_event(deadline)) is not None:
        if event["event"] == kind and where(event):
            return event
        if event["event"] == "exit":
            break
    raise AssertionError(f"no {kind!r} event from {proc.name}: {proc.stderr_tail[-5:]}")


def encode(proc: RoleProcess, mm_hash: str, tokens: int = 6, *, hold: float = 0.0) -> Any:
    """The producer child encodes `mm_hash`, saves it, publishes it: its params."""
    command = {"op": "encode", "client": f"c-{mm_hash}", "mm_hash": mm_hash}
    relay(proc, {**command, "tokens": tokens, "hold": hold})
    return next_event(proc, "finished", where=lambda e: e["mm_hash"] == mm_hash)["params"]


def status(proc: RoleProcess) -> dict[str, Any]:
    relay(proc, {"op": "status"})
    return next_event(proc, "status")


def stop(proc: RoleProcess, timeout_s: float = 60.0) -> dict[str, Any]:
    """Stop the role and take its summary: it settles first (grants, holds, reads), so
    `timeout_s` must outlast what it still holds."""
    relay(proc, {"op": "stop"})
    summary = next_event(proc, "summary", timeout_s)
    stop_all([proc])
    return summary


def region_file(engine_id: str) -> str:
    return f"/dev/shm/kvhandoff_ec_{engine_id}_dp0.mmap"


@pytest.fixture(scope="module")
def producer() -> Iterator[RoleProcess]:
    proc = start_producer()
    yield proc
    if proc.proc.poll() is None:
        os.kill(proc.proc.pid, signal.SIGCONT)
        stop(proc)


@pytest.fixture(scope="module")
def consumer() -> Iterator[ECSide]:
    with make_side("ec_consumer") as side:
        yield side


# -- the exchanges -----------------------------------------------------------------------


def test_R_E06_R_E07_R_E11_ok_read_over_nixl_verifies_every_byte(
    producer: RoleProcess, consumer: ECSide
) -> None:
    params = encode(producer, "img-ok", 7)
    entry = params["img-ok"]
    assert entry["peer_port"] == producer.ready["port"] and entry["size_bytes"] == 7 * BLOCK_BYTES
    got = pull(consumer, "img-ok", params, 7)
    assert got.via == "p2p" and got.attempts == 1 and got.not_ready == 0
    assert got.tensor is not None and matches("img-ok", got.tensor)
    assert consumer.reads_in_flight() == 0
    # XferDone released the producer's pin at once: no grant lives on, the entry is ready.
    poll_until(lambda: status(producer)["grants"] == {}, 10, "the grant released by XferDone")
    report = status(producer)
    assert report["entries"]["img-ok"] == "ready"
    # kvhandoff to kvhandoff keeps its extensions (C-04): the grant ended with XferDone,
    # and the READ carried no notif (that is how a stock vLLM producer is released).
    assert report["metrics"].get("ec.producer.notif", 0) == 0


def test_R_E08_B_04_not_ready_then_ok_keeps_the_destination(
    producer: RoleProcess, consumer: ECSide
) -> None:
    """Published before its save landed: NACK_NOT_READY, retried next step with the same
    destination blocks (B-04), then read once the save lands."""
    params = encode(producer, "img-slow", 5, hold=20.0)  # until it answered NOT_READY
    seen: list[tuple[int, ...]] = []

    def watch(_inst: Any, effect: SendXferReq) -> None:
        entry = consumer.scheduler.cache.entry("img-slow")
        assert entry is not None and entry.has("awaiting_bytes")
        seen.append(entry.ctx.blocks)
        consumer.send_xfer_req(_inst, effect)

    consumer.scheduler.bus.handle(SendXferReq, watch)
    try:
        got = pull(consumer, "img-slow", params, 5)
    finally:
        consumer.scheduler.bus.handle(SendXferReq, consumer.send_xfer_req)
    assert got.via == "p2p" and got.not_ready >= 1 and got.attempts == got.not_ready + 1
    assert len(seen) == got.attempts and len(set(seen)) == 1, "one reservation for all tries"
    assert got.tensor is not None and matches("img-slow", got.tensor)
    assert next_event(producer, "save_released")["mm_hash"] == "img-slow"


def test_R_E08_missing_encoding_falls_back_to_local_encoding(
    producer: RoleProcess, consumer: ECSide
) -> None:
    params = {
        "img-never": {
            "metadata": {"modality": "image"},
            "peer_host": "127.0.0.1",
            "peer_port": producer.ready["port"],
            "size_bytes": 4 * BLOCK_BYTES,
        }
    }
    got = pull(consumer, "img-never", params, 4)
    assert (got.via, got.reason) == ("local", "NACK_MISSING")
    assert consumer.scheduler.cache.state("img-never") is None, "the destination was freed"


def test_R_E10_incompatible_consumer_is_nacked(producer: RoleProcess) -> None:
    params = encode(producer, "img-incompat", 3)
    other_model = compatibility_hash("kvhandoff-demo", "another-encoder", "bfloat16", BLOCK_BYTES)
    with make_side("ec_consumer", compat=other_model) as side:
        got = pull(side, "img-incompat", params, 3)
    assert (got.via, got.reason) == ("local", "NACK_INCOMPAT")


def test_R_E09_foreign_connector_version_is_nacked(producer: RoleProcess, consumer: ECSide) -> None:
    """A consumer of another connector version: the real producer answers NACK_VERSION."""
    params = encode(producer, "img-version", 3)

    def foreign(inst: Any, effect: SendXferReq) -> None:
        req = msgspec.structs.replace(effect.req, version=EC_CONNECTOR_VERSION + 1)
        consumer.send_xfer_req(inst, SendXferReq(effect.peer_host, effect.peer_port, req))

    consumer.scheduler.bus.handle(SendXferReq, foreign)
    try:
        got = pull(consumer, "img-version", params, 3)
    finally:
        consumer.scheduler.bus.handle(SendXferReq, consumer.send_xfer_req)
    assert (got.via, got.reason) == ("local", "NACK_VERSION")


def test_R_E12_ack_timeout_falls_back_and_the_late_grant_is_released_at_once(
    producer: RoleProcess, consumer: ECSide
) -> None:
    """A producer that is alive but silent (SIGSTOP): the ack wait (2.5 s here) settles
    the request locally; the OK it sends once resumed is answered with an XferDone, so
    the producer unpins at once instead of after its pin lease."""
    params = encode(producer, "img-silent", 4)
    os.kill(producer.proc.pid, signal.SIGSTOP)
    try:
        got = pull(consumer, "img-silent", params, 4)
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
    assert (got.via, got.reason) == ("local", "ack_timeout")  # not a later deadline
    assert consumer.scheduler.cache.state("img-silent") is None

    def released() -> bool:
        consumer.poll()  # the late OK ack arrives: refused, and its grant released
        snapshot = status(producer)
        # Wait for the consumer to have answered the late OK too: on a busy host the
        # producer's short pin lease may free the grant before that OK is read here.
        answered = consumer.counters()["unused_grants_released"] >= 1
        return (
            answered
            and snapshot["grants"] == {}
            and snapshot["entries"].get("img-silent") == "ready"
        )

    poll_until(released, 20, "the late grant released by an XferDone")
    assert consumer.counters()["unused_grants_released"] >= 1
    assert consumer.counters()["rejected"] >= 1


def test_R_E08_B_08_peer_disconnect_falls_back_and_forgets_the_agent() -> None:
    """A producer killed while the consumer waits for its ack: the DEALER's disconnect
    settles the request long before the (20 s) ack wait; the dead agent is forgotten."""
    proc = start_producer()
    try:
        with make_side("ec_consumer", consumer_ack_timeout_s=20.0) as side:
            first = pull(side, "img-before", encode(proc, "img-before", 3), 3)
            assert first.via == "p2p" and side.loaded_agents()
            params = encode(proc, "img-cut", 3)
            os.kill(proc.proc.pid, signal.SIGSTOP)  # alive but mute: the XferReq waits

            def kill_after_send(inst: Any, effect: SendXferReq) -> None:
                side.send_xfer_req(inst, effect)
                proc.proc.kill()

            side.scheduler.bus.handle(SendXferReq, kill_after_send)
            got = pull(side, "img-cut", params, 3)
            # settled by the disconnect, not by the 20 s ack wait
            assert (got.via, got.reason) == ("local", "peer_disconnected")
            assert side.loaded_agents() == {}, "the dead producer's agent is forgotten"
            assert side.counters()["agents_forgotten"] == 1
    finally:
        stop_all([proc])


def test_R_E11_B_02_restarted_producer_recovered_from_agent_metadata_in_xferack() -> None:
    """kill -9 the producer, restart it with the same engine id at the same address: the
    stale region is reaped (B-02) and the consumer reads from the new agent with the
    metadata the XferAck carried, without another handshake (R-E11)."""
    engine_id = unique("producer-r")
    first = start_producer(engine_id)
    port = first.ready["port"]
    with make_side("ec_consumer") as side:
        got = pull(side, "img-r1", encode(first, "img-r1", 4), 4)
        assert got.via == "p2p"
        (name, old_metadata), *_ = side.loaded_agents().items()
        assert name == engine_id
        first.proc.kill()  # its region stays in /dev/shm until a starter reaps it (B-02)
        first.proc.wait()
        second = start_producer(engine_id, port)
        try:
            assert second.ready["port"] == port
            assert second.ready["region"] == region_file(engine_id)
            # Reaped by the restart, or by another starter first (then this one reaped only
            # the stale regions of other test processes on the host): never leaked, never
            # reused.
            own, reaped = os.path.basename(region_file(engine_id)), second.ready["reaped"]
            assert own in reaped or all(f"-{os.getpid()}-" not in name for name in reaped)
            params = encode(second, "img-r2", 5)
            got = pull(side, "img-r2", params, 5)
            assert got.via == "p2p", got.reason
            assert got.tensor is not None and matches("img-r2", got.tensor)
            new_metadata = side.loaded_agents()[engine_id]
            assert new_metadata != old_metadata, "the restarted agent's metadata was loaded"
            assert side.counters()["agents_loaded"] == 2
        finally:
            stop(second)
    assert not os.path.exists(region_file(engine_id)), "unlinked at shutdown (R-E03)"


def test_R_E03_sides_unlink_their_regions_at_shutdown() -> None:
    with make_side("ec_producer", listen=("127.0.0.1", 0)) as side:
        path = side.region_path
        assert os.path.exists(path)
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        side.encoder_cache["img-local"] = encoding("img-local", 2)
        info = ECRequestInfo(
            "r", ("img-local",), mm_metadata={"img-local": {"m": 1}}, mm_tokens=(2,)
        )
        side.scheduler.update_state_after_alloc(info, 0, side.clock())
        assert "img-local" in side.engine_step().saved
        params = side.scheduler.request_finished(info, side.clock())
        assert params["img-local"]["peer_port"] == side.publish_port != 0
    assert not os.path.exists(path)
    assert side.region is not None and side.region.closed


def test_R_E11_same_agent_name_with_new_metadata_is_reloaded() -> None:
    """A grant naming a known agent with new metadata (its producer restarted under the
    same engine id before the consumer saw it go): the adapter drops the old agent and
    loads the metadata the XferAck carries before it READs. Real machines on both sides;
    only the ZMQ hop is replaced by handing the bytes over, so no disconnect is seen."""
    name = unique("producer-m")
    with make_side("ec_consumer") as consumer:
        requests: list[SendXferReq] = []
        consumer.scheduler.bus.handle(SendXferReq, lambda _i, e: requests.append(e))
        for round_ in range(2):
            mm_hash = f"img-m{round_}"
            with make_side("ec_producer", name, listen=("127.0.0.1", 0)) as producer:
                acks: list[XferAck] = []
                producer.ack_observers.append(acks.append)
                producer.encoder_cache[mm_hash] = encoding(mm_hash, 3)
                info = ECRequestInfo(
                    "r", (mm_hash,), mm_metadata={mm_hash: {"m": 1}}, mm_tokens=(3,)
                )
                producer.scheduler.update_state_after_alloc(info, 0, producer.clock())
                producer.engine_step()
                params = producer.scheduler.request_finished(info, producer.clock())
                asking = ECRequestInfo(
                    f"ask-{round_}", (mm_hash,), ec_transfer_params=params, mm_tokens=(3,)
                )
                assert not consumer.scheduler.ensure_cache_available(asking, 0, consumer.clock())
                wire = encode_xfer_req(requests[-1].req)
                producer.scheduler.on_producer_message(b"consumer", wire, producer.clock())
                assert str(acks[-1].status) == "OK"
                peer = f"{params[mm_hash]['peer_host']}:{params[mm_hash]['peer_port']}"
                consumer.scheduler.on_xfer_ack(
                    encode_xfer_ack(acks[-1]), consumer.clock(), peer=peer
                )
                assert consumer.reads_in_flight() == 1

                def landed(p: ECSide = producer, r: ECRequestInfo = asking) -> bool:
                    p.poll()
                    consumer.poll()
                    return consumer.scheduler.ensure_cache_available(r, 0, consumer.clock())

                poll_until(landed, 20, f"the READ of round {round_}")
                consumer.scheduler.request_finished(asking, consumer.clock())
                got = pull(consumer, mm_hash, params, 3)  # loaded from the tier now
                assert got.tensor is not None and matches(mm_hash, got.tensor)
                assert consumer.loaded_agents()[name] == producer.agent.metadata()  # type: ignore[union-attr]
        counters = consumer.counters()
        assert (counters["agents_loaded"], counters["agents_forgotten"]) == (2, 1)


def test_demo_ec_serves_every_request_through_both_detours() -> None:
    """`kvhandoff demo ec` in small: every encoding verified, one pulled after a
    NACK_NOT_READY retry, one encoded locally after a NACK_MISSING."""
    from kvhandoff.demo.ec_demo import run_ec_demo

    result = run_ec_demo(6, 3)
    assert result["failures"] == []
    assert {k: result[k] for k in ("requests", "served_p2p", "fallback_local", "verified")} == {
        "requests": 6,
        "served_p2p": 5,
        "fallback_local": 1,
        "verified": 6,
    }
    assert result["retried_not_ready"] == 1
    consumer = result["summaries"]["consumer"]
    assert consumer["unresolved"] == 0 and consumer["failed"] == 0
    assert result["summaries"]["producer"]["evictions_announced"] == 1
