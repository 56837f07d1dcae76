"""`kvhandoff simulate ec` (issue 7): a CI-sized budget, replay, and the self-check.

The budget runs a couple of hundred seeded fault schedules of a producer and a consumer
over the in-memory encoder-cache planes and demands zero leaks (grants, pins, reserved
or quarantined blocks, copies, messages), zero hung requests and zero invariant
violations, with every fault path really taken. The self-check runs deliberately broken
variants and demands the simulator catch each within 200 seeds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from kvhandoff.sim.ec.settings import ECSimSettings
from kvhandoff.sim.ec.variants import EC_VARIANTS
from kvhandoff.sim.ec.world import SimulatedECWorld
from kvhandoff.sim.faults import SimFaults
from kvhandoff.sim.run import SimulateOptions, quiet_framework_logs, run_ec_seed, simulate


def test_R_E07_R_E08_R_E12_B01_B04_B05_simulate_ec_budget_keeps_every_invariant() -> None:
    report = simulate(["ec"], 200, first_seed=0, options=SimulateOptions(requests=12))
    details = [(f.seed, f.violations[:3]) for f in report.failures[:3]]
    assert report.ok, details
    assert report.runs == 200 and report.requests == 200 * 12
    assert report.completed > 0 and report.failed_cleanly > 0  # faults really struck
    assert report.completed + report.failed_cleanly == report.requests


def test_R_E08_R_E12_simulate_ec_takes_every_read_outcome_and_fault() -> None:
    """Coverage of the budget: reads end in every way the seed allows, and each fault
    (lost, late, duplicated, reordered messages; failed and stalled READs; slow saves;
    evictions) really strikes."""
    seen: Counter[str] = Counter()
    with quiet_framework_logs():
        for seed in range(60):
            result = SimulatedECWorld(seed, faults=SimFaults.default()).run()
            assert result.ok, (seed, result.violations[:3])
            seen.update(result.counters)
    for outcome in (
        "read.done",
        "read.retried_not_ready",  # NACK_NOT_READY retried next step (R-E08)
        "read.fallback_local.NACK_MISSING",  # evicted before it was read (B-01)
        "read.fallback_local.ack_timeout",
        "read.fallback_local.read_failed",
        "read.released.read_timeout",  # quarantined, then released (R-E12)
    ):
        assert seen[outcome] > 0, (outcome, seen)
    for fault in ("dropped", "delayed", "duplicated", "reordered", "read_fail", "read_slow"):
        assert seen[fault] > 0, (fault, seen)
    assert seen["slow_saves"] > 0 and seen["producer.evictions"] > 0


def caught_within_200_seeds(variant: str) -> None:
    options = SimulateOptions(variant=variant)
    with quiet_framework_logs():
        for seed in range(200):
            if not run_ec_seed(seed, options).ok:
                return
    raise AssertionError(f"the simulator missed the broken variant {variant!r} in 200 seeds")


@pytest.mark.parametrize("variant", sorted(EC_VARIANTS))
def test_simulate_ec_self_check_catches_a_broken_variant_within_200_seeds(variant: str) -> None:
    caught_within_200_seeds(variant)


def test_R_T02_R_T06_simulate_ec_catches_unpin_on_the_first_ranks_report() -> None:
    caught_within_200_seeds("unpin-on-first-report")


def test_S_02_simulate_ec_catches_an_ack_accepted_from_any_peer() -> None:
    caught_within_200_seeds("ack-from-any-peer")


def test_S_04_simulate_ec_catches_a_size_trusted_before_confirmation() -> None:
    caught_within_200_seeds("size-trusted")


def test_R_T02_S_01_S_03_simulate_ec_tp2_worlds_with_hostile_peers_keep_every_invariant() -> None:
    """TP=2 (every fourth seed PCP=2 too) workers whose reports arrive late, twice and out
    of order, beside a hostile producer and a hostile consumer: nothing breaks."""
    seen: Counter[str] = Counter()
    with quiet_framework_logs():
        for seed in range(40):
            world = SimulatedECWorld(seed, faults=SimFaults.default())
            assert world.plane.tp_size == 2
            result = world.run()
            assert result.ok, (seed, result.violations[:3])
            seen.update(result.counters)
    for counter in (
        "consumer.reports_stale",  # a late duplicate of a transfer that already ended
        "consumer.reports_duplicate",  # a second copy while the transfer still runs
        "hostile_forged_grants",
        "hostile_acks_refused",
        "hostile_inflated_sizes",
        "hostile_requests_refused",
        "consumer.unused_grants_released",
    ):
        assert seen[counter] > 0, (counter, seen)


def test_simulate_ec_a_seed_replays_exactly() -> None:
    def once() -> tuple[object, list[str]]:
        world = SimulatedECWorld(
            77, faults=SimFaults.default(), settings=ECSimSettings(requests=10), record=True
        )
        with quiet_framework_logs():
            result = world.run()
        return result, list(world.log)

    first, again = once(), once()
    assert first == again
    assert first[1], "a recorded run logs its transitions"


def test_R_E07_simulate_ec_faults_off_completes_everything() -> None:
    """Without faults, and with every request's media at hand (no B-05 rewrite), nothing
    fails: every request is served, remotely, from the tier, or by encoding locally an
    encoding the producer evicted meanwhile."""
    settings = ECSimSettings(rewrite_share=0.0)
    with quiet_framework_logs():
        for seed in range(20):
            result = SimulatedECWorld(seed, faults=SimFaults.none(), settings=settings).run()
            assert result.ok, result.violations[:3]
            assert result.completed == result.requests, (seed, result)


def test_simulate_ec_cli_json_line_exit_code_and_replay_command() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "simulate", "ec", "--seeds", "4", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert summary["runs"] == 4 and summary["leaked"] == summary["hung"] == 0
    assert summary["violations"] == 0 and summary["requests"] == 4 * 16
    command = ["simulate", "ec", "--seeds", "3", "--variant", "not-ready-fatal", "--jobs", "1"]
    broken = subprocess.run(
        [sys.executable, "-m", "kvhandoff", *command],
        capture_output=True,
        text=True,
        check=False,
    )
    assert broken.returncode == 1
    assert "replay: kvhandoff simulate ec --seeds 1 --first-seed 0" in broken.stdout
    assert "--variant not-ready-fatal" in broken.stdout
    assert "NACK_NOT_READY" in broken.stdout and "event log" in broken.stdout
    wrong = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "simulate", "all", "--variant", "no-quarantine"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert wrong.returncode == 2 and "unknown push variant" in wrong.stderr


def test_R_T02_a_report_for_a_transfer_that_ended_is_counted_never_raised() -> None:
    """With transfers that land on the first rank's report, the second rank's report in
    the same output names a transfer that already ended: the scheduler counts it stale,
    nothing reaches the engine as an exception (the simulator reports the violations)."""
    options = SimulateOptions(variant="unpin-on-first-report")
    stale = 0
    with quiet_framework_logs():
        for seed in range(200):
            result = run_ec_seed(seed, options)
            stale += result.counters.get("consumer.reports_stale", 0)
    assert stale > 0
