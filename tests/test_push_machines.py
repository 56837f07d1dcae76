"""Push-mode machines, one by one: model-based tests with full transition coverage.

Payloads are drawn from small sets, so the guards meet both sides of every decision: a
rank that reports twice, a completion from an agent of another engine, a `PUSH_REG` of
another attempt of the same base id, a late handshake result of an earlier attempt.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st

from kvhandoff.machines.kv.effects import RankRegistration, ReplayPush, ReplayRegistration
from kvhandoff.machines.kv.events import (
    Completion,
    Drained,
    Heartbeat,
    Matched,
    RankEnded,
    RankPosted,
    RankReceived,
    RankRecvFailed,
    RankSent,
    WriteError,
    WriteFailed,
)
from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.d_request import D_REQUEST
from kvhandoff.machines.push.match import MATCH, BlocksArrived, Issued, RegArrived, Revoke
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.p_request import P_REQUEST
from kvhandoff.machines.push.remote_engine import REMOTE_ENGINE, Cancel, Ensure, Failed, Succeeded
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.push_wire import PushRegistration
from kvhandoff.testing import run_model_test


def reg(request_id: str = "cmpl-1-0-aaaaaaaa", **fields: object) -> PushRegistration:
    values: dict[str, object] = {
        "request_id": request_id,
        "decode_engine_id": "D",
        "decode_host": "127.0.0.1",
        "decode_port": 5600,
        "decode_tp_size": 1,
        "decode_tp_rank": 0,
        "block_ids": (1, 2),
        "remote_engine_id": "P",
        "remote_host": "127.0.0.1",
        "remote_port": 5500,
        "remote_tp_size": 1,
        **fields,
    }
    return PushRegistration(**values)  # type: ignore[arg-type]


RANKS = st.integers(0, 2)


def _walk(
    decl: Declaration[Any], fields: dict[str, Any], events: list[Event]
) -> set[tuple[str, str, str]]:
    """The edges one scripted sequence takes on a fresh instance. The random walks'
    coverage depends on what Hypothesis draws (which follows the constants of every
    loaded module), so the deepest guarded edges are also walked on purpose."""
    bus = EventBus()
    machine = bus.register(decl)
    bus.create(decl, decl.new_context("walk", dict(fields)), 0.0)
    for event in events:
        bus.dispatch(decl, "walk", event, 0.0)
    return set(machine.taken_edges())


def test_R_T02_R_P10_d_request_model() -> None:
    def reported_ranks_are_real(inst: Instance[object]) -> None:
        ctx = inst.ctx
        assert ctx.reported <= set(range(3))  # type: ignore[attr-defined]

    coverage = run_model_test(
        D_REQUEST,
        context=st.fixed_dictionaries({"block_ids": st.just((1, 2)), "ranks": st.integers(1, 3)}),
        payloads={
            RankReceived: st.builds(RankReceived, RANKS),
            RankRecvFailed: st.builds(RankRecvFailed, RANKS, st.sampled_from(["", "x"])),
            RankEnded: st.builds(RankEnded, RANKS),
            RankPosted: st.builds(RankPosted, RANKS),
        },
        invariants=[reported_ranks_are_real],
        max_examples=300,
        require_full_coverage=False,
    )
    failed_then_received = [Drained(), RankRecvFailed(0, "x"), RankReceived(1)]
    coverage.add(_walk(D_REQUEST, {"block_ids": (1, 2), "ranks": 2}, failed_then_received))
    coverage.assert_complete()


def test_R_T02_R_P10_a_rank_s_late_ended_answer_after_every_rank_let_go_is_ignored() -> None:
    """Found by `kvhandoff simulate pull` (seed 871): the watchdog drops a request; one
    rank fails its receive and, no longer holding it, answers the next step's `ended` with
    `RankEnded`; the other rank's `RankEnded` comes in the same outputs, every rank has let
    go (`expired`), and the first rank's answer must change nothing, not raise from the
    engine's step."""
    from kvhandoff.machines.kv.events import WatchdogExpired

    bus = EventBus()
    machine = bus.register(D_REQUEST)
    bus.create(D_REQUEST, D_REQUEST.new_context("d-1", {"block_ids": (1, 2), "ranks": 2}), 0.0)
    for event in (Drained(), WatchdogExpired(), RankRecvFailed(1, "handshake"), RankEnded(0)):
        bus.dispatch(D_REQUEST, "d-1", event, 0.0)
    assert bus.has_tag(D_REQUEST, "d-1", "given_up")
    ignored = machine.ignored_count
    bus.dispatch(D_REQUEST, "d-1", RankEnded(1), 0.0)
    assert bus.has_tag(D_REQUEST, "d-1", "given_up") and machine.ignored_count == ignored + 1


def test_R_T02_R_P03_p_request_model() -> None:
    run_model_test(
        P_REQUEST,
        context=st.fixed_dictionaries({"block_ids": st.just((1, 2)), "ranks": st.integers(1, 3)}),
        payloads={RankSent: st.builds(RankSent, RANKS)},
        max_examples=200,
    )


