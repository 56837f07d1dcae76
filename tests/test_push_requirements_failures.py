"""Push mode requirement by requirement, sans-IO: deadlines and failures — D's watchdog,
P's lease, failed handshakes, sends and WRITEs, pending work, heartbeats (R-P10..R-P13,
R-P15), B-06, B-07, B-08, and issue 3's bad input: counted, logged once per peer, no state
change, the writer keeps running.

Each test drives either the machines and the engine API directly on a `VirtualClock`, or
a whole P/D pair over the in-memory fabric (`SimulatedPushWorld`), where every ordering is
chosen by the test. No sleeps, no timed assertions: time moves only when a test moves it.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from push_harness import (
    CONFIG,
    D_ENGINE,
    MainSide,
    Spy,
    clean,
    finish,
    hold,
    registration,
    release,
    report,
    world,
    writer,
)

from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.effects import (
    DropRemoteAgent,
    ForwardToMain,
    IssueWrite,
    StartHandshake,
)
from kvhandoff.machines.push.events import Matched, WritePosted
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.scheduler import PushConnectorOutput
from kvhandoff.protocol.notifs import HeartbeatNotif, encode_heartbeat
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PUSH_REG_PREFIX, encode_push_reg
from kvhandoff.sim.push.errors import SimTransportError
from kvhandoff.sim.push.world import SimulatedPushWorld


@pytest.fixture(autouse=True)
def _restore_log_level() -> Any:
    yield
    logging.getLogger("kvhandoff").setLevel(logging.NOTSET)


# -- R-P10 D watchdog ----------------------------------------------------------------------


def test_R_P10_watchdog_drops_a_registration_and_never_resends_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = world()
    spy = Spy(w)
    client = w.issue(2)
    hold(w, "prefill")  # P never finishes: no WRITE, no completion
    w.run_for(1.0)
    d_id = w.ledger.clients[client].d_id or ""
    assert w.decode.side.bus.get(D_REGISTRATION, d_id).state == "sent"  # type: ignore[union-attr]
    logging.getLogger("kvhandoff").setLevel(logging.NOTSET)
    with caplog.at_level(logging.WARNING, logger="kvhandoff"):
        w.advance(w.settings.push.registration_timeout)
        w.step("decode")  # build_connector_meta fires the watchdog
    assert w.decode.side.bus.get(D_REGISTRATION, d_id) is None
    assert any("watchdog expired" in r.getMessage() for r in caplog.records)
    assert w.ledger.clients[client].d == "expired"  # the engine's abort path took it
    w.run_for(120.0)
    assert len(spy.sent(PUSH_REG_PREFIX)) == 1  # never re-sent
    w.decode.side.abort(d_id)  # nothing left to abort
    clean(w)


# -- R-P11 P lease -------------------------------------------------------------------------


def test_R_P11_expired_leases_are_reaped_in_get_finished_and_evicted() -> None:
    p = MainSide("prefill")
    rid = "cmpl-11-0-0a0a0a0a"
    p.sched.request_finished(rid, [1, 2], {"do_remote_decode": True}, p.now)
    p.worker.start_load_kv(p.sched.build_connector_meta(p.now), p.now)
    p.effects()
    p.clock.advance(CONFIG.kv_lease_duration + 1)
    p.sched.build_connector_meta(p.now)
    assert p.state(P_LEASE, rid) == "staged"  # P's leases are not reaped here
    output = p.worker.get_finished((), p.now)
    assert output.finished_sending == {rid}
    evictions = [e for e in p.effects() if type(e).__name__ == "QueueEviction"]
    assert [e.request_id for e in evictions] == [rid]  # type: ignore[attr-defined]
    assert p.retired == [(rid, "expired")]


def test_R_P11_a_write_posted_just_before_expiry_keeps_its_blocks() -> None:
    """The writer's report that a WRITE left is read before the expired lease is reaped."""
    p = MainSide("prefill")
    rid = "cmpl-11-1-0a0a0a0a"
    p.sched.request_finished(rid, [1], {"do_remote_decode": True}, p.now)
    p.worker.start_load_kv(p.sched.build_connector_meta(p.now), p.now)
    p.clock.advance(CONFIG.kv_lease_duration + 1)  # the main thread stalled meanwhile
    p.sched.build_connector_meta(p.now)
    output = p.worker.get_finished(report(rid, Matched(), WritePosted()), p.now)
    assert output.finished_sending == set()
    assert p.state(P_LEASE, rid) == "writing"


