"""What kvhandoff's vLLM connectors count and time (`integrations/vllm/stats.py`, B-14, S-06),
without vLLM: the payload adds up as vLLM aggregates it, intervals are deltas of running
totals, transfers are timed from their start to every rank's report, and a real worker
rank's lease expiries and refused notifs reach its totals, by cause with few label values."""

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
from kvhandoff.machines.push.scheduler import LocalEngine
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


def test_B_14_transfers_are_timed_from_start_to_every_ranks_report() -> None:
    times = stats.RequestTimes(block_bytes=1024)
    times.begin("p-1", 3, now=10.0)
    times.begin("d-1", 2, now=11.0)
    times.begin("d-2", 1, now=11.0)
    times.begin("d-3", 1, now=11.0)
    times.end(sent=["p-1", "never-begun"], received=["d-1"], failed=["d-2"], now=12.5)
    times.end(forgotten=["d-3"], now=13.0)
    assert len(times) == 0
    assert times.take() == {
        "transfers": {"sent": 1, "received": 1, "failed": 1},
        "finish_to_receive_s": [2.5],
        "receive_wait_s": [1.5],
        "bytes_transferred": [3 * 1024, 2 * 1024],
    }
    assert times.take() == {}


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
