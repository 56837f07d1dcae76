"""Push mode requirement by requirement, sans-IO: roles, registration, staging, matching,
handshakes, the WRITE, the wake model, notif routing and completion accounting
(R-P01..R-P09). The failure paths and deadlines (R-P10..R-P15, B-06..B-08, bad input)
are in `test_push_requirements_failures.py`; R-P14 (member routing) in
`test_member_routing.py`; the engine's topology in `test_push_topology.py`.

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
    P_COORDS,
    P_ENGINE,
    Halves,
    Spy,
    clean,
    finish,
    from_d,
    from_p,
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
    ArmSelfPoll,
    DisarmSelfPoll,
    ForwardToMain,
    IssueWrite,
    ReplayPush,
    ReportToMain,
    RevokeLease,
    SendPushReg,
    SendRegistration,
    StageBlocks,
    StartHandshake,
)
from kvhandoff.machines.push.events import (
    HandshakeDone,
    HandshakeFailed,
    HandshakeStarted,
    Matched,
    RegSent,
    Revoked,
)
from kvhandoff.machines.push.match import MATCH
from kvhandoff.machines.push.meta import PushConnectorMeta
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.p_request import P_REQUEST
from kvhandoff.machines.push.remote_engine import REMOTE_ENGINE
from kvhandoff.protocol.blocks import expand_to_physical
from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg, prefill_leg
from kvhandoff.protocol.notifs import (
    CompletionNotif,
    HeartbeatNotif,
    encode_completion_notif,
    encode_heartbeat,
)
from kvhandoff.protocol.push_wire import PUSH_REG_PREFIX, encode_push_reg
from kvhandoff.protocol.request_ids import get_base_request_id


@pytest.fixture(autouse=True)
def _restore_log_level() -> Any:
    yield
    logging.getLogger("kvhandoff").setLevel(logging.NOTSET)


# -- R-P01 roles and legs ------------------------------------------------------------------


def test_R_P01_proxy_legs_carry_roles_and_prefill_coordinates() -> None:
    request = {"request_id": "cmpl-1-0", "prompt": "hi", "max_tokens": 64}
    p_leg = prefill_leg(request)
    assert p_leg["max_tokens"] == 1
    assert p_leg["kv_transfer_params"]["do_remote_decode"] is True
    d_leg = decode_leg(request, PrefillCoordinates("prefill-7", "10.1.1.1", 6000, 2))
    params = d_leg["kv_transfer_params"]
    assert d_leg["max_tokens"] == 64 and params["do_remote_prefill"] is True
    assert (params["remote_engine_id"], params["remote_host"]) == ("prefill-7", "10.1.1.1")
    assert (params["remote_port"], params["tp_size"]) == (6000, 2)  # vLLM's names (C-01)
    d = Halves("decode")
    d.sched.update_state_after_alloc("cmpl-1-0-aaaaaaaa", [3, 4], params, d.now)
    reg = d.sched.build_connector_meta(d.now).push_registrations["cmpl-1-0-aaaaaaaa"]
    assert (reg.remote_engine_id, reg.remote_port, reg.remote_tp_size) == ("prefill-7", 6000, 2)
    assert (reg.decode_engine_id, reg.block_ids) == (D_ENGINE.engine_id, (3, 4))


# -- R-P02 D registration ------------------------------------------------------------------


def test_R_P02_registration_flows_from_alloc_to_a_push_reg_notif() -> None:
    w = world()
    spy = Spy(w)
    client = w.issue(2)
    hold(w, "prefill")
    w.step("decode")
    d = w.decode
    rank = d.side.ranks[0]
    d_id = w.ledger.clients[client].d_id
    assert d_id is not None
    assert d.side.scheduler.bus.has_tag(D_REQUEST, d_id, "needs_heartbeat")
    assert rank.bus.has_tag(D_REGISTRATION, d_id, "reg_unsent")
    (command,) = rank.writer_inbox
    assert isinstance(command, SendRegistration) and command.request_id == d_id
    assert rank.wake.is_set()
    w.writer_pass("decode")  # first contact: the handshake runs first (R-P05)
    assert spy.sent(PUSH_REG_PREFIX) == []
    w.run_job("decode")
    w.writer_pass("decode")  # the pass that takes the result replays the registration
    (message,) = spy.sent(PUSH_REG_PREFIX)
    assert message == encode_push_reg(command.registration)
    w.step("decode")
    assert rank.bus.has_tag(D_REGISTRATION, d_id, "receiving")
    clean(w)


# -- R-P03 P staging -----------------------------------------------------------------------


def test_R_P03_request_finished_stashes_blocks_for_the_lease_and_the_next_step() -> None:
    p = Halves("prefill")
    rid = "cmpl-2-0-aaaaaaaa"
    assert p.sched.request_finished(rid, [4, 5], {"do_remote_decode": False}, p.now) == (
        False,
        None,
    )
    assert not p.sched.has_pending_push_work()
    delay, params = p.sched.request_finished(rid, [4, 5], {"do_remote_decode": True}, p.now)
    # C-01: like a stock vLLM P, the decode leg's params (P's coordinates and its own id).
    assert delay and params is not None
    assert (params["remote_request_id"], params["remote_block_ids"]) == (rid, [[4, 5]])
    assert (params["tp_size"], params["do_remote_prefill"]) == (1, True)
    assert p.sched.has_pending_push_work()
    assert p.sched.bus.has_tag(P_REQUEST, rid, "drainable")
    meta = p.sched.build_connector_meta(p.now)
    assert meta.push_finished_blocks == {rid: (4, 5)}
    p.worker.start_load_kv(meta, p.now)
    assert p.effects() == [StageBlocks(rid, (4, 5))]
    assert p.state(P_LEASE, rid) == "staged" and p.wakes == 1
    assert p.sched.build_connector_meta(p.now).push_finished_blocks == {}  # handed over once


# -- R-P04 matching ------------------------------------------------------------------------


@pytest.mark.parametrize("first", ["registration", "blocks"])
def test_R_P04_either_side_may_arrive_first_and_ids_match_by_base(first: str) -> None:
    w = world()
    client = w.issue(3)
    late_role = "prefill" if first == "registration" else "decode"
    late = hold(w, late_role)
    w.run_for(2.0)  # the early side gets as far as it can alone
    writer_core = w.prefill.side.ranks[0].writer
    record = w.ledger.clients[client]
    base = get_base_request_id(record.d_id or record.p_id or "")
    tag = "pending_registration" if first == "registration" else "awaiting_registration"
    assert writer_core.bus.has_tag(MATCH, base, tag)
    assert writer_core.self_polling == (first == "blocks")
    release(w, late_role, late)
    w.run_for(2.0)
    record = w.ledger.clients[client]
    assert record.completed and record.p == "freed"
    assert record.p_id != record.d_id
    assert get_base_request_id(record.p_id or "") == get_base_request_id(record.d_id or "")
    assert writer_core.bus.has_tag(MATCH, base, "tombstone")
    assert not writer_core.self_polling
    finish(w)


def test_R_P04_completion_index_keeps_sub_requests_apart() -> None:
    p = writer("prefill")
    p.on_command(StageBlocks("cmpl-9-0-aaaaaaaa", (1,)), 0.0)
    p.on_command(StageBlocks("cmpl-9-1-bbbbbbbb", (2,)), 0.0)
    p.take_effects()
    p.on_notif(D_AGENT, None, encode_push_reg(registration("cmpl-9-1-cccccccc")), 0.0)
    reports = [e for e in p.take_effects() if isinstance(e, ReportToMain)]
    assert reports[0] == ReportToMain(
        "cmpl-9-1-bbbbbbbb", Matched(D_ENGINE.engine_id, (D_AGENT,)), D_AGENT
    )
    assert p.bus.has_tag(MATCH, "cmpl-9-0", "awaiting_registration")
    assert p.bus.has_tag(MATCH, "cmpl-9-1", "write_pending")


# -- R-P05 handshake defer and replay ------------------------------------------------------


def test_R_P05_d_registration_waits_for_the_handshake_and_is_replayed() -> None:
    d = writer("decode")
    reg = registration("cmpl-3-0-dddddddd")
    d.on_command(SendRegistration(reg.request_id, reg), 0.0)
    assert d.take_effects() == [
        StartHandshake(P_ENGINE.engine_id, P_ENGINE.host, P_ENGINE.port, 1),
        ReportToMain(reg.request_id, HandshakeStarted()),
    ]
    engine = d.bus.get(REMOTE_ENGINE, P_ENGINE.engine_id)
    assert engine is not None and engine.has("deferring") and len(engine.ctx.deferred) == 1
    d.on_handshake_result(P_ENGINE.engine_id, 1, True, 0.0)
    assert d.take_effects() == [
        ReportToMain(reg.request_id, HandshakeDone()),
        SendPushReg(reg.request_id, reg),
    ]
    again = registration("cmpl-3-1-dddddddd")
    d.on_command(SendRegistration(again.request_id, again), 0.0)  # connected: at once
    assert d.take_effects() == [SendPushReg(again.request_id, again)]


def test_R_P05_p_push_waits_for_the_handshake_and_is_replayed() -> None:
    p = writer("prefill")
    reg = registration("cmpl-4-0-dddddddd")
    p.on_notif(D_AGENT, None, encode_push_reg(reg), 0.0)
    p.on_command(StageBlocks("cmpl-4-0-0a0a0a0a", (7, 8)), 0.0)
    effects = p.take_effects()
    assert (
        ReportToMain("cmpl-4-0-0a0a0a0a", Matched(D_ENGINE.engine_id, (D_AGENT,)), D_AGENT)
        in effects
    )
    assert StartHandshake(D_ENGINE.engine_id, D_ENGINE.host, D_ENGINE.port, 1) in effects
    p.on_handshake_result(D_ENGINE.engine_id, 1, True, 0.0)
    (write,) = [e for e in p.take_effects() if isinstance(e, IssueWrite)]
    assert isinstance(write.op, ReplayPush)
    assert (write.op.request_id, write.op.block_ids) == ("cmpl-4-0-0a0a0a0a", (7, 8))
    assert [(r.d_rank, r.registration, r.sender) for r in write.op.registrations] == [
        (0, reg, D_AGENT)
    ]


def test_R_P05_a_failed_handshake_fails_its_operations_without_a_retry_loop() -> None:
    d = writer("decode")
    for n in (1, 2):
        reg = registration(f"cmpl-5-{n}-dddddddd")
        d.on_command(SendRegistration(reg.request_id, reg), 0.0)
    d.take_effects()
    d.on_handshake_result(P_ENGINE.engine_id, 1, False, 0.0)
    effects = d.take_effects()
    assert [e for e in effects if isinstance(e, ReportToMain)] == [
        ReportToMain("cmpl-5-1-dddddddd", HandshakeFailed()),
        ReportToMain("cmpl-5-2-dddddddd", HandshakeFailed()),
    ]
    assert not any(isinstance(e, StartHandshake | SendPushReg) for e in effects)


def test_R_P05_handshakes_run_on_the_executor_and_their_callback_wakes_the_writer() -> None:
    w = world()
    w.issue(1)
    w.step("decode")
    w.writer_pass("decode")
    d = w.decode
    rank = d.side.ranks[0]
    assert len(d.executor.jobs) == 1 and not rank.handshake_results  # not run inline
    rank.wake.clear()
    w.run_job("decode")
    assert rank.wake.is_set() and len(rank.handshake_results) == 1
    clean(w)


# -- R-P06 WRITE ---------------------------------------------------------------------------


def test_R_P06_write_expands_logical_ids_and_notifies_with_ds_own_id() -> None:
    w = world(ratio=2)
    spy = Spy(w)
    client = w.issue(3)
    w.run_for(2.0)
    record = w.ledger.clients[client]
    assert record.completed
    (transfer,) = spy.writes
    assert not w.prefill.pool.owner  # freed by now
    assert transfer.remote_ids == tuple(expand_to_physical(record.d_blocks, 2))
    assert len(transfer.local_ids) == 2 * record.num_blocks
    assert transfer.notif == encode_completion_notif(record.d_id or "", 1)
    finish(w)


# -- R-P07 wake model ----------------------------------------------------------------------


def test_R_P07_start_load_kv_wakes_only_when_it_hands_over_work() -> None:
    d = Halves("decode")
    d.worker.start_load_kv(PushConnectorMeta(), d.now)
    assert d.wakes == 0
    d.sched.update_state_after_alloc(
        "cmpl-6-0-aaaaaaaa", [1], decode_leg({}, P_COORDS)["kv_transfer_params"], d.now
    )
    d.hand_over()
    assert d.wakes == 1
    d.hand_over()  # nothing new
    assert d.wakes == 1


def test_R_P07_get_finished_always_wakes_the_writer() -> None:
    p = Halves("prefill")
    for expected in (1, 2, 3):
        p.worker.get_finished(p.now)
        assert p.wakes == expected


def test_R_P07_self_poll_while_blocks_wait_unmatched_then_disarm() -> None:
    p = writer("prefill")
    p.on_command(StageBlocks("cmpl-7-0-aaaaaaaa", (1,)), 0.0)
    assert ArmSelfPoll(0.001) in p.take_effects()
    p.on_notif(D_AGENT, None, encode_push_reg(registration("cmpl-7-0-dddddddd")), 0.0)
    assert DisarmSelfPoll() in p.take_effects()  # matched: nothing waits any more
    p.on_command(StageBlocks("cmpl-7-1-aaaaaaaa", (2,)), 0.0)
    assert ArmSelfPoll(0.001) in p.take_effects()
    p.on_command(RevokeLease("cmpl-7-1-aaaaaaaa"), 0.0)
    assert p.take_effects() == [ReportToMain("cmpl-7-1-aaaaaaaa", Revoked()), DisarmSelfPoll()]
    assert not p.self_polling


# -- R-P08 notif routing, heartbeats -------------------------------------------------------


def test_R_P08_writer_routes_push_reg_to_matching_and_forwards_the_rest() -> None:
    p = writer("prefill")
    identity = (D_ENGINE.engine_id, 0)
    p.on_notif(D_AGENT, identity, encode_push_reg(registration("cmpl-8-0-dddddddd")), 0.0)
    p.on_notif(D_AGENT, identity, encode_heartbeat(["cmpl-8-0-dddddddd"]), 0.0)
    assert p.bus.has_tag(MATCH, "cmpl-8-0", "pending_registration")
    effects = [e for e in p.take_effects() if isinstance(e, ForwardToMain)]
    assert effects == [from_d(HeartbeatNotif(("cmpl-8-0-dddddddd",)), at=0.0)]
    d = writer("decode")
    d.on_notif("p-agent", (P_ENGINE.engine_id, 0), encode_completion_notif("cmpl-8-0-d", 1), 0.0)
    assert d.take_effects() == [from_p(CompletionNotif("cmpl-8-0-d", 1), "p-agent", at=0.0)]


def _bound_lease(p: Halves, rid: str) -> None:
    p.sched.request_finished(rid, [1], {"do_remote_decode": True}, p.now)
    p.hand_over()
    p.finish(report(rid, Matched(D_ENGINE.engine_id)))


def test_R_P08_heartbeat_extends_the_lease_to_max_of_old_and_now_plus_extension() -> None:
    p = Halves("prefill")
    rid = "cmpl-8-1-0a0a0a0a"
    _bound_lease(p, rid)
    assert p.bus.deadline_of(P_LEASE, rid) == 30.0
    beat = from_d(HeartbeatNotif(("cmpl-8-1-dddddddd",)))  # D's own id
    p.clock.advance(5.0)
    p.finish([beat])
    assert p.bus.deadline_of(P_LEASE, rid) == 30.0  # 5 + 20 < 30: unchanged
    p.clock.advance(10.0)
    p.finish([beat])
    assert p.bus.deadline_of(P_LEASE, rid) == 35.0  # 15 + 20


def test_R_P08_R_P11_a_heartbeat_taken_before_the_deadline_extends_a_lease_reaped_later() -> None:
    """The seed applies notifs, then reaps: a heartbeat the writer took from NIXL before
    the lease's deadline extends it, even when the main thread's step that applies it
    runs after the deadline (a slow engine step); one taken after it does not."""
    p = Halves("prefill")
    rid, late = "cmpl-8-3-0a0a0a0a", "cmpl-8-4-0a0a0a0a"
    _bound_lease(p, rid)
    _bound_lease(p, late)
    assert p.bus.deadline_of(P_LEASE, rid) == 30.0
    p.clock.advance(31.0)  # the step runs after the deadline ...
    beats = [
        from_d(HeartbeatNotif(("cmpl-8-3-dddddddd",)), at=29.5),  # ... taken before it
        from_d(HeartbeatNotif(("cmpl-8-4-dddddddd",)), at=30.5),  # ... taken after it
    ]
    p.finish(beats)
    assert p.bus.has_tag(P_LEASE, rid, "heartbeat_extends"), "extended at 29.5"
    assert p.bus.deadline_of(P_LEASE, rid) == 49.5  # 29.5 + 20
    assert p.state(P_LEASE, late) == "revoking", "its lease ran out at 30, before the beat"


def test_R_P08_R_P12_heartbeats_no_longer_extend_a_lease_whose_handshake_failed() -> None:
    """Nothing retries a failed handshake, so D's heartbeats (sent until D's own watchdog
    gives up) must not keep the dead request's blocks from the pool."""
    p = Halves("prefill")
    rid = "cmpl-8-2-0a0a0a0a"
    _bound_lease(p, rid)
    p.finish(report(rid, HandshakeStarted(), HandshakeFailed()))
    assert p.state(P_LEASE, rid) == "handshake_failed"
    beat = from_d(HeartbeatNotif(("cmpl-8-2-dddddddd",)))
    p.clock.advance(15.0)
    p.finish([beat])
    assert p.bus.deadline_of(P_LEASE, rid) == 30.0, "15 + 20 would have extended a live one"
    p.clock.advance(16.0)
    p.finish()  # the lease ran out: it asks the writer to post nothing more
    assert p.state(P_LEASE, rid) == "revoking"
    assert p.finish(report(rid, Revoked())).finished_sending == (rid,), "freed once revoked"


