"""Push mode requirement by requirement, sans-IO: deadlines and failures — D's watchdog,
P's lease, failed handshakes, sends and WRITEs, pending work, heartbeats (R-P10..R-P13,
R-P15), B-06, B-07, B-08, B-10, and bad input: counted, logged once per peer, no state
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
    D_AGENT,
    D_ENGINE,
    Halves,
    Spy,
    clean,
    finish,
    from_d,
    hold,
    registration,
    release,
    report,
    world,
    writer,
)

from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.d_request import D_REQUEST
from kvhandoff.machines.push.effects import (
    DropRemoteAgent,
    RevokeLease,
    StageBlocks,
    StartHandshake,
)
from kvhandoff.machines.push.events import Matched, Revoked, WritePosted, WriteSubmitFailed
from kvhandoff.machines.push.match import MATCH
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.p_request import P_REQUEST
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
    assert w.decode.side.ranks[0].bus.has_tag(D_REGISTRATION, d_id, "receiving")
    logging.getLogger("kvhandoff").setLevel(logging.NOTSET)
    with caplog.at_level(logging.WARNING, logger="kvhandoff"):
        w.advance(w.settings.push.registration_timeout)
        w.step("decode")  # build_connector_meta fires the watchdog; every rank drops it
    assert w.decode.side.scheduler.bus.get(D_REQUEST, d_id) is None
    assert w.decode.side.ranks[0].bus.get(D_REGISTRATION, d_id) is None
    assert any("watchdog expired" in r.getMessage() for r in caplog.records)
    # The request waited for the engine's abort path, which the simulated engine takes
    # at once; the next step reports it released, never received.
    assert w.ledger.clients[client].d == "registered"
    w.step("decode")
    assert w.ledger.clients[client].d == "expired"
    w.run_for(120.0)
    assert len(spy.sent(PUSH_REG_PREFIX)) == 1  # never re-sent
    w.decode.side.abort(d_id)  # nothing left to abort
    clean(w)


# -- R-P11 P lease -------------------------------------------------------------------------


def test_R_P11_an_expired_lease_is_revoked_then_reaped_and_the_writer_forgets_it() -> None:
    p = Halves("prefill")
    rid = "cmpl-11-0-0a0a0a0a"
    p.sched.request_finished(rid, [1, 2], {"do_remote_decode": True}, p.now)
    p.hand_over()
    p.effects()
    p.clock.advance(CONFIG.kv_lease_duration + 1)
    p.sched.build_connector_meta(p.now)
    assert p.state(P_LEASE, rid) == "staged"  # P's leases are not reaped by the scheduler
    output = p.finish()
    assert output.finished_sending == () and p.state(P_LEASE, rid) == "revoking"
    assert p.effects() == [RevokeLease(rid)]  # the writer posts nothing from it any more
    output = p.finish(report(rid, Revoked()))
    assert output.finished_sending == (rid,)
    assert p.retired == [(rid, "expired")]


def test_R_P11_a_write_posted_just_before_expiry_keeps_its_blocks() -> None:
    """A WRITE the writer posted before it saw the revocation suspends the lease: the
    blocks are not freed under the DMA (no lock: the revocation is a typed command and
    the writer's reports arrive in order)."""
    p = Halves("prefill")
    rid = "cmpl-11-1-0a0a0a0a"
    p.sched.request_finished(rid, [1], {"do_remote_decode": True}, p.now)
    p.hand_over()
    p.clock.advance(CONFIG.kv_lease_duration + 1)  # the main thread stalled meanwhile
    output = p.finish(report(rid, Matched(D_ENGINE.engine_id), WritePosted()))
    assert output.finished_sending == ()
    assert p.state(P_LEASE, rid) == "writing"
    p.finish(report(rid, Revoked()))  # the writer's answer to nothing: ignored
    assert p.state(P_LEASE, rid) == "writing"


def test_R_P11_a_lease_revoked_before_its_match_is_never_written() -> None:
    """The lease runs out while D's registration is still on its way: the writer takes
    the revocation first, answers it, and a PUSH_REG that comes later finds no blocks."""
    p = writer("prefill")
    p.on_command(StageBlocks("cmpl-11-2-0a0a0a0a", (1,)), 0.0)
    p.on_command(RevokeLease("cmpl-11-2-0a0a0a0a"), 0.0)
    p.on_notif(D_AGENT, None, encode_push_reg(registration("cmpl-11-2-dddddddd")), 0.0)
    effects = p.take_effects()
    assert not any(type(e).__name__ in ("IssueWrite", "ReplayPush") for e in effects)
    assert p.bus.has_tag(MATCH, "cmpl-11-2", "pending_registration")


def test_R_P11_writer_drops_blocks_of_a_reaped_lease() -> None:
    w = world()
    client = w.issue(2)
    hold(w, "decode")
    w.run_for(1.0)
    writer_core = w.prefill.side.ranks[0].writer
    assert writer_core.awaiting_registration() and writer_core.self_polling
    w.advance(w.settings.push.kv_lease_duration + 1)
    w.run_for(1.0)
    assert w.ledger.clients[client].p == "freed"
    assert not writer_core.awaiting_registration() and not writer_core.self_polling
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

    def refuse(engine_id: str, rank: int, message: bytes) -> None:
        raise SimTransportError("send_notif refused")

    w.decode.transports[0].send_notif = refuse  # type: ignore[method-assign]
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
    rank = p.side.ranks[0]
    assert rank.bus.get(P_LEASE, p_id).state == "handshake_failed"  # type: ignore[union-attr]
    assert not p.executor.jobs  # no requeue, no retry
    # The lease reclaims P's blocks (the seed); D's watchdog drops its registration.
    config = w.settings.push
    w.run_for(config.registration_timeout + 1)
    record = w.ledger.clients[client]
    assert record.p == "freed" and record.d == "expired"
    assert record.finished_sending == 1
    finish(w)


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


def test_R_P15_defaults_lease_30_heartbeat_5_extension_20_derived_from_the_lease() -> None:
    config = PushConfig()
    assert (config.kv_lease_duration, config.heartbeat_every) == (30.0, 5.0)
    assert config.lease_extension == 20.0
    assert config.registration_timeout == config.decoder_kv_blocks_ttl
    short = PushConfig(kv_lease_duration=12.0)  # vLLM 0.33: 2/3 and 1/6 of the lease
    assert (short.lease_extension, short.heartbeat_every) == (8.0, 2.0)
    assert PushConfig(kv_lease_duration=12.0, heartbeat_interval=1.0).heartbeat_every == 1.0


def test_R_P15_heartbeats_leave_every_interval_for_enqueued_registrations() -> None:
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


# -- B-06 / B-10, B-07, B-08 ------------------------------------------------------------


def test_B06_B10_a_write_that_fails_to_post_frees_p_at_once_and_fails_d_at_once() -> None:
    w = world()
    client = w.issue(2)
    w.network.fail_next_write_posts = 1
    w.run_for(0.5)  # far below any watchdog or lease
    record = w.ledger.clients[client]
    assert record.d == "failed"
    assert record.p == "freed", "B-10: nothing is in flight, the blocks are freed at once"
    assert w.prefill.side.failed_transfers == 1
    assert w.prefill.side.stats()["post"] == 1  # B-14
    finish(w)


def test_B10_a_write_that_ends_in_error_frees_p_at_once_and_tells_d() -> None:
    w = world()
    client = w.issue(2)
    w.network.faults = w.network.faults.__class__(write_error=1.0)
    w.run_for(1.0)
    record = w.ledger.clients[client]
    assert (record.p, record.d) == ("freed", "failed")
    assert w.prefill.side.stats()["transfer_error"] == 1
    assert w.decode.side.stats()["transfer_error"] == 1
    w.network.faults = w.network.faults.__class__()
    finish(w)


def test_B07_leases_are_reaped_in_deadline_order_despite_out_of_order_renewals() -> None:
    def lease_three(p: Halves, group: int) -> None:
        for n in range(3):  # leases finish at t = 0, 1, 2: deadlines 30, 31, 32
            rid = f"cmpl-{group}-{n}-0a0a0a0a"
            p.sched.request_finished(rid, [n], {"do_remote_decode": True}, p.now)
            p.hand_over()
            p.finish(report(rid, Matched(D_ENGINE.engine_id)))
            p.clock.advance(1.0)

    p = Halves("prefill")
    lease_three(p, 70)
    p.clock.jump_to(15.0)
    p.finish([from_d(HeartbeatNotif(("cmpl-70-2-dddddddd",)))])
    p.clock.jump_to(16.0)
    p.finish([from_d(HeartbeatNotif(("cmpl-70-0-dddddddd",)))])
    # Now A = 36, B = 31, C = 35.
    order = []
    for when in (31.5, 35.5, 36.5):
        p.clock.jump_to(when)
        p.finish()
        revoked = [e.request_id for e in p.effects() if isinstance(e, RevokeLease)]
        order.append(revoked)
        p.finish([r for rid in revoked for r in report(rid, Revoked())])
    assert order == [["cmpl-70-1-0a0a0a0a"], ["cmpl-70-2-0a0a0a0a"], ["cmpl-70-0-0a0a0a0a"]]
    assert [key for key, _ in p.retired] == [rid for (rid,) in order]
    p2 = Halves("prefill")
    lease_three(p2, 71)
    p2.clock.jump_to(15.0)  # A renewed to 35, after B (31) and C (32)
    p2.finish([from_d(HeartbeatNotif(("cmpl-71-0-dddddddd",)))])
    p2.clock.jump_to(100.0)  # everything at once: still deadline order
    p2.finish()
    assert [e.request_id for e in p2.effects() if isinstance(e, RevokeLease)] == [
        "cmpl-71-1-0a0a0a0a",
        "cmpl-71-2-0a0a0a0a",
        "cmpl-71-0-0a0a0a0a",
    ]


def test_B08_a_lost_peer_is_forgotten_and_the_next_operation_re_handshakes() -> None:
    p = writer("prefill")
    p.on_notif(D_AGENT, None, encode_push_reg(registration("cmpl-80-0-dddddddd")), 0.0)
    p.on_command(StageBlocks("cmpl-80-0-0a0a0a0a", (1,)), 0.0)
    p.on_handshake_result(D_ENGINE.engine_id, 1, True, 0.0)
    p.take_effects()
    assert p.is_connected(D_ENGINE.engine_id)
    p.on_peer_lost(D_ENGINE.engine_id, 0.0)
    assert p.take_effects() == [DropRemoteAgent(D_ENGINE.engine_id)]
    p.on_notif(D_AGENT, None, encode_push_reg(registration("cmpl-80-1-dddddddd")), 0.0)
    p.on_command(StageBlocks("cmpl-80-1-0a0a0a0a", (2,)), 0.0)
    assert StartHandshake(D_ENGINE.engine_id, D_ENGINE.host, D_ENGINE.port, 2) in p.take_effects()


def test_B08_a_restarted_decoder_is_re_handshaked_and_served() -> None:
    w = world()
    first = w.issue(1)
    w.run_for(1.0)
    assert w.ledger.clients[first].completed
    old_agent = w.decode.transports[0].agent_name
    w.crash("decode")
    w.restart("decode")
    new_agent = w.decode.transports[0].agent_name
    assert new_agent != old_agent
    later = [w.issue(1) for _ in range(3)]
    w.run_for(w.settings.push.registration_timeout + 10)
    assert w.ledger.clients[later[-1]].completed
    info = w.prefill.transports[0].engine("decode-0")
    assert info is not None and info.agent(0) == new_agent
    finish(w)


def test_B08_a_registration_from_a_dead_decoder_is_never_written_into_its_successor() -> None:
    w = world()
    spy = Spy(w)
    client = w.issue(2)
    late = hold(w, "prefill")
    w.run_for(0.0)  # PUSH_REG is on the wire from D's first agent
    assert spy.sent(PUSH_REG_PREFIX)
    w.run_for(0.01)  # and waits at P for blocks
    rank = w.prefill.side.ranks[0]
    assert rank.writer.pending_count == 1
    w.crash("decode")
    w.restart("decode")
    release(w, "prefill", late)
    w.run_for(5.0)
    assert spy.writes == []  # matched, re-handshaked, found stale: not written
    assert w.prefill.side.failed_transfers == 1
    assert w.ledger.clients[client].d == "lost"
    finish(w)


# -- bad input -----------------------------------------------------------------------------


def _inject(w: SimulatedPushWorld, role: str, peer: str, data: bytes) -> None:
    w.engine(role).transports[0].inbox.append((peer, data))


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
def test_S_06_bad_input_is_counted_logged_once_per_peer_and_changes_nothing(
    role: str, data: bytes, what: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = world()
    client = w.issue(2)
    w.run_for(2.0)
    assert w.ledger.clients[client].completed
    engine = w.engine(role)
    side = engine.side
    rank = side.ranks[0]
    before = (side.rejected_notifs(), rank.bus.live(P_LEASE), rank.bus.live(D_REGISTRATION))
    slots = rank.writer_bus.live(MATCH)
    logging.getLogger("kvhandoff").setLevel(logging.NOTSET)
    with caplog.at_level(logging.WARNING, logger="kvhandoff"):
        for peer in ("bad-peer-1", "bad-peer-1", "bad-peer-2"):
            _inject(w, role, peer, data)
            w.writer_pass(role)
            w.step(role)
    assert side.rejected_notifs() == before[0] + 3, what
    assert (rank.bus.live(P_LEASE), rank.bus.live(D_REGISTRATION)) == before[1:]
    assert rank.writer_bus.live(MATCH) == slots
    warned = [r.getMessage() for r in caplog.records if "rejected notif" in r.getMessage()]
    assert len(warned) == 2 and {m.split()[3].rstrip(":") for m in warned} == {
        "bad-peer-1",
        "bad-peer-2",
    }
    late = w.issue(2)  # the writer keeps running
    w.run_for(2.0)
    assert w.ledger.clients[late].completed
    assert side.scheduler.bus.live(P_REQUEST) == 0 and side.scheduler.bus.live(D_REQUEST) == 0
    finish(w)


def test_R_P12_WriteSubmitFailed_is_declared_on_the_lease() -> None:
    """The writer's report of a WRITE that failed to post frees the blocks at once."""
    p = Halves("prefill")
    rid = "cmpl-12-9-0a0a0a0a"
    p.sched.request_finished(rid, [1], {"do_remote_decode": True}, p.now)
    p.hand_over()
    output = p.finish(report(rid, Matched(D_ENGINE.engine_id), WriteSubmitFailed()))
    assert output.finished_sending == (rid,) and output.failures == {"post": 1}