def test_R_P02_S_02_R_T04_d_registration_model() -> None:
    notified = {
        "sender": st.just("agent"),
        "engine": st.sampled_from(["P", "P", "P", "X", None]),
        "rank": st.sampled_from([0, 1, 0, 1, 3, None]),
    }
    run_model_test(
        D_REGISTRATION,
        context=st.fixed_dictionaries(
            {
                "registration": st.just(reg(remote_pp_size=2)),
                "writers": st.sampled_from([frozenset({0}), frozenset({0, 1})]),
            }
        ),
        payloads={
            Completion: st.builds(Completion, **notified, tp_size=st.sampled_from([1, 2])),
            WriteFailed: st.builds(WriteFailed, **notified, reason=st.just("x")),
        },
        max_examples=400,
    )


def test_R_P03_R_P11_B10_p_lease_model() -> None:
    run_model_test(
        P_LEASE,
        context=st.fixed_dictionaries({"block_ids": st.just((1, 2))}),
        payloads={
            Matched: st.builds(Matched, engine=st.just("D")),
            Heartbeat: st.builds(Heartbeat, engine=st.sampled_from(["D", "X", None])),
            WriteError: st.builds(WriteError, st.sampled_from([(), (0,)])),
        },
        max_examples=300,
    )


D_IDS = st.sampled_from(["cmpl-1-0-aaaaaaaa", "cmpl-1-0-bbbbbbbb"])
P_IDS = st.sampled_from(["cmpl-1-0-0a0a0a0a", "cmpl-1-0-0b0b0b0b"])


@st.composite
def reg_arrivals(draw: st.DrawFn) -> RegArrived:
    """D TP 2 into P TP 1: the slot needs both D ranks' registrations."""
    rank = draw(st.integers(0, 1))
    blocks = draw(st.sampled_from([(1, 2), (1, 3)]))
    registration = reg(draw(D_IDS), decode_tp_size=2, decode_tp_rank=rank, block_ids=blocks)
    return RegArrived(RankRegistration(rank, registration, f"d-agent{rank}"))


def test_R_P04_S_03_match_model() -> None:
    def holds_only_waiting_registrations(inst: Instance[object]) -> None:
        ctx = inst.ctx
        if inst.has("write_pending") or inst.has("tombstone"):
            assert not ctx.regs  # type: ignore[attr-defined]

    coverage = run_model_test(
        MATCH,
        context=st.fixed_dictionaries({"p_tp": st.just(1), "p_tp_rank": st.just(0)}),
        payloads={
            RegArrived: reg_arrivals(),
            BlocksArrived: st.builds(BlocksArrived, P_IDS, st.just((7, 8))),
            Revoke: st.builds(Revoke, P_IDS),
            Issued: st.builds(Issued, P_IDS),
        },
        invariants=[holds_only_waiting_registrations],
        max_examples=500,
        require_full_coverage=False,
    )
    d_id, p_id = "cmpl-1-0-aaaaaaaa", "cmpl-1-0-0a0a0a0a"
    regs = [
        RegArrived(
            RankRegistration(
                rank, reg(d_id, decode_tp_size=2, decode_tp_rank=rank), f"d-agent{rank}"
            )
        )
        for rank in (0, 1)
    ]
    # Both D ranks register, then P's blocks complete the match; the push is issued and a
    # late duplicate PUSH_REG of the served attempt meets the tombstone.
    walk = [*regs, BlocksArrived(p_id, (7, 8)), Issued(p_id), regs[0]]
    coverage.add(_walk(MATCH, {"p_tp": 1, "p_tp_rank": 0}, walk))
    # A revoked lease of another attempt meets the matched slot: answered, slot kept. (The
    # random search reaches this edge only sometimes, so the walk makes coverage certain.)
    walk = [*regs, BlocksArrived(p_id, (7, 8)), Revoke("cmpl-1-0-0b0b0b0b"), Issued(p_id)]
    coverage.add(_walk(MATCH, {"p_tp": 1, "p_tp_rank": 0}, walk))
    coverage.assert_complete()


OPS = st.sampled_from(
    [
        ReplayRegistration("d-1", reg()),
        ReplayPush("p-1", (3, 4), "D", (RankRegistration(0, reg(), "d-agent"),)),
    ]
)


def test_R_P05_B11_remote_engine_model() -> None:
    def deferring_only_while_handshaking(inst: Instance[object]) -> None:
        deferred = inst.ctx.deferred  # type: ignore[attr-defined]
        assert inst.has("deferring") or not deferred, "only a handshake in progress defers"

    run_model_test(
        REMOTE_ENGINE,
        context=st.fixed_dictionaries({"host": st.just("127.0.0.1"), "port": st.just(5500)}),
        payloads={
            Ensure: st.lists(OPS, min_size=1, max_size=3).map(lambda ops: Ensure(tuple(ops))),
            Succeeded: st.builds(Succeeded, st.sampled_from([1, 1, 1, 0, 2])),
            Failed: st.builds(Failed, st.sampled_from([1, 1, 0, 2])),
            Cancel: st.builds(Cancel, st.sampled_from(["d-1", "p-1"])),
        },
        invariants=[deferring_only_while_handshaking],
        max_examples=600,
    )


