"""The push path's host-side ordering (issue 18): when the engine step lets its transport
progress, and how often a peer's notifs keep its engine alive.

- B-12: a transport that completes transfers itself (the CUDA IPC path) progresses first
  in every engine step, before the writer's reports are applied, and again after every
  `REPORTS_BETWEEN` of them, so a copy that ended while the step works through a long
  batch of reports completes without waiting for the next step.
- B-11: every notif from an engine keeps it alive; a writer pass that took many of them
  extends the engine's idle deadline once, at the pass's time.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from push_harness import D_ENGINE, P_ENGINE, Halves, from_p, writer

from kvhandoff.adapters.push_side import PushSide
from kvhandoff.bench.probes.push_writer_pass import (
    D_AGENT,
    P_AGENT,
    MemoryTransport,
    connect_deferred,
)
from kvhandoff.machines.kv.effects import ReportToMain, SendRegistration, StartHandshake
from kvhandoff.machines.kv.events import Completion, HandshakeStarted, Matched, RegSent, WritePosted
from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.remote_engine import REMOTE_ENGINE
from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler
from kvhandoff.machines.rank.worker import REPORTS_BETWEEN, PushWorker
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg
from kvhandoff.protocol.notifs import encode_completion_notif, parse_notif
from kvhandoff.protocol.push_config import PushConfig

REQUESTS = 20


class _Recording(MemoryTransport):
    """The in-memory transport, noting how many writer reports the rank had applied each
    time the engine step let it progress."""

    def __init__(self, *args: object, applied: list[int]) -> None:
        super().__init__(*args)  # type: ignore[arg-type]
        self.applied = applied
        self.progressed_at: list[int] = []

    def progress(self) -> None:
        self.progressed_at.append(self.applied[0])


def _pair() -> tuple[PushSide, PushSide, _Recording, list[int]]:
    applied = [0]
    tp = _Recording("P", P_AGENT, "D", D_AGENT, 1024, applied=applied)
    td = MemoryTransport("D", D_AGENT, "P", P_AGENT, 1024)
    tp.peer, td.peer = td, tp
    p = PushSide("prefill", LocalEngine("P", "127.0.0.1", 5600), tp, lambda job: None)
    d = PushSide("decode", LocalEngine("D", "127.0.0.1", 5700), td, lambda job: None)
    return p, d, tp, applied


def test_B_12_the_transport_progresses_first_and_between_chunks_of_reports(
    monkeypatch: object,
) -> None:
    p, d, tp, applied = _pair()
    on_reports = PushWorker._on_reports

    def counting(
        self: PushWorker, event: object, peer: str | None, request_ids: list[str], now: float
    ) -> None:
        applied[0] += len(request_ids)
        on_reports(self, event, peer, request_ids, now)  # type: ignore[arg-type]

    monkeypatch.setattr(PushWorker, "_on_reports", counting)  # type: ignore[attr-defined]
    prefill = PrefillCoordinates("P", "127.0.0.1", 5600, 1)
    for q in range(REQUESTS):
        leg = decode_leg({"request_id": f"cmpl-r{q}-0"}, prefill)
        d.update_state_after_alloc(f"cmpl-r{q}-0-ffff0000", [q], leg["kv_transfer_params"])
    d.step()
    d.writer_pass()
    connect_deferred(d.ranks[0])
    d.writer_pass()  # every PUSH_REG left D ...
    p.writer_pass()  # ... and P's writer holds them
    for q in range(REQUESTS):
        p.request_finished(f"cmpl-r{q}-0-abcd1234", [q], {"do_remote_decode": True})
    p.step()  # hands the blocks over
    p.writer_pass()  # matches, and meets P's remote engine for D: a handshake
    connect_deferred(p.ranks[0])  # which succeeds: every WRITE is issued
    reports = len(p.ranks[0].pending_completion_notifs)
    assert reports >= 2 * REQUESTS  # matched and posted, for each request
    tp.progressed_at.clear()
    before = applied[0]
    sent = set(p.step().finished_sending)
    seen = [n - before for n in tp.progressed_at]
    assert seen[0] == 0, "progress comes before any report is applied"
    chunks = [n for n in seen if n > 0]
    assert chunks[: reports // REPORTS_BETWEEN] == [
        REPORTS_BETWEEN * k for k in range(1, reports // REPORTS_BETWEEN + 1)
    ]
    received: set[str] = set()
    for _ in range(10):  # the pair still completes every request
        sent |= set(p.step().finished_sending)
        d.writer_pass()
        received |= set(d.step().finished_recving)
    assert len(sent) == len(received) == REQUESTS


def test_B_11_a_pass_of_many_notifs_keeps_their_engine_alive_once() -> None:
    """D's writer: P's completion notifs keep P's engine alive (its idle deadline moves to
    the pass's time plus `engine_ttl`), with one `Touch` however many notifs it sent."""
    config = PushConfig()
    w = writer("decode")
    prefill = PrefillCoordinates(P_ENGINE.engine_id, P_ENGINE.host, P_ENGINE.port, 1)
    leg = decode_leg({"request_id": "cmpl-x-0"}, prefill)
    scheduler = PushScheduler("decode", D_ENGINE, config, now=0.0)
    scheduler.update_state_after_alloc("cmpl-x-0-ffff0000", [1], leg["kv_transfer_params"], 0.0)
    registration = scheduler.build_connector_meta(0.0).push_registrations["cmpl-x-0-ffff0000"]
    w.on_command(SendRegistration("cmpl-x-0-ffff0000", registration), 0.0)
    (start,) = [e for e in w.take_effects() if isinstance(e, StartHandshake)]
    w.on_handshake_result(P_ENGINE.engine_id, start.attempt, True, 1.0)
    w.take_effects()
    ttl = config.engine_ttl
    assert w.bus.deadline_of(REMOTE_ENGINE, P_ENGINE.engine_id) == 1.0 + ttl
    touches: list[str] = []
    touch = w._touch

    def counted(engine_id: str, now: float) -> None:
        touches.append(engine_id)
        touch(engine_id, now)

    w._touch = counted  # type: ignore[method-assign]
    for q in range(5):
        notif = encode_completion_notif(f"cmpl-x{q}-0-ffff0000", 1)
        w.on_notif("prefill-0-agent1", (P_ENGINE.engine_id, 0), notif, 50.0)
    w.advance(50.0)  # the writer pass ends
    assert touches == [P_ENGINE.engine_id]
    assert w.bus.deadline_of(REMOTE_ENGINE, P_ENGINE.engine_id) == 50.0 + ttl