# -- R-P09 completion accounting -----------------------------------------------------------


def test_R_P09_completion_reports_finished_recving_once_and_clears_the_watchdog() -> None:
    d = Halves("decode")
    rid = "cmpl-9-0-dddddddd"
    d.sched.update_state_after_alloc(
        rid, [1, 2], decode_leg({}, P_COORDS)["kv_transfer_params"], d.now
    )
    d.step()
    assert d.sched.bus.deadline_of(D_REQUEST, rid) == CONFIG.registration_timeout
    done = from_p(CompletionNotif(rid, 1))
    output = d.step([*report(rid, RegSent()), done, done])  # a duplicate changes nothing
    assert output.finished_recving == {rid}
    assert d.sched.bus.get(D_REQUEST, rid) is None  # reported: the watchdog is gone
    assert d.sched_retired == [(rid, "received")] and d.retired == [(rid, "received")]
    assert d.worker.rejected_notifs == 1, "the duplicate names a request already received"
    assert d.step([done]).finished_recving == set()


def test_R_P09_sending_done_frees_the_lease_and_the_writer_forgets_the_request() -> None:
    w = world()
    client = w.issue(2)
    w.run_for(2.0)
    record = w.ledger.clients[client]
    assert record.completed and record.finished_sending == 1
    rank = w.prefill.side.ranks[0]
    assert rank.writer_bus.has_tag(MATCH, get_base_request_id(record.p_id or ""), "tombstone")
    assert not rank.writer.self_polling and not rank.writer_inbox
    assert rank.bus.live(P_LEASE) == 0 and not w.prefill.side.scheduler.has_pending_push_work()
    finish(w)


