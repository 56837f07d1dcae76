"""Push mode over real NIXL (UCX, DRAM) and real ZMQ, between two OS processes.

The test process runs one side as a `LivePushInstance` and steps its engine loop itself;
the other side is a `kvhandoff run prefill|decode` child. Both derive the same request
list from the seed. Every wait is bounded polling of the engine step, never a sleep used
as synchronisation; every deadline is the protocol's own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from kvhandoff.adapters.nixl.agent import NixlTransferError
from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
from kvhandoff.demo.kv_memory import KVShape
from kvhandoff.demo.launcher import RoleProcess, collect, go, start_role, wait_ready
from kvhandoff.demo.push_instance import LivePushInstance
from kvhandoff.demo.push_role import DemoRequest, demo_requests
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.protocol.push_config import PushConfig

pytestmark = pytest.mark.integration

SHAPE = KVShape()  # the shape `kvhandoff run` uses, so compatibility hashes agree
SEED = 11


def poll_until(step: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Step until `step()` is true; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not step():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)  # yield the CPU to the peer process between engine steps


def child(role: str, *args: str, config: dict[str, Any] | None = None) -> RoleProcess:
    argv = ["run", role, "--seed", str(SEED), "--config", json.dumps(config or {}), *args]
    proc = start_role(role, argv)
    wait_ready(proc, 60.0)
    return proc


def child_summary(proc: RoleProcess, timeout_s: float = 60.0) -> dict[str, Any]:
    events: list[dict[str, Any]] = []
    collect([proc], timeout_s, lambda _role, event: events.append(event))
    summaries = [e for e in events if e["event"] == "summary"]
    assert summaries, f"no summary from {proc.name}: {proc.stderr_tail[-5:]}"
    summary = summaries[-1]
    summary["events"] = events
    return summary


class Prefill:
    """The test's P side: finishes the seeded requests when told to."""

    def __init__(self, live: LivePushInstance, requests: Sequence[DemoRequest]) -> None:
        self.live = live
        self.requests = list(requests)
        self.blocks: dict[str, list[int]] = {}
        self.sent: set[str] = set()

    def finish_all(self) -> None:
        for req in self.requests:
            rid = f"{req.client_id}-aaaa0000"
            blocks = self.live.memory.allocate(req.num_blocks)
            self.live.memory.fill(req.client_id, blocks)
            self.blocks[rid] = blocks
            self.live.side.request_finished(rid, blocks, {"do_remote_decode": True})

    def step(self) -> None:
        self.sent |= self.live.step().finished_sending

    def all_sent(self) -> bool:
        self.step()
        return self.sent == set(self.blocks)


@pytest.fixture
def prefill_factory() -> Iterator[Callable[..., LivePushInstance]]:
    made: list[LivePushInstance] = []

    def make(**kwargs: Any) -> LivePushInstance:
        kwargs.setdefault("shape", SHAPE)
        live = LivePushInstance("prefill", "prefill-0", **kwargs)
        made.append(live)
        return live

    yield make
    for live in made:
        live.close()


def _decode_child(p: LivePushInstance, n: int, *extra: str, **kw: Any) -> RoleProcess:
    return child(
        "decode",
        "--peer",
        f"127.0.0.1:{p.port}",
        "--peer-engine-id",
        "prefill-0",
        "--requests",
        str(n),
        "--deadline",
        "40",
        *extra,
        **kw,
    )


def test_R_P04_R_P05_registrations_first_then_blocks(prefill_factory: Any) -> None:
    """PUSH_REGs wait on P's writer; blocks arrive later; the first WRITE replays after the
    P->D handshake; D verifies every byte."""
    p = prefill_factory()
    d = _decode_child(p, 6, "--per-step", "100", "--wait-go")
    go([d])
    prefill = Prefill(p, demo_requests(6, SEED))
    writer = p.side.ranks[0].writer
    poll_until(lambda: (prefill.step(), writer.pending_count == 6)[1], 40, "six pending PUSH_REGs")
    prefill.finish_all()
    poll_until(prefill.all_sent, 40, "every lease finished_sending")
    summary = child_summary(d)
    assert (summary["verified"], summary["failed"]) == (6, 0)
    taken = {edge for edge in p.side.ranks[0].bus.machine(P_LEASE).taken_edges()}
    assert ("matched", "handshake_started", "awaiting_handshake") in taken
    assert ("awaiting_handshake", "handshake_done", "matched") in taken