def test_R_P11_writer_drops_blocks_of_a_reaped_lease() -> None:
    w = world()
    client = w.issue(2)
    hold(w, "decode")
    w.run_for(1.0)
    writer_core = w.prefill.side.writer
    assert writer_core.push_finished_blocks and writer_core.self_polling
    w.advance(w.settings.push.kv_lease_duration + 1)
    w.run_for(1.0)
    assert w.ledger.clients[client].p == "freed"
    assert not writer_core.push_finished_blocks and not writer_core.self_polling
    clean(w)


def test_R_P11_B06_a_lease_reaped_between_match_and_post_is_never_written() -> None:
    """Two threads race: P's writer matched the blocks with D's registration and is about
    to post the WRITE when P's main thread reaps the expired lease and frees the blocks.
    The post checks the lease under the lock the reaping holds: nothing is written from
    freed blocks, and D is told at once (B-06) instead of waiting for its watchdog."""
    w = world()
    spy = Spy(w)
    client = w.issue(2)
    d_leg = hold(w, "decode")
    w.run_for(1.0)  # P finished; its blocks wait on the writer for D's registration
    side = w.prefill.side
    take_effects = side.writer.take_effects
    reaped: list[set[str]] = []

    def main_thread_reaps_in_between() -> list[object]:
        effects = take_effects()
        if any(isinstance(e, IssueWrite) for e in effects):
            w.advance(w.settings.push.kv_lease_duration + 1)
            reaped.append(side.get_finished().finished_sending)
            w.prefill._account_prefill(PushConnectorOutput(finished_sending=reaped[-1]))
        return effects

    side.writer.take_effects = main_thread_reaps_in_between  # type: ignore[method-assign]
    release(w, "decode", d_leg)
    w.run_for(1.0)  # matches, reaps in between, declines the post
    w.run_for(1.0)  # D reads the WRITE-failed notif
    assert reaped and reaped[0], "the lease was reaped between the match and the post"
    assert spy.writes == [], "no WRITE from blocks whose lease had ended"
    assert w.ledger.clients[client].d == "failed", "D was told (B-06), not left waiting"
    assert side.failed_transfers == 1
    clean(w)


# -- R-P12 failures ------------------------------------------------------------------------


def test_R_P12_d_handshake_failure_fails_the_receive_with_its_blocks_invalid() -> None:
    w = world()
    client = w.issue(2)
    w.step("decode")
    w.writer_pass("decode")
    w.run_job("decode", fail=True)
    w.writer_pass("decode")
    w.step("decode")  # the engine checks the blocks were marked invalid
    assert w.ledger.clients[client].d == "failed"
    finish(w)


def test_R_P12_push_reg_send_failure_fails_the_receive() -> None:
    w = world()
    client = w.issue(2)
    hold(w, "prefill")

    def refuse(engine_id: str, message: bytes) -> None:
        raise SimTransportError("send_notif refused")

    w.decode.transport.send_notif = refuse  # type: ignore[method-assign]
    w.run_for(1.0)
    assert w.ledger.clients[client].d == "failed"
    clean(w)


def test_R_P12_p_handshake_failure_is_logged_and_dropped_without_requeue(
    caplog: pytest.LogCaptureFixture,
) -> None:
    w = world()
    client = w.issue(2)
    w.step("decode")
    w.writer_pass("decode")
    w.run_job("decode")
    w.writer_pass("decode")  # replayed
    w.writer_pass("decode")  # PUSH_REG sent
    w.deliver(0)
    w.step("prefill")
    w.writer_pass("prefill")  # matched: P's handshake with D is queued
    p = w.prefill
    assert len(p.executor.jobs) == 1
    logging.getLogger("kvhandoff").setLevel(logging.NOTSET)
    with caplog.at_level(logging.WARNING, logger="kvhandoff"):
        w.run_job("prefill", fail=True)
        w.run_for(0.01)
    assert any("push_handshake_failed" in r.getMessage() for r in caplog.records)
    p_id = w.ledger.clients[client].p_id or ""
    assert p.side.bus.get(P_LEASE, p_id).state == "handshake_failed"  # type: ignore[union-attr]
    assert not p.executor.jobs and not p.side.deferred_push_inbox  # no requeue, no retry
    # D's heartbeats keep the lease alive while D waits; then D's watchdog drops the
    # registration, the heartbeats stop, and the lease reclaims P's blocks.
    config = w.settings.push
    w.run_for(config.registration_timeout + config.kv_lease_extension + 1)
    record = w.ledger.clients[client]
    assert record.p == "freed" and record.d == "expired"
    assert record.finished_sending == 1
    finish(w)


