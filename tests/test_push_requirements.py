"""Push mode requirement by requirement, sans-IO: roles, registration, staging, matching,
handshakes, the WRITE, the wake model, notif routing and completion accounting
(R-P01..R-P09). The failure paths and deadlines (R-P10..R-P15, B-06..B-08, bad input)
are in `test_push_requirements_failures.py`; R-P14 (member routing) in
`test_member_routing.py`.

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
    P_COORDS,
    P_ENGINE,
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
    ArmSelfPoll,
    DisarmSelfPoll,
    EnqueueFinishedBlocks,
    ForwardToMain,
    IssueWrite,
    ReplayPush,
    ReplayRegistration,
    ReportToMain,
    SendPushReg,
    StartHandshake,
)
from kvhandoff.machines.push.events import (
    HandshakeDone,
    HandshakeFailed,
    HandshakeStarted,
    Matched,
    RegSent,
    WriteSubmitFailed,
)
from kvhandoff.machines.push.handshake import HANDSHAKE
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.scheduler import PushConnectorMeta
from kvhandoff.machines.runtime.events import Event
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
    assert (params["remote_port"], params["remote_tp_size"]) == (6000, 2)
    d = MainSide("decode")
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
    d_id = w.ledger.clients[client].d_id
    assert d_id is not None
    assert d.side.bus.get(D_REGISTRATION, d_id).state == "queued"  # type: ignore[union-attr]
    assert [op.request_id for op in d.side.reg_send_inbox] == [d_id]
    assert d.side.wake.is_set()
    w.writer_pass("decode")  # first contact: the handshake runs first (R-P05)
    w.run_job("decode")
    w.writer_pass("decode")  # replayed onto the reg-send inbox
    assert spy.sent(PUSH_REG_PREFIX) == []
    w.writer_pass("decode")
    (message,) = spy.sent(PUSH_REG_PREFIX)
    assert message == encode_push_reg(d.side.bus.get(D_REGISTRATION, d_id).ctx.registration)  # type: ignore[union-attr]
    w.step("decode")
    assert d.side.bus.get(D_REGISTRATION, d_id).state == "sent"  # type: ignore[union-attr]
    clean(w)


# -- R-P03 P staging -----------------------------------------------------------------------


def test_R_P03_request_finished_stashes_blocks_for_the_lease_and_the_next_step() -> None:
    p = MainSide("prefill")
    rid = "cmpl-2-0-aaaaaaaa"
    assert p.sched.request_finished(rid, [4, 5], {"do_remote_decode": False}, p.now) == (
        False,
        None,
    )
    assert not p.sched.has_pending_push_work()
    assert p.sched.request_finished(rid, [4, 5], {"do_remote_decode": True}, p.now) == (True, None)
    assert p.sched.has_pending_push_work() and p.state(P_LEASE, rid) == "finished"
    meta = p.sched.build_connector_meta(p.now)
    assert meta.push_finished_blocks == {rid: (4, 5)}
    p.worker.start_load_kv(meta, p.now)
    assert p.effects() == [EnqueueFinishedBlocks(rid, (4, 5))]
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
    writer = w.prefill.side.writer
    if first == "registration":
        assert list(writer.pending_d_registrations) == [w.ledger.clients[client].d_id]
    else:
        assert list(writer.push_finished_blocks) == [w.ledger.clients[client].p_id]
        assert writer.self_polling
    release(w, late_role, late)
    w.run_for(2.0)
    record = w.ledger.clients[client]
    assert record.completed and record.p == "freed"
    assert record.p_id != record.d_id
    assert get_base_request_id(record.p_id or "") == get_base_request_id(record.d_id or "")
    assert not writer.pending_d_registrations and not writer.push_finished_blocks
    finish(w)


def test_R_P04_completion_index_keeps_sub_requests_apart() -> None:
    p = writer("prefill")
    p.on_finished_blocks("cmpl-9-0-aaaaaaaa", (1,), 0.0)
    p.on_finished_blocks("cmpl-9-1-bbbbbbbb", (2,), 0.0)
    p.take_effects()
    p.on_notif("d-agent", encode_push_reg(registration("cmpl-9-1-cccccccc")), 0.0)
    reports = [e for e in p.take_effects() if isinstance(e, ReportToMain)]
    assert reports[0] == ReportToMain("cmpl-9-1-bbbbbbbb", Matched(), peer="d-agent")
    assert list(p.push_finished_blocks) == ["cmpl-9-0-aaaaaaaa"]


# -- R-P05 handshake defer and replay ------------------------------------------------------


def test_R_P05_d_registration_waits_for_the_handshake_and_is_replayed() -> None:
    d = writer("decode")
    reg = registration("cmpl-3-0-dddddddd")
    d.on_reg_send(reg.request_id, reg, 0.0)
    assert d.take_effects() == [
        StartHandshake(P_ENGINE.engine_id, P_ENGINE.host, P_ENGINE.port),
        ReportToMain(reg.request_id, HandshakeStarted()),
    ]
    hs = d.bus.get(HANDSHAKE, P_ENGINE.engine_id)
    assert hs is not None and hs.state == "in_progress" and len(hs.ctx.deferred) == 1
    d.on_handshake_result(P_ENGINE.engine_id, True, 0.0)
    assert d.take_effects() == [
        ReportToMain(reg.request_id, HandshakeDone()),
        ReplayRegistration(reg.request_id, reg),
    ]
    d.on_reg_send(reg.request_id, reg, 0.0)  # the second pass finds the agent connected
    assert d.take_effects() == [SendPushReg(reg.request_id, reg)]


def test_R_P05_p_push_waits_for_the_handshake_and_is_replayed() -> None:
    p = writer("prefill")
    reg = registration("cmpl-4-0-dddddddd")
    p.on_notif("d-agent", encode_push_reg(reg), 0.0)
    p.on_finished_blocks("cmpl-4-0-0a0a0a0a", (7, 8), 0.0)
    effects = p.take_effects()
    assert ReportToMain("cmpl-4-0-0a0a0a0a", Matched(), peer="d-agent") in effects
    assert StartHandshake(D_ENGINE.engine_id, D_ENGINE.host, D_ENGINE.port) in effects
    p.on_handshake_result(D_ENGINE.engine_id, True, 0.0)
    replay = ReplayPush("cmpl-4-0-0a0a0a0a", (7, 8), reg, "d-agent")
    assert replay in p.take_effects()
    p.on_deferred_push(replay, 0.0)
    assert p.take_effects() == [IssueWrite("cmpl-4-0-0a0a0a0a", (7, 8), reg, "d-agent")]


def test_R_P05_a_failed_handshake_fails_its_operations_without_a_retry_loop() -> None:
    d = writer("decode")
    for n in (1, 2):
        reg = registration(f"cmpl-5-{n}-dddddddd")
        d.on_reg_send(reg.request_id, reg, 0.0)
    d.take_effects()
    d.on_handshake_result(P_ENGINE.engine_id, False, 0.0)
    effects = d.take_effects()
    assert [e for e in effects if isinstance(e, ReportToMain)] == [
        ReportToMain("cmpl-5-1-dddddddd", HandshakeFailed()),
        ReportToMain("cmpl-5-2-dddddddd", HandshakeFailed()),
    ]
    assert not any(isinstance(e, StartHandshake | ReplayRegistration) for e in effects)


def test_R_P05_handshakes_run_on_the_executor_and_their_callback_wakes_the_writer() -> None:
    w = world()
    w.issue(1)
    w.step("decode")
    w.writer_pass("decode")
    d = w.decode
    assert len(d.executor.jobs) == 1 and not d.side.handshake_results  # not run inline
    d.side.wake.clear()
    w.run_job("decode")
    assert d.side.wake.is_set() and len(d.side.handshake_results) == 1
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
    p_blocks = w.prefill.pool.owner  # freed by now: compare with what the ledger saw
    assert not p_blocks
    assert transfer.remote_ids == tuple(expand_to_physical(record.d_blocks, 2))
    assert len(transfer.local_ids) == 2 * record.num_blocks
    assert transfer.notif == encode_completion_notif(record.d_id or "", 1)
    finish(w)


# -- R-P07 wake model ----------------------------------------------------------------------


def test_R_P07_start_load_kv_wakes_only_when_it_hands_over_work() -> None:
    d = MainSide("decode")
    d.worker.start_load_kv(PushConnectorMeta(), d.now)
    assert d.wakes == 0
    d.sched.update_state_after_alloc(
        "cmpl-6-0-aaaaaaaa", [1], decode_leg({}, P_COORDS)["kv_transfer_params"], d.now
    )
    d.worker.start_load_kv(d.sched.build_connector_meta(d.now), d.now)
    assert d.wakes == 1
    d.worker.start_load_kv(d.sched.build_connector_meta(d.now), d.now)  # nothing new
    assert d.wakes == 1


def test_R_P07_get_finished_always_wakes_the_writer() -> None:
    p = MainSide("prefill")
    for expected in (1, 2, 3):
        p.worker.get_finished((), p.now)
        assert p.wakes == expected


def test_R_P07_self_poll_while_blocks_wait_unmatched_then_disarm() -> None:
    p = writer("prefill")
    p.on_finished_blocks("cmpl-7-0-aaaaaaaa", (1,), 0.0)
    assert ArmSelfPoll(0.001) in p.take_effects()
    p.on_notif("d-agent", encode_push_reg(registration("cmpl-7-0-dddddddd")), 0.0)
    assert DisarmSelfPoll() in p.take_effects()  # matched: nothing waits any more
    p.on_finished_blocks("cmpl-7-1-aaaaaaaa", (2,), 0.0)
    assert ArmSelfPoll(0.001) in p.take_effects()
    p.on_evict("cmpl-7-1-aaaaaaaa")
    assert p.take_effects() == [DisarmSelfPoll()]
    assert not p.self_polling


# -- R-P08 notif routing, heartbeats -------------------------------------------------------


def test_R_P08_writer_routes_push_reg_to_matching_and_forwards_the_rest() -> None:
    p = writer("prefill")
    p.on_notif("d-agent", encode_push_reg(registration("cmpl-8-0-dddddddd")), 0.0)
    p.on_notif("d-agent", encode_heartbeat(["cmpl-8-0-dddddddd"]), 0.0)
    assert list(p.pending_d_registrations) == ["cmpl-8-0-dddddddd"]
    assert p.take_effects() == [
        ForwardToMain(HeartbeatNotif(("cmpl-8-0-dddddddd",)), "d-agent"),
    ]
    d = writer("decode")
    d.on_notif("p-agent", encode_completion_notif("cmpl-8-0-dddddddd", 1), 0.0)
    assert d.take_effects() == [ForwardToMain(CompletionNotif("cmpl-8-0-dddddddd", 1), "p-agent")]


def test_R_P08_heartbeat_extends_the_lease_to_max_of_old_and_now_plus_extension() -> None:
    p = MainSide("prefill")
    rid = "cmpl-8-1-0a0a0a0a"
    p.sched.request_finished(rid, [1], {"do_remote_decode": True}, p.now)
    p.worker.start_load_kv(p.sched.build_connector_meta(p.now), p.now)
    assert p.bus.deadline_of(P_LEASE, rid) == 30.0
    beat = ForwardToMain(HeartbeatNotif(("cmpl-8-1-dddddddd",)), "d-agent")  # D's own id
    p.clock.advance(5.0)
    p.worker.get_finished([beat], p.now)
    assert p.bus.deadline_of(P_LEASE, rid) == 30.0  # 5 + 20 < 30: unchanged
    p.clock.advance(10.0)
    p.worker.get_finished([beat], p.now)
    assert p.bus.deadline_of(P_LEASE, rid) == 35.0  # 15 + 20


@pytest.mark.parametrize(
    "failure", [(HandshakeStarted(), HandshakeFailed()), (WriteSubmitFailed(),)]
)
def test_R_P08_R_P12_heartbeats_no_longer_extend_a_lease_whose_push_failed(
    failure: tuple[Event, ...],
) -> None:
    """Nothing retries a failed handshake or WRITE, so D's heartbeats (sent until D's
    own watchdog gives up) must not keep the dead request's blocks from the pool."""
    p = MainSide("prefill")
    rid = "cmpl-8-2-0a0a0a0a"
    p.sched.request_finished(rid, [1], {"do_remote_decode": True}, p.now)
    p.worker.start_load_kv(p.sched.build_connector_meta(p.now), p.now)
    p.worker.get_finished(report(rid, Matched(), *failure), p.now)
    assert p.state(P_LEASE, rid) in ("handshake_failed", "write_failed")
    beat = ForwardToMain(HeartbeatNotif(("cmpl-8-2-dddddddd",)), "d-agent")
    p.clock.advance(15.0)
    p.worker.get_finished([beat], p.now)
    assert p.bus.deadline_of(P_LEASE, rid) == 30.0, "15 + 20 would have extended a live one"
    p.clock.advance(16.0)
    assert p.worker.get_finished([beat], p.now).finished_sending == {rid}, "reaped at its deadline"