_EVENTS = (Matched("D", ("D-agent",)), WritePosted(1), WritePosted(2), HandshakeStarted())


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 4), st.integers(0, len(_EVENTS) - 1), st.sampled_from([None, "a"])
        ),
        max_size=80,
    )
)
def test_R_P08_reports_apply_in_batches_without_reordering_any_request(
    reports: list[tuple[int, int, str | None]],
) -> None:
    """The writer's reports reach the main thread's machines as one batch per equal
    (event, peer), yet every request meets its own reports in the order they were made."""
    worker = PushWorker("prefill", "P", PushConfig(), now=0.0)
    applied: list[tuple[object, str | None, list[str]]] = []
    worker._on_reports = lambda event, peer, request_ids, now: applied.append(
        (event, peer, request_ids)
    )  # type: ignore[method-assign]
    items = [ReportToMain(f"r{q}", _EVENTS[e], peer) for q, e, peer in reports]
    worker.take_writer_items(items, 1.0)
    for q in {q for q, _e, _p in reports}:
        made = [(item.event, item.peer) for item in items if item.request_id == f"r{q}"]
        seen = [(ev, peer) for ev, peer, ids in applied for key in ids if key == f"r{q}"]
        assert seen == made
    assert sum(len(ids) for _e, _p, ids in applied) == len(items)