def test_R_P12_p_write_submit_failure_is_counted_without_a_failed_receive_on_p() -> None:
    w = world()
    client = w.issue(2)
    w.network.fail_next_write_posts = 1
    w.run_for(0.5)
    p = w.prefill
    assert p.side.failed_transfers == 1
    p_id = w.ledger.clients[client].p_id or ""
    assert p.side.bus.get(P_LEASE, p_id).state == "write_failed"  # type: ignore[union-attr]
    assert w.ledger.clients[client].p == "leased"  # freed later by the lease
    finish(w)
    assert w.ledger.clients[client].finished_sending == 1


# -- R-P13 keep stepping -------------------------------------------------------------------


def test_R_P13_has_pending_push_work_while_anything_is_in_flight() -> None:
    w = world()
    sides = (w.prefill.side.scheduler, w.decode.side.scheduler)
    assert not any(s.has_pending_push_work() for s in sides)
    w.issue(2)
    w.step("prefill")
    w.step("decode")
    assert all(s.has_pending_push_work() for s in sides)
    w.run_for(2.0)
    assert not any(s.has_pending_push_work() for s in sides)
    clean(w)


# -- R-P15 base path -----------------------------------------------------------------------


def test_R_P15_defaults_lease_30_heartbeat_5_extension_20() -> None:
    config = PushConfig()
    assert (config.kv_lease_duration, config.heartbeat_interval) == (30.0, 5.0)
    assert config.kv_lease_extension == 20.0
    assert config.registration_timeout == config.decoder_kv_blocks_ttl


def test_R_P15_heartbeats_leave_every_interval_for_sent_registrations() -> None:
    w = world()
    spy = Spy(w)
    client = w.issue(1)
    hold(w, "prefill")
    w.run_for(0.5)
    d_id = w.ledger.clients[client].d_id or ""
    for _ in range(20):  # twenty one-second engine steps
        w.advance(1.0)
        w.run_for(0.0)
        w.step("decode")
    beats = spy.sent(b"HB:")
    assert len(beats) == 4 and set(beats) == {encode_heartbeat([d_id])}
    clean(w)


# -- B-06, B-07, B-08 ----------------------------------------------------------------------


def test_B06_write_failed_notif_fails_d_at_once() -> None:
    w = world()
    client = w.issue(2)
    w.network.fail_next_write_posts = 1
    w.run_for(0.5)  # far below any watchdog
    assert w.ledger.clients[client].d == "failed"
    assert w.ledger.clients[client].p == "leased"
    finish(w)


def test_B07_leases_are_reaped_in_deadline_order_despite_out_of_order_renewals() -> None:
    p = MainSide("prefill")
    for n in range(3):  # leases A, B, C finish at t = 0, 1, 2: deadlines 30, 31, 32
        p.sched.request_finished(f"cmpl-70-{n}-0a0a0a0a", [n], {"do_remote_decode": True}, p.now)
        p.worker.start_load_kv(p.sched.build_connector_meta(p.now), p.now)
        p.clock.advance(1.0)
    p.clock.jump_to(15.0)
    p.worker.get_finished([ForwardToMain(HeartbeatNotif(("cmpl-70-2-dddddddd",)), "d")], p.now)
    p.clock.jump_to(16.0)
    p.worker.get_finished([ForwardToMain(HeartbeatNotif(("cmpl-70-0-dddddddd",)), "d")], p.now)
    # Now A = 36, B = 31, C = 35.
    reaped = []
    for when in (31.5, 35.5, 36.5):
        p.clock.jump_to(when)
        reaped.append(sorted(p.worker.get_finished((), p.now).finished_sending))
    assert reaped == [["cmpl-70-1-0a0a0a0a"], ["cmpl-70-2-0a0a0a0a"], ["cmpl-70-0-0a0a0a0a"]]
    p2 = MainSide("prefill")
    for n in range(3):
        p2.sched.request_finished(f"cmpl-71-{n}-0a0a0a0a", [n], {"do_remote_decode": True}, p2.now)
        p2.worker.start_load_kv(p2.sched.build_connector_meta(p2.now), p2.now)
        p2.clock.advance(1.0)
    p2.clock.jump_to(15.0)  # A renewed to 35, after B (31) and C (32)
    p2.worker.get_finished([ForwardToMain(HeartbeatNotif(("cmpl-71-0-dddddddd",)), "d")], p2.now)
    p2.clock.jump_to(100.0)  # everything at once: still deadline order
    p2.worker.get_finished((), p2.now)
    assert [key for key, _ in p2.retired] == [
        "cmpl-71-1-0a0a0a0a",
        "cmpl-71-2-0a0a0a0a",
        "cmpl-71-0-0a0a0a0a",
    ]