# -- R-P09 completion accounting -----------------------------------------------------------


def test_R_P09_completion_reports_finished_recving_once_and_clears_the_watchdog() -> None:
    d = MainSide("decode")
    rid = "cmpl-9-0-dddddddd"
    d.sched.update_state_after_alloc(
        rid, [1, 2], decode_leg({}, P_COORDS)["kv_transfer_params"], d.now
    )
    d.worker.start_load_kv(d.sched.build_connector_meta(d.now), d.now)
    d.worker.get_finished(report(rid, RegSent()), d.now)
    assert d.bus.deadline_of(D_REGISTRATION, rid) == CONFIG.registration_timeout
    done = ForwardToMain(CompletionNotif(rid, 1), "p-agent")
    output = d.worker.get_finished([done, done], d.now)  # a duplicate changes nothing
    assert output.finished_recving == {rid}
    assert d.bus.deadline_of(D_REGISTRATION, rid) is None  # the watchdog is off
    d.sched.update_connector_output(output, d.now)
    assert d.retired == [(rid, "received")]
    assert d.worker.get_finished([done], d.now).finished_recving == set()


def test_R_P09_sending_done_frees_the_lease_and_the_writer_forgets_the_request() -> None:
    w = world()
    client = w.issue(2)
    w.run_for(2.0)
    record = w.ledger.clients[client]
    assert record.completed and record.finished_sending == 1
    writer_core = w.prefill.side.writer
    assert get_base_request_id(record.p_id or "") in writer_core._evicted
    assert not writer_core.self_polling
    assert not w.prefill.side.evict_finished_inbox
    assert w.prefill.side.bus.live(P_LEASE) == 0
    finish(w)