def test_R_P04_R_P07_blocks_first_then_registrations(prefill_factory: Any) -> None:
    """Finished blocks wait unmatched while the writer self-polls; PUSH_REGs match later."""
    p = prefill_factory()
    prefill = Prefill(p, demo_requests(5, SEED))
    prefill.finish_all()
    side = p.side.ranks[0]

    def staged_and_self_polling() -> bool:
        # The writer thread stages the blocks, then arms the self-poll in the same pass:
        # wait for both, whichever thread runs when (R-P07).
        prefill.step()
        return side.writer.awaiting_count == 5 and side.self_poll_interval_s is not None

    poll_until(staged_and_self_polling, 20, "five staged requests and the self-poll armed")
    assert side.self_poll_interval_s == pytest.approx(0.001), "polls every 1 ms (R-P07)"
    d = _decode_child(p, 5, "--per-step", "2")
    poll_until(prefill.all_sent, 40, "every lease finished_sending")
    # The last match emptied the table, and the writer stopped self-polling, before that
    # request's WRITE was posted: a finished send implies it, on any schedule.
    assert not side.writer.self_polling, "nothing waits for a PUSH_REG any more (R-P07)"
    poll_until(lambda: side.self_poll_interval_s is None, 10, "the writer back on its wake event")
    summary = child_summary(d)
    assert (summary["verified"], summary["failed"]) == (5, 0)


class FailingWriteTransport(NixlPushTransport):
    """Fails the WRITE whose completion notif names `victim` (a fault injector)."""

    victim = ""

    def write_blocks(
        self, engine_id: str, rank: int, local: Any, remote: Any, notif: bytes, **kw: Any
    ) -> Any:
        if notif.decode().startswith(self.victim):
            raise NixlTransferError("write", "injected post failure")
        return super().write_blocks(engine_id, rank, local, remote, notif, **kw)


def test_B06_R_P12_write_submit_failure_fails_d_at_once(prefill_factory: Any) -> None:
    requests = demo_requests(4, SEED)
    FailingWriteTransport.victim = requests[1].client_id
    p = prefill_factory(transport_factory=FailingWriteTransport)
    d = _decode_child(p, 4)
    prefill = Prefill(p, requests)
    prefill.finish_all()
    # Three leases are pushed; the victim's blocks are freed at once, without waiting for
    # the lease to run out (B-10): all four are finished_sending.
    poll_until(lambda: (prefill.step(), len(prefill.sent) == 4)[1], 40, "four leases freed")
    assert "push.p.lease_expired" not in p.side.ranks[0].bus.metrics
    summary = child_summary(d)
    failed = [e for e in summary["events"] if e["event"] == "failed"]
    assert (summary["verified"], summary["failed"]) == (3, 1)
    assert failed[0]["client"] == requests[1].client_id
    assert "injected post failure" in failed[0]["reason"], "D failed on P's notif (B-06)"
    assert p.side.failed_transfers == 1


def test_R_P11_B07_unclaimed_leases_are_reaped(prefill_factory: Any) -> None:
    """No D ever registers: every lease expires, is reported finished_sending and evicted."""
    p = prefill_factory(config=PushConfig(kv_lease_duration=0.5))
    prefill = Prefill(p, demo_requests(3, SEED))
    prefill.finish_all()
    poll_until(prefill.all_sent, 20, "leases reaped")
    assert p.side.ranks[0].bus.metrics.get("push.p.lease_expired") == 3
    side = p.side.ranks[0]

    def evicted() -> bool:  # the writer thread evicts, then disarms its self-poll
        return not side.writer.awaiting_count and side.self_poll_interval_s is None

    poll_until(evicted, 5, "writer tables evicted and the self-poll disarmed")
    assert not p.side.scheduler.has_pending_push_work()