def test_B08_a_lost_peer_is_forgotten_and_the_next_operation_re_handshakes() -> None:
    p = writer("prefill")
    p.on_notif("d-agent", encode_push_reg(registration("cmpl-80-0-dddddddd")), 0.0)
    p.on_finished_blocks("cmpl-80-0-0a0a0a0a", (1,), 0.0)
    p.on_handshake_result(D_ENGINE.engine_id, True, 0.0)
    p.take_effects()
    assert p.is_connected(D_ENGINE.engine_id)
    p.on_peer_lost(D_ENGINE.engine_id, 0.0)
    assert p.take_effects() == [DropRemoteAgent(D_ENGINE.engine_id)]
    p.on_notif("d-agent", encode_push_reg(registration("cmpl-80-1-dddddddd")), 0.0)
    p.on_finished_blocks("cmpl-80-1-0a0a0a0a", (2,), 0.0)
    assert StartHandshake(D_ENGINE.engine_id, D_ENGINE.host, D_ENGINE.port) in p.take_effects()


def test_B08_a_restarted_decoder_is_re_handshaked_and_served() -> None:
    w = world()
    first = w.issue(1)
    w.run_for(1.0)
    assert w.ledger.clients[first].completed
    old_agent = w.decode.transport.agent_name
    w.crash("decode")
    w.restart("decode")
    assert w.decode.transport.agent_name != old_agent
    later = [w.issue(1) for _ in range(3)]
    w.run_for(w.settings.push.registration_timeout + 10)
    assert w.ledger.clients[later[-1]].completed
    assert w.prefill.transport.peer("decode-0").agent_name == w.decode.transport.agent_name  # type: ignore[union-attr]
    finish(w)


def test_B08_a_registration_from_a_dead_decoder_is_never_written_into_its_successor() -> None:
    w = world()
    spy = Spy(w)
    client = w.issue(2)
    late = hold(w, "prefill")
    w.run_for(0.0)  # PUSH_REG is on the wire from D's first agent
    assert spy.sent(PUSH_REG_PREFIX)
    w.run_for(0.01)  # and waits at P for blocks
    assert w.prefill.side.writer.pending_d_registrations
    w.crash("decode")
    w.restart("decode")
    release(w, "prefill", late)
    w.run_for(5.0)
    assert spy.writes == []  # matched, re-handshaked, found stale: not written
    assert w.prefill.side.failed_transfers == 1
    assert w.ledger.clients[client].d == "lost"
    finish(w)


# -- bad input (issue 3) -------------------------------------------------------------------


def _inject(w: SimulatedPushWorld, role: str, peer: str, data: bytes) -> None:
    w.engine(role).transport.inbox.append((peer, data))


@pytest.mark.parametrize(
    ("role", "data", "what"),
    [
        ("prefill", b"PUSH_REG:\xc1\x00garbage", "malformed PUSH_REG"),
        ("prefill", b"PUSH_REG:" + b"\x00" * (1 << 20), "oversized PUSH_REG"),
        ("decode", b"cmpl-404-0-dddddddd:1", "completion for an unknown request"),
        ("decode", b"cmpl-1-0-dddddddd:abc", "non-numeric tp_size"),
        ("prefill", b"HB:cmpl-404-0-dddddddd,cmpl-405-0-dddddddd", "HB for unknown ids"),
    ],
)
def test_R_P08_bad_input_is_counted_logged_once_per_peer_and_changes_nothing(
    role: str, data: bytes, what: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = world()
    client = w.issue(2)
    w.run_for(2.0)
    assert w.ledger.clients[client].completed
    engine = w.engine(role)
    side = engine.side

    def rejected() -> int:
        return side.writer.rejected_notifs + side.worker.rejected_notifs

    before = (rejected(), side.bus.live(P_LEASE), side.bus.live(D_REGISTRATION))
    tables = (dict(side.writer.pending_d_registrations), dict(side.writer.push_finished_blocks))
    logging.getLogger("kvhandoff").setLevel(logging.NOTSET)
    with caplog.at_level(logging.WARNING, logger="kvhandoff"):
        for peer in ("bad-peer-1", "bad-peer-1", "bad-peer-2"):
            _inject(w, role, peer, data)
            w.writer_pass(role)
            w.step(role)
    assert rejected() == before[0] + 3, what
    assert (side.bus.live(P_LEASE), side.bus.live(D_REGISTRATION)) == before[1:]
    assert (side.writer.pending_d_registrations, side.writer.push_finished_blocks) == tables
    warned = [r.getMessage() for r in caplog.records if "rejected notif" in r.getMessage()]
    assert len(warned) == 2 and {m.split()[3].rstrip(":") for m in warned} == {
        "bad-peer-1",
        "bad-peer-2",
    }
    late = w.issue(2)  # the writer keeps running
    w.run_for(2.0)
    assert w.ledger.clients[late].completed
    finish(w)