def test_B09_pull_machines_model() -> None:
    from kvhandoff.machines.kv.events import ReadDone
    from kvhandoff.machines.pull.d_read import D_READ
    from kvhandoff.machines.pull.p_lease import PULL_P_LEASE
    from kvhandoff.protocol.legs import PrefillCoordinates, PullSource

    source = PullSource(PrefillCoordinates("P", "127.0.0.1", 5500, 1), "p-1", (1, 2))
    run_model_test(  # a READ seen done before or after P's lease deadline (or none named)
        D_READ,
        context=st.fixed_dictionaries(
            {
                "source": st.just(source),
                "block_ids": st.just((3, 4)),
                "lease_deadline": st.sampled_from([100.0, None]),
            }
        ),
        payloads={ReadDone: st.builds(ReadDone, wall=st.sampled_from([150.0, 50.0, None]))},
        max_examples=300,
    )
    run_model_test(  # D's TP 1, 2 or 4 against P's 1 or 2: one, two or four READs await
        PULL_P_LEASE,
        context=st.fixed_dictionaries(
            {"block_ids": st.just((1, 2)), "p_tp": st.sampled_from([1, 2])}
        ),
        payloads={
            Completion: st.builds(
                Completion,
                sender=st.sampled_from(["d0", "d1", "d2"]),
                tp_size=st.sampled_from([1, 2, 4]),
            )
        },
        max_examples=300,
    )


def test_B09_R_T03_a_pull_lease_ends_after_one_completion_per_reading_d_rank() -> None:
    """vLLM 0.33's count: a P rank awaits max(1, D.tp / P.tp) completion notifs, one per
    reading agent (a second from the same agent frees nothing); a D TP that does not
    divide P's (or the other way round) is the peer's error and the lease keeps running."""
    from kvhandoff.machines.kv.effects import ReportFinishedSending
    from kvhandoff.machines.pull.p_lease import PULL_P_LEASE, PullLeaseCtx
    from kvhandoff.protocol.errors import RemoteProtocolError

    for p_tp, d_tp, awaited in ((1, 1, 1), (2, 2, 1), (2, 1, 1), (1, 2, 2), (2, 8, 4)):
        bus = EventBus()
        bus.register(PULL_P_LEASE)
        bus.create(PULL_P_LEASE, PullLeaseCtx("p-1", (1, 2), p_tp=p_tp), 0.0)
        freed = []
        for n in range(awaited):
            assert bus.get(PULL_P_LEASE, "p-1") is not None, (p_tp, d_tp, n)
            if n:  # the previous reader again: counted, frees nothing
                bus.dispatch(PULL_P_LEASE, "p-1", Completion(f"d{n - 1}", tp_size=d_tp), 0.0)
            bus.dispatch(PULL_P_LEASE, "p-1", Completion(f"d{n}", tp_size=d_tp), 0.0)
            freed += [e for _, e in bus.drain_outbox() if isinstance(e, ReportFinishedSending)]
        assert freed == [ReportFinishedSending("p-1")], (p_tp, d_tp)
        assert bus.get(PULL_P_LEASE, "p-1") is None
        assert bus.metrics.get("pull.p.duplicate_completions", 0) == awaited - 1
    bus = EventBus()
    bus.register(PULL_P_LEASE)
    bus.create(PULL_P_LEASE, PullLeaseCtx("p-2", (1,), p_tp=2), 0.0)
    with pytest.raises(RemoteProtocolError, match="do not divide"):
        bus.dispatch(PULL_P_LEASE, "p-2", Completion(tp_size=3), 0.0)
    assert bus.has_tag(PULL_P_LEASE, "p-2", "heartbeat_extends"), "the lease keeps running"


def test_B09_pull_read_timeout_releases_the_read_before_failing() -> None:
    from kvhandoff.machines.kv.effects import ReleaseTransfer, ReportFailedRecving
    from kvhandoff.machines.kv.events import Enqueued, Poll, ReadPosted
    from kvhandoff.machines.pull.d_read import D_READ, DReadCtx
    from kvhandoff.machines.runtime.bus import EventBus
    from kvhandoff.protocol.legs import PrefillCoordinates, PullSource

    bus = EventBus()
    bus.register(D_READ, {"push_write_timeout": 5.0})
    source = PullSource(PrefillCoordinates("P", "127.0.0.1", 5500, 1), "p-1", (1, 2))
    bus.create(D_READ, DReadCtx("d-1", source, (3, 4)), 0.0)
    for event in (Enqueued(), ReadPosted(), Poll()):  # the first poll starts it
        bus.dispatch(D_READ, "d-1", event, 0.0)
    bus.drain_outbox()
    assert bus.fire_due(5.0) == 1
    effects = [effect for _, effect in bus.drain_outbox()]
    assert effects[0] == ReleaseTransfer("d-1")
    assert any(isinstance(e, ReportFailedRecving) and e.block_ids == (3, 4) for e in effects)