def test_R_P10_watchdog_drops_registrations_of_an_absent_prefill() -> None:
    """D registers with a P that never finishes: the watchdog drops every registration."""
    with (
        LivePushInstance("prefill", "prefill-0", shape=SHAPE) as p,
        LivePushInstance(
            "decode", "decode-0", shape=SHAPE, config=PushConfig(push_registration_timeout=1.0)
        ) as d,
    ):
        from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg

        leg = decode_leg({}, PrefillCoordinates("prefill-0", "127.0.0.1", p.port, 1))
        for i in range(3):
            blocks = d.memory.allocate(2)
            d.side.update_state_after_alloc(
                f"cmpl-wd{i}-0-bbbb0000", blocks, leg["kv_transfer_params"]
            )

        def dropped() -> bool:
            p.step()
            d.step()
            return d.side.scheduler.bus.metrics.get("push.d.watchdog_expired") == 3

        poll_until(dropped, 20, "three watchdog expiries")
        # P's writer thread holds the PUSH_REGs until its own TTL (480 s), whenever they
        # reached it relative to D's watchdog.
        writer = p.side.ranks[0].writer
        poll_until(lambda: writer.pending_count == 3, 20, "P holding the three PUSH_REGs")
        assert not d.side.scheduler.has_pending_push_work()


class SlowHandshakeTransport(NixlPushTransport):
    """Stalls the P->D handshake (a slow network), so the push outlives the lease."""

    def fetch_handshake(
        self, host: str, port: int, timeout_s: float, ranks: Sequence[tuple[int, int]]
    ) -> list[bytes]:
        time.sleep(2.0)  # simulated network stall inside the fault injector
        return super().fetch_handshake(host, port, timeout_s, ranks)


def test_R_P08_R_P15_heartbeats_keep_a_lease_alive(prefill_factory: Any) -> None:
    p = prefill_factory(
        transport_factory=SlowHandshakeTransport,
        config=PushConfig(kv_lease_duration=1.0, kv_lease_extension=3.0),
    )
    d = _decode_child(p, 1, "--wait-go", config={"heartbeat_interval": 0.2})
    prefill = Prefill(p, demo_requests(1, SEED))
    prefill.finish_all()
    go([d])
    poll_until(prefill.all_sent, 40, "the push")
    summary = child_summary(d)
    assert summary["verified"] == 1
    # The handshake stalls 2 s, twice the 1 s lease: only D's heartbeats kept it alive.
    rank = p.side.ranks[0]
    assert "push.p.lease_expired" not in rank.bus.metrics
    heartbeats = [r for r in rank.bus.machine(P_LEASE).routes if r.edge[1] == "heartbeat"]
    assert any(r.taken for r in heartbeats), "a heartbeat extended the lease"


def test_B09_pull_mode_on_the_same_base(prefill_factory: Any) -> None:
    """Pull: P's request_finished returns its coordinates and blocks; D READs them, its
    READ's notif frees P's lease; heartbeats and handshakes are push mode's."""
    from kvhandoff.demo.launcher import relay
    from kvhandoff.machines.pull.p_lease import PULL_P_LEASE

    p = prefill_factory(mode="pull")
    requests = demo_requests(4, SEED)
    d = _decode_child(p, 4, "--mode", "pull")
    for req in requests:
        rid = f"{req.client_id}-cccc0000"
        blocks = p.memory.allocate(req.num_blocks)
        p.memory.fill(req.client_id, blocks)
        delay_free, params = p.side.request_finished(rid, blocks, {"do_remote_decode": True})
        assert delay_free and params is not None and params["remote_block_ids"] == [blocks]
        relay(d, {"client": req.client_id, "params": params})
    sent: set[str] = set()
    poll_until(lambda: (sent.update(p.step().finished_sending), len(sent) == 4)[1], 40, "reads")
    summary = child_summary(d)
    assert (summary["verified"], summary["failed"]) == (4, 0)
    rank = p.side.ranks[0]
    assert rank.bus.metrics.get("pull.p.read_by_d") == 4, "freed by D's notif, not expiry"
    assert rank.bus.counters(PULL_P_LEASE).live == 0
