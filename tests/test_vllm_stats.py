"""What kvhandoff's vLLM connectors count and time (`integrations/vllm/stats.py`, B-14, S-06),
without vLLM: the payload adds up as vLLM aggregates it, intervals are deltas of running
totals, transfers are timed by the scheduler's machines from their start to every rank's
report, and a real worker rank's lease expiries and refused notifs reach its totals, by
cause with few label values."""

from __future__ import annotations

from kvhandoff.adapters.push_side import PushSide
from kvhandoff.bench.probes.push_writer_pass import (
    D_AGENT,
    D_ENGINE,
    P_AGENT,
    P_ENGINE,
    MemoryTransport,
)
from kvhandoff.integrations.vllm import stats
from kvhandoff.machines.push.meta import PushWorkerOutput, Timing
from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.protocol.push_config import PushConfig


def test_B_14_payloads_merge_reduce_and_know_when_empty() -> None:
    a: stats.StatsData = {"timeout": 1, "transfers": {"sent": 2}, "receive_wait_s": [0.5]}
    b = {"timeout": 2, "transfers": {"sent": 1, "failed": 1}, "receive_wait_s": [1.5, 1.0]}
    merged = stats.merge(a, b)
    assert merged is a
    assert a == {
        "timeout": 3,
        "transfers": {"sent": 3, "failed": 1},
        "receive_wait_s": [0.5, 1.5, 1.0],
    }
    assert stats.reduce(a) == {
        "receive_wait_s.avg": 1.0,
        "receive_wait_s.count": 3,
        "timeout": 3,
        "transfers.failed": 1,
        "transfers.sent": 3,
    }
    assert stats.is_empty({"timeout": 0, "transfers": {"sent": 0}, "receive_wait_s": []})
    assert not stats.is_empty({"receive_wait_s": [0.0]})


def test_B_14_intervals_are_deltas_of_running_totals() -> None:
    seen: dict[str, object] = {}
    first = stats.delta({"timeout": 2, "rejected_inputs": {"bad": 1}}, seen)
    assert first == {"timeout": 2, "rejected_inputs": {"bad": 1}}
    second = stats.delta({"timeout": 2, "rejected_inputs": {"bad": 3, "late": 1}}, seen)
    assert second == {"timeout": 0, "rejected_inputs": {"bad": 2, "late": 1}}
    assert stats.is_empty(stats.delta({"timeout": 2, "rejected_inputs": {"bad": 3}}, seen))


def test_B_14_transfers_are_timed_by_the_schedulers_machines() -> None:
    """The one copy of request state times it (issue 26): each `PushScheduler` request
    machine keeps the `now` it was created at, the step every rank reported it done says
    how long it took (`PushConnectorOutput.timings`), and `stats.transfers` turns a step's
    output into observations: outcomes, bytes, seconds. A failed or released receive is
    counted, not timed; one the engine ended for its failed load (vLLM's order: it reads
    the load errors first) is failed."""
    p = PushScheduler("prefill", LocalEngine(P_ENGINE, "127.0.0.1", 5600), now=0.0)
    _delay, leg = p.request_finished("p-1", [4, 5, 6], {"do_remote_decode": True}, 10.0)
    assert leg is not None
    p.build_connector_meta(10.5)
    sent = p.update_connector_output(
        [PushWorkerOutput(rank=0, step=1, finished_sending=("p-1",))], 12.5
    )
    assert sent.timings == {"p-1": Timing(2.5, 3)}
    assert stats.transfers(sent, block_bytes=1024) == {
        "transfers": {"sent": 1},
        "finish_to_receive_s": [2.5],
        "bytes_transferred": [3 * 1024],
    }

    d = PushScheduler("decode", LocalEngine(D_ENGINE, "127.0.0.1", 5700), now=0.0)
    d_leg = {**leg, "do_remote_prefill": True, "do_remote_decode": False}
    for request_id, blocks in (("d-1", [1, 2]), ("d-2", [3]), ("d-3", [7]), ("d-4", [8])):
        d.update_state_after_alloc(request_id, blocks, d_leg, 11.0)
    d.build_connector_meta(11.0)
    d.abort("d-3", 12.0)
    d.abort("d-4", 12.0)
    d.build_connector_meta(12.0)  # tells the rank to drop both
    output = PushWorkerOutput(
        rank=0,
        step=2,
        finished_recving=("d-1",),
        failed_recving={"d-2": "transfer_error", "d-4": "transfer_error"},
        ended=("d-3",),
    )
    got = d.update_connector_output([output], 12.5)
    assert got.finished_recving == {"d-1"} and set(got.released) == {"d-3", "d-4"}
    assert got.failed_released == {"d-4"}
    assert got.timings == {"d-1": Timing(1.5, 2)}
    assert stats.transfers(got, block_bytes=1024) == {
        "transfers": {"received": 1, "failed": 2, "released": 1},
        "receive_wait_s": [1.5],
        "bytes_transferred": [2 * 1024],
    }
    assert stats.transfers(d.update_connector_output([], 13.0), block_bytes=1024) == {}


