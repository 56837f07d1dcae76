"""Push mode under real process faults: kill -9 a peer, then restart it (issue 8, B-08).

Every request resolves within its lease or watchdog deadline; no lease stays held; the
writer thread survives; a restarted peer (a new NIXL agent, a new port) is
re-handshaked instead of its dead agent being used forever.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_push_integration import SEED, SHAPE, Prefill, child, child_summary, poll_until

from kvhandoff.demo.launcher import go
from kvhandoff.demo.push_instance import LivePushInstance
from kvhandoff.demo.push_role import demo_requests
from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.remote_engine import REMOTE_ENGINE
from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg
from kvhandoff.protocol.push_config import PushConfig

pytestmark = pytest.mark.integration


def test_kill_decode_after_registration_then_restart() -> None:
    config = PushConfig(kv_lease_duration=2.0, handshake_timeout=1.0)
    with LivePushInstance("prefill", "prefill-0", shape=SHAPE, config=config) as p:
        args = ["--peer", f"127.0.0.1:{p.port}", "--requests", "4", "--per-step", "100"]
        doomed = child("decode", *args, "--wait-go")
        go([doomed])
        first = Prefill(p, demo_requests(4, SEED))
        writer = p.side.ranks[0].writer
        poll_until(lambda: (first.step(), writer.pending_count == 4)[1], 30, "four PUSH_REGs on P")
        doomed.proc.kill()  # kill -9 D after it registered
        doomed.proc.wait()
        first.finish_all()
        poll_until(first.all_sent, 20, "every lease resolved within its deadline")
        assert p.side.ranks[0].bus.metrics.get("push.p.lease_expired") == 4
        assert p.writer.alive and p.writer.errors == 0
        assert not p.side.scheduler.has_pending_push_work(), "no lease stays held"

        # A new D process (new agent, new port) registers fresh requests: re-handshake.
        reborn = child("decode", *args[:4], "--seed", "12", "--requests", "3")
        second = Prefill(p, demo_requests(3, 12))
        second.finish_all()
        poll_until(second.all_sent, 30, "the restarted decoder's pushes")
        summary = child_summary(reborn)
        assert (summary["verified"], summary["failed"]) == (3, 0)


def test_kill_prefill_after_registration_then_restart() -> None:
    config = PushConfig(push_registration_timeout=2.0, heartbeat_interval=0.3)
    with LivePushInstance("decode", "decode-0", shape=SHAPE, config=config) as d:
        doomed = child("prefill", "--requests", "3", "--wait-go")  # never finishes
        blocks = _register(d, _port_of(doomed), demo_requests(3, SEED))

        def sent() -> bool:
            d.step()
            bus = d.side.ranks[0].bus
            return all(bus.has_tag(D_REGISTRATION, rid, "receiving") for rid in blocks)

        poll_until(sent, 30, "three PUSH_REGs sent")
        doomed.proc.kill()  # kill -9 P after D registered
        doomed.proc.wait()

        def dropped() -> bool:
            d.step()
            return d.side.scheduler.bus.metrics.get("push.d.watchdog_expired") == 3

        poll_until(dropped, 20, "every registration resolved by the watchdog")
        assert not d.side.scheduler.has_pending_push_work()

        def forgotten() -> bool:
            d.step()
            inst = d.side.ranks[0].writer_bus.get(REMOTE_ENGINE, "prefill-0")
            return inst is None or not inst.has("peer_ready")

        poll_until(forgotten, 10, "the dead prefill agent forgotten (B-08)")

        reborn = child("prefill", "--seed", "13", "--requests", "2")
        fresh = demo_requests(2, 13)
        blocks = _register(d, _port_of(reborn), fresh)
        received: dict[str, bool] = {}

        def verified() -> bool:
            out = d.step()
            for rid in out.finished_recving:
                client = rid.rsplit("-", 1)[0]
                received[client] = d.memory.verify(client, blocks[rid])
            return len(received) == 2

        poll_until(verified, 30, "pushes from the restarted prefill")
        assert all(received.values()), received
        assert child_summary(reborn)["finished_sending"] == 2


def test_R_P10_B08_kill_prefill_mid_write_then_restart() -> None:
    """kill -9 P while its WRITEs stream into D: P finishes two requests per 50 ms step
    (its WRITEs leave as one batched transfer per writer pass, B-13, so they must be
    spread over steps to stream) and is killed as the first completions land, so later
    WRITEs are in flight or unposted.
    Every registration resolves: received with P's bytes, failed with a reason, or dropped
    by its watchdog (R-P10); nothing stays pending, and a new P pushes again (B-08)."""
    config = PushConfig(push_registration_timeout=3.0, heartbeat_interval=0.3)
    n = 24
    with LivePushInstance("decode", "decode-0", shape=SHAPE, config=config) as d:
        doomed = child(
            "prefill", "--seed", "21", "--requests", str(n), "--per-step", "2", "--step-ms", "50"
        )
        blocks = _register(d, _port_of(doomed), demo_requests(n, 21))
        received: dict[str, bool] = {}
        failed: dict[str, str] = {}

        def step() -> None:
            out = d.step()
            for rid in out.finished_recving:
                received[rid] = d.memory.verify(rid.rsplit("-", 1)[0], blocks[rid])
            failed.update(out.failed_recving)

        poll_until(lambda: (step(), len(received) >= 1)[1], 30, "the first WRITEs landed")
        doomed.proc.kill()  # kill -9 P mid-stream
        doomed.proc.wait()
        metrics = d.side.scheduler.bus.metrics

        def resolved() -> bool:
            step()
            dropped = int(metrics.get("push.d.watchdog_expired", 0))
            return len(received) + len(failed) + dropped == n

        poll_until(resolved, 30, "every registration resolved by a completion or the watchdog")
        dropped = int(metrics.get("push.d.watchdog_expired", 0))
        print(f"kill -9 P mid-WRITE: {len(received)} received, {len(failed)} failed, ", end="")
        print(f"{dropped} dropped by the watchdog")
        assert all(received.values()), "every completed receive holds P's bytes"
        assert set(received).isdisjoint(failed), "a receive ends once"
        assert all(reason for reason in failed.values()), "every failure carries a reason"
        rank_bus = d.side.ranks[0].bus
        assert all(rank_bus.get(D_REGISTRATION, rid) is None for rid in blocks), "none left live"
        assert not d.side.scheduler.has_pending_push_work()
        assert d.writer.alive and d.writer.errors == 0

        reborn = child("prefill", "--seed", "22", "--requests", "2")
        fresh = _register(d, _port_of(reborn), demo_requests(2, 22))
        again: dict[str, bool] = {}

        def verified() -> bool:
            out = d.step()
            for rid in out.finished_recving:
                again[rid] = d.memory.verify(rid.rsplit("-", 1)[0], fresh[rid])
            return len(again) == 2

        poll_until(verified, 30, "pushes from the restarted prefill")
        assert all(again.values()), again


def _port_of(proc: Any) -> int:
    return int(proc.ready["port"])


def _register(d: LivePushInstance, port: int, requests: Any) -> dict[str, list[int]]:
    leg = decode_leg({}, PrefillCoordinates("prefill-0", "127.0.0.1", port, 1))
    blocks: dict[str, list[int]] = {}
    for req in requests:
        rid = f"{req.client_id}-dddd0000"
        blocks[rid] = d.memory.allocate(req.num_blocks)
        d.memory.clear(blocks[rid])
        d.side.update_state_after_alloc(rid, blocks[rid], leg["kv_transfer_params"])
    return blocks


def test_B_08_a_push_reg_to_a_restarted_prefill_rehandshakes_instead_of_failing() -> None:
    """D is idle when P restarts under the same engine id (no heartbeat is in flight to
    find out): D's first PUSH_REG to the new process finds the old agent gone, forgets
    it, re-handshakes with the new P and registers again; the request is received, not
    failed (issue 27: it used to fail)."""
    config = PushConfig(heartbeat_interval=3600.0)  # an idle D notices nothing by itself
    with LivePushInstance("decode", "decode-0", shape=SHAPE, config=config) as d:
        received: dict[str, bool] = {}

        def receive(blocks: dict[str, list[int]], count: int) -> Any:
            def done() -> bool:
                out = d.step()
                assert not out.failed_recving, out.failed_recving
                for rid in out.finished_recving:
                    received[rid] = d.memory.verify(rid.rsplit("-", 1)[0], blocks[rid])
                return len(received) == count

            return done

        first = child("prefill", "--seed", "21", "--requests", "1")
        blocks = _register(d, _port_of(first), demo_requests(1, 21))
        poll_until(receive(blocks, 1), 30, "the first push")
        assert child_summary(first)["finished_sending"] == 1  # that P process has exited
        engine = d.side.ranks[0].writer_bus.get(REMOTE_ENGINE, "prefill-0")
        assert engine is not None and engine.has("peer_ready"), "D still trusts the old agent"

        reborn = child("prefill", "--seed", "22", "--requests", "1")
        blocks |= _register(d, _port_of(reborn), demo_requests(1, 22))
        poll_until(receive(blocks, 2), 30, "the push from the restarted prefill")
        assert all(received.values()), received
        assert child_summary(reborn)["finished_sending"] == 1
        assert d.side.scheduler.stats()["post"] == 0, "no PUSH_REG failed to send"