# -- R-P10: the watchdog, the engine's abort path, and the once-only report ----------------


def _registered(d: Halves, rid: str) -> None:
    d.sched.update_state_after_alloc(
        rid, [1, 2], decode_leg({}, P_COORDS)["kv_transfer_params"], d.now
    )
    d.step(report(rid, RegSent()))


def test_R_P10_a_dropped_registration_waits_for_the_abort_path_then_is_released_once() -> None:
    """The watchdog drops the registration on every rank and never re-sends it; the
    request then waits, with nothing in flight, until the engine's abort path ends it,
    and is reported once: released, with why (vLLM frees its blocks then)."""
    d = Halves("decode")
    rid = "cmpl-10-0-dddddddd"
    _registered(d, rid)
    d.clock.advance(CONFIG.registration_timeout + 1.0)
    d.step()  # the watchdog fires; this step's metadata tells the rank to drop it
    output = d.step()  # the rank dropped it
    assert d.sched.bus.has_tag(D_REQUEST, rid, "given_up")
    assert not d.sched.has_pending_push_work(), "nothing is in flight for it"
    assert not (output.finished_recving or output.failed_recving or output.released)
    assert d.step().released == {}, "not reported before the engine ends it"
    d.sched.abort(rid, d.now)
    assert d.step().released == {rid: "push registration watchdog expired"}
    assert d.sched.bus.get(D_REQUEST, rid) is None
    d.sched.abort(rid, d.now)  # a second abort: nothing left to end, nothing reported
    assert d.step().released == {}


def test_R_P10_an_abort_while_the_ranks_hold_it_is_released_once_every_rank_dropped_it() -> None:
    d = Halves("decode")
    rid, expiring = "cmpl-10-1-dddddddd", "cmpl-10-2-dddddddd"
    _registered(d, rid)
    d.sched.abort(rid, d.now)
    assert d.sched.bus.has_tag(D_REQUEST, rid, "ending")
    # The metadata tells the rank; it drops it and reports it ended; then it is released.
    assert d.step().released == {rid: "aborted"}
    assert d.sched.bus.get(D_REQUEST, rid) is None
    # Ended by the engine while the ranks drop it for the watchdog: released once they did.
    d.clock.advance(1.0)
    _registered(d, expiring)
    d.clock.advance(CONFIG.registration_timeout + 1.0)
    meta = d.sched.build_connector_meta(d.now)  # the watchdog fires: expiring
    d.sched.abort(expiring, d.now)
    assert d.sched.bus.has_tag(D_REQUEST, expiring, "ending")
    d.worker.start_load_kv(meta, d.now)
    ended = d.sched.update_connector_output([d.worker.get_finished(d.now)], d.now)
    assert ended.released == {expiring: "push registration watchdog expired"}
    assert d.step().released == {}