def test_S_06_rejection_causes_drop_ids_names_and_numbers() -> None:
    reasons = {
        "heartbeat for unknown requests ['cmpl-a-0'] (peer rogue-1)": 1,
        "heartbeat for unknown requests ['cmpl-b-0', 'cmpl-c-0'] (peer rogue-2)": 2,
        "PUSH_REG names 70000 blocks, more than 65536": 1,
    }
    by_cause: dict[str, int] = {}
    stats.add_reasons(by_cause, reasons)
    assert by_cause == {
        "heartbeat for unknown requests": 3,
        "PUSH_REG names blocks, more than": 1,
    }
    assert stats.cause("'only-an-id'") == "other"


def test_B_14_S_06_a_real_ranks_lease_expiry_and_refused_notifs_reach_its_totals() -> None:
    """P's rank (its writer run by hand over an in-memory transport, a virtual clock): a
    finished prefill no D ever registers for expires its lease, and two notifs from an
    agent nobody knows are refused; `rank_totals` counts both, by cause."""
    clock = VirtualClock()
    transport = MemoryTransport(P_ENGINE, P_AGENT, D_ENGINE, D_AGENT, 64)
    side = PushSide(
        "prefill",
        LocalEngine(P_ENGINE, "127.0.0.1", 5600),
        transport,
        lambda job: None,
        config=PushConfig(kv_lease_duration=5.0),
        clock=clock,
    )
    delay, _params = side.request_finished("cmpl-x-0-abcd1234", [1, 2], {"do_remote_decode": True})
    assert delay
    side.step()
    side.writer_pass()
    transport.inbox.append(("rogue-agent", b"HB:cmpl-y-0"))
    transport.inbox.append(("rogue-agent", b"HB:cmpl-z-0"))
    side.writer_pass()
    side.step()
    rank = side.ranks[0]
    assert stats.rank_totals(rank) == {
        "lease_expiries": 0,
        "rejected_inputs": {"heartbeat for unknown requests": 2},
    }
    sent: set[str] = set()
    for _ in range(3):
        clock.advance(10.0)
        side.writer_pass()
        sent |= side.step().finished_sending
    assert sent == {"cmpl-x-0-abcd1234"}  # a lease that expired ends as sent, for vLLM
    assert stats.rank_totals(rank)["lease_expiries"] == 1
    assert stats.rank_fingerprint(rank) == (1, 2, 0), "lease expiries, main's and writer's refusals"


def test_B_14_a_fingerprint_moves_whenever_a_total_does() -> None:
    """vLLM asks for stats every step; the connector skips reading the totals while their
    fingerprint stands still, so every total must move it: failures, stale reports,
    watchdog expiries, the side channel's refusals (counted before `total` moves, so a
    reader on another thread that sees the new total sees its cause too)."""
    import logging

    from kvhandoff.machines.runtime.rejections import RejectionLog

    class SideChannel:
        rejections = RejectionLog(logging.getLogger("test"))

    side_channel = SideChannel()
    sched = PushScheduler("decode", LocalEngine(D_ENGINE, "127.0.0.1", 5700))
    seen = [stats.scheduler_fingerprint(sched, side_channel)]  # type: ignore[arg-type]

    def moved() -> None:
        now = stats.scheduler_fingerprint(sched, side_channel)  # type: ignore[arg-type]
        assert now != seen[-1]
        seen.append(now)

    sched.failures["timeout"] += 1
    moved()
    sched.stale_reports += 1
    moved()
    sched.bus.metrics["push.d.watchdog_expired"] = 1.0
    moved()
    side_channel.rejections.reject("peer", "bad request: x", 0.0)
    moved()
    totals = stats.scheduler_totals(sched, side_channel)  # type: ignore[arg-type]
    assert totals["rejected_inputs"] == {"bad request": 1}
    assert stats.scheduler_fingerprint(sched, side_channel) == seen[-1]  # type: ignore[arg-type]
