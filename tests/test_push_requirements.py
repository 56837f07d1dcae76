"""Push mode requirement by requirement (R-P01..R-P15, B-06, B-07, B-08), sans-IO.

Each test drives either the machines and the engine API directly on a `VirtualClock`, or
a whole P/D pair over the in-memory fabric (`SimulatedPushWorld`), where every ordering is
chosen by the test. No sleeps, no timed assertions: time moves only when a test moves it.
R-P14 (member routing) lives in `test_member_routing.py`. The last section is issue 3's
bad input: counted, logged once per peer, no state change, the writer keeps running.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.effects import (
    ArmSelfPoll,
    DisarmSelfPoll,
    DropRemoteAgent,
    EnqueueFinishedBlocks,
    ForwardToMain,
    IssueWrite,
    ReplayPush,
    ReplayRegistration,
    ReportToMain,
    SendPushReg,
    StartHandshake,
    WakeWriter,
)
from kvhandoff.machines.push.events import (
    HandshakeDone,
    HandshakeFailed,
    HandshakeStarted,
    Matched,
    RegSent,
    WritePosted,
    WriteSubmitFailed,
)
from kvhandoff.machines.push.handshake import HANDSHAKE
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.scheduler import (
    LocalEngine,
    PushConnectorMeta,
    PushConnectorOutput,
    PushScheduler,
    register_push_machines,
)
from kvhandoff.machines.push.worker import PushWorker
from kvhandoff.machines.push.writer import PushWriter
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.blocks import expand_to_physical
from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg, prefill_leg
from kvhandoff.protocol.notifs import (
    CompletionNotif,
    HeartbeatNotif,
    encode_completion_notif,
    encode_heartbeat,
)
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PUSH_REG_PREFIX, PushRegistration, encode_push_reg
from kvhandoff.protocol.request_ids import get_base_request_id
from kvhandoff.sim.push.engine import Arrival
from kvhandoff.sim.push.fabric import SimTransfer, SimTransportError
from kvhandoff.sim.push.world import SimSettings, SimulatedPushWorld

P_ENGINE = LocalEngine("prefill-0", "10.0.0.1", 5600)
D_ENGINE = LocalEngine("decode-0", "10.0.0.2", 5700)
P_COORDS = PrefillCoordinates("prefill-0", "10.0.0.1", 5600, 1)
CONFIG = PushConfig()


def registration(request_id: str, blocks: tuple[int, ...] = (1, 2)) -> PushRegistration:
    return PushRegistration(
        request_id=request_id,
        decode_engine_id=D_ENGINE.engine_id,
        decode_host=D_ENGINE.host,
        decode_port=D_ENGINE.port,
        decode_tp_size=1,
        decode_tp_rank=0,
        block_ids=blocks,
        remote_engine_id=P_ENGINE.engine_id,
        remote_host=P_ENGINE.host,
        remote_port=P_ENGINE.port,
        remote_tp_size=1,
    )


# -- harnesses -----------------------------------------------------------------------------


class MainSide:
    """One side's main-thread bus with the scheduler and worker API, effects collected.
    Time is an argument: every call passes `clock.now`."""

    def __init__(self, role: str, clock: VirtualClock | None = None) -> None:
        self.clock = clock or VirtualClock()
        self.bus = EventBus()
        register_push_machines(self.bus, CONFIG)
        engine = P_ENGINE if role == "prefill" else D_ENGINE
        self.sched = PushScheduler(self.bus, role, engine, CONFIG)  # type: ignore[arg-type]
        self.worker = PushWorker(
            self.bus,
            role,  # type: ignore[arg-type]
            engine,
            CONFIG,
            now=self.clock.now,
        )
        self.wakes = 0
        self.bus.handle(WakeWriter, lambda _i, _e: self._woken())
        self.retired: list[tuple[str, str]] = []
        self.bus.on_retire(lambda inst: self.retired.append((inst.key, inst.state)))

    def _woken(self) -> None:
        self.wakes += 1

    def effects(self) -> list[object]:
        return [effect for _inst, effect in self.bus.drain_outbox()]

    def state(self, kind: Declaration[Any], key: str) -> str | None:
        inst = self.bus.get(kind, key)
        return None if inst is None else inst.state

    @property
    def now(self) -> float:
        return self.clock.now


def writer(role: str) -> PushWriter:
    return PushWriter(role, EventBus())  # type: ignore[arg-type]


def report(request_id: str, *events: Event) -> list[ReportToMain]:
    """What the writer thread tells the main thread happened to `request_id`."""
    return [ReportToMain(request_id, event) for event in events]


def world(**settings: Any) -> SimulatedPushWorld:
    logging.getLogger("kvhandoff").setLevel(logging.CRITICAL)
    return SimulatedPushWorld(3, settings=SimSettings(leg_spread_s=0.0, **settings))


@pytest.fixture(autouse=True)
def _restore_log_level() -> Any:
    yield
    logging.getLogger("kvhandoff").setLevel(logging.NOTSET)


class Spy:
    """Sees every notif and WRITE on the fabric, then lets the world check them."""

    def __init__(self, w: SimulatedPushWorld) -> None:
        self.world = w
        self.notifs: list[tuple[str, str, bytes]] = []
        self.writes: list[SimTransfer] = []
        w.network.observer = self

    def notif_sent(self, src: str, dst: str, message: bytes) -> None:
        self.notifs.append((src, dst, message))
        self.world.notif_sent(src, dst, message)

    def write_posted(self, transfer: SimTransfer) -> None:
        self.writes.append(transfer)
        self.world.write_posted(transfer)

    def write_landed(self, transfer: SimTransfer) -> None:
        self.world.write_landed(transfer)

    def sent(self, prefix: bytes) -> list[bytes]:
        return [m for _s, _d, m in self.notifs if m.startswith(prefix)]


def hold(w: SimulatedPushWorld, role: str) -> Arrival:
    """Keep one side's leg back (it arrives when `release` says)."""
    return w.engine(role).arrivals.popleft()


def release(w: SimulatedPushWorld, role: str, arrival: Arrival) -> None:
    engine = w.engine(role)
    engine.arrivals.append(Arrival(arrival.client_id, arrival.num_blocks, w.clock.now))
    engine.dirty = True


def finish(w: SimulatedPushWorld) -> None:
    """Settle, probe and check the whole run: no violation, nothing leaked or hung."""
    w.settle()
    result = w.final_check()
    assert result.ok, (result.violations, result.leftovers)


def clean(w: SimulatedPushWorld) -> None:
    assert w.ledger.violations == []


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