def test_R_P08_an_interleaved_pass_is_one_batch_per_event() -> None:
    """matched, posted, matched, posted, ... for N requests is two batches, not 2N."""
    worker = PushWorker("prefill", "P", PushConfig(), now=0.0)
    applied: list[tuple[object, list[str]]] = []
    worker._on_reports = lambda event, peer, request_ids, now: applied.append(
        (event, list(request_ids))
    )  # type: ignore[method-assign]
    matched, posted = Matched("D", ("D-agent",)), WritePosted(1)
    ids = [f"r{q}" for q in range(REPORTS_BETWEEN // 2)]
    items = [ReportToMain(i, ev) for i in ids for ev in (matched, posted)]
    worker.take_writer_items(items, 1.0)
    assert applied == [(matched, ids), (posted, ids)]


def _push_regs_at(transport: MemoryTransport) -> list[str]:
    """The request ids of the PUSH_REGs waiting in `transport`'s inbox."""
    from kvhandoff.protocol.notifs import PushRegNotif, parse_notif

    notifs = (parse_notif(data, peer=peer) for peer, data in transport.inbox)
    return [n.registration.request_id for n in notifs if isinstance(n, PushRegNotif)]


def _counting_ensures(side: PushSide) -> list[int]:
    """How many operations each `Ensure` that reaches D's remote engines carries."""
    from kvhandoff.machines.push.remote_engine import Ensure

    carried: list[int] = []
    bus = side.ranks[0].writer.bus
    dispatch = bus.dispatch

    def counted(kind: object, key: object, event: object, now: float) -> None:
        if isinstance(event, Ensure):
            carried.append(len(event.ops))
        dispatch(kind, key, event, now)  # type: ignore[arg-type]

    bus.dispatch = counted  # type: ignore[method-assign]
    return carried


def test_R_P05_a_writer_pass_hands_each_remote_engine_its_operations_together() -> None:
    """D's PUSH_REGs of one step reach P's remote engine as one `Ensure` (one handshake,
    every registration replayed once it connects)."""
    _p, d, tp, _applied = _pair()
    carried = _counting_ensures(d)
    prefill = PrefillCoordinates("P", "127.0.0.1", 5600, 1)
    ids = [f"cmpl-g{q}-0-ffff0000" for q in range(5)]
    for q, request_id in enumerate(ids):
        leg = decode_leg({"request_id": request_id[:-9]}, prefill)
        d.update_state_after_alloc(request_id, [q], leg["kv_transfer_params"])
    d.step()
    d.writer_pass()
    assert carried == [5]
    connect_deferred(d.ranks[0])
    assert sorted(_push_regs_at(tp)) == ids


def test_R_P05_an_eviction_in_the_same_pass_still_cancels_a_gathered_registration() -> None:
    """The engine's abort reaches the writer in the same pass as the registration it ends:
    the gathered PUSH_REG is handed to its remote engine before the eviction runs, so the
    eviction cancels it and P never hears of the request."""
    _p, d, tp, _applied = _pair()
    carried = _counting_ensures(d)
    prefill = PrefillCoordinates("P", "127.0.0.1", 5600, 1)
    kept, aborted = "cmpl-k-0-ffff0000", "cmpl-a-0-ffff0000"
    for q, request_id in enumerate((kept, aborted)):
        leg = decode_leg({"request_id": request_id[:-9]}, prefill)
        d.update_state_after_alloc(request_id, [q], leg["kv_transfer_params"])
    d.step()  # both registrations wait in the writer's inbox ...
    d.abort(aborted)
    d.step()  # ... and the eviction behind them
    d.writer_pass()
    assert carried == [2]  # handed over before the eviction
    connect_deferred(d.ranks[0])
    assert _push_regs_at(tp) == [kept]


def test_R_T02_scheduler_hooks_probe_reports_every_request_once() -> None:
    """The probe behind the scheduler's per-hook figures drives a whole step per side: it
    raises unless the one rank's report ends every request it names."""
    from kvhandoff.bench.probes.scheduler_hooks import _decode, _prefill

    decode, prefill = _decode(8, 2), _prefill(8, 2)
    assert set(decode) == {"alloc", "meta", "out"} and set(prefill) == {"finish", "meta", "out"}
    assert all(value > 0 for value in [*decode.values(), *prefill.values()])


_SENDERS = (("prefill-0-agent1", 0), ("prefill-0-agent2", 1), ("stranger", None))


def _d_with_registrations(sent: set[int]) -> Halves:
    """D's scheduler and rank with five registrations handed over (`cmpl-d{q}-0`), the
    ones in `sent` sent (receiving), from a P of TP 2; the bus records every transition."""
    d = Halves("decode")
    prefill = PrefillCoordinates(P_ENGINE.engine_id, P_ENGINE.host, P_ENGINE.port, 2)
    for q in range(5):
        leg = decode_leg({"request_id": f"cmpl-d{q}-0"}, prefill)
        d.sched.update_state_after_alloc(f"cmpl-d{q}-0", [q], leg["kv_transfer_params"], 0.0)
    d.hand_over()
    d.worker.take_writer_items([ReportToMain(f"cmpl-d{q}-0", RegSent()) for q in sent], 0.0)
    return d


@settings(max_examples=150, deadline=None)
@given(
    notifs=st.lists(
        st.tuples(
            st.integers(0, 5),  # 5: a request D does not know
            st.integers(0, len(_SENDERS) - 1),
            st.sampled_from([None, 1.0, 2.0, 200.0]),  # 200: past the registration watchdog
            st.sampled_from([1, 2]),
        ),
        max_size=24,
    ),
    sent=st.sets(st.integers(0, 4)),
)
def test_R_P08_completion_notifs_apply_in_batches_as_one_at_a_time(
    notifs: list[tuple[int, int, float | None, int]], sent: set[int]
) -> None:
    """D's rank applies a pass's completion notifs as one batch per sender and time: the
    registrations go through the same transitions, and the same notifs are refused, as
    when each is dispatched alone at the time it was taken."""
    items = []
    for q, s, at, tp_size in notifs:
        agent, rank = _SENDERS[s]
        notif = parse_notif(encode_completion_notif(f"cmpl-d{q}-0", tp_size), peer=agent)
        items.append(from_p(notif, agent, rank, at))  # type: ignore[arg-type]
    now = 300.0

    batched = _d_with_registrations(sent)
    batched_trace: list[str] = []
    batched.bus.record(batched_trace.append)
    batched.worker.take_writer_items(items, now)

    alone = _d_with_registrations(sent)
    alone_trace: list[str] = []
    alone.bus.record(alone_trace.append)
    bus = alone.bus
    for item in items:
        at = now if item.at is None or item.at > now else item.at
        if at > bus.now:
            bus.advance(at)
        event = Completion(item.peer, item.engine, item.rank, item.notif.tp_size)  # type: ignore[union-attr]
        try:
            bus.dispatch(D_REGISTRATION, item.notif.request_id, event, bus.now)  # type: ignore[union-attr]
        except RemoteProtocolError as exc:
            alone.worker.reject(item.peer, exc, now)
    bus.advance(now)

    assert batched_trace == alone_trace
    for peer in (None, *(agent for agent, _rank in _SENDERS)):
        assert batched.worker.rejections.count(peer) == alone.worker.rejections.count(peer)
    assert batched.worker.rejections.reasons() == alone.worker.rejections.reasons()
    assert batched.finish() == alone.finish()
