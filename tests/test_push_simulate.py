"""`kvhandoff simulate push` (issue 7): a CI-sized budget, replay, and the self-check.

The budget runs a couple of hundred seeded fault schedules and demands zero leaks, zero
hung requests and zero invariant violations. The self-check runs deliberately broken
variants and demands the simulator catch each within 200 seeds, so the simulator cannot
silently stop finding bugs.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvhandoff.sim.push.variants import VARIANTS
from kvhandoff.sim.run import SimulateOptions, replay_command, run_push_seed, simulate


def test_R_P12_R_T03_R_T04_R_T05_B10_S_02_simulate_push_budget_keeps_every_invariant() -> None:
    report = simulate(["push"], 200, first_seed=0, options=SimulateOptions(requests=12))
    details = [(f.seed, f.violations[:3]) for f in report.failures[:3]]
    assert report.ok, details
    assert report.runs == 200 and report.requests >= 200 * 12  # and the proxy's retries
    assert report.completed > 0 and report.failed_cleanly > 0  # faults really struck
    assert report.completed + report.failed_cleanly == report.requests


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_S_02_R_T04_simulate_self_check_catches_a_broken_variant_within_200_seeds(
    variant: str,
) -> None:
    """Among them `completion-from-any-agent` (S-02), `first-stage-completes` (R-T04) and
    `tombstone-swallows-retry` (a retry under the same base id is a new attempt)."""
    options = SimulateOptions(variant=variant)
    for seed in range(200):
        result = run_push_seed(seed, options)
        if not result.ok:
            return
    raise AssertionError(f"the simulator missed the broken variant {variant!r} in 200 seeds")


def test_simulate_a_seed_replays_exactly() -> None:
    options = SimulateOptions(requests=10)
    first, again = run_push_seed(41, options), run_push_seed(41, options)
    assert first == again


def test_simulate_cli_json_line_exit_code_and_replay_command() -> None:
    ok = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "simulate", "push", "--seeds", "4", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    summary = json.loads(ok.stdout.strip().splitlines()[-1])
    assert set(summary) == {
        "runs",
        "requests",
        "completed",
        "failed_cleanly",
        "leaked",
        "hung",
        "violations",
    }
    assert summary["runs"] == 4 and summary["leaked"] == summary["hung"] == 0
    assert "requests/s" in ok.stderr
    broken = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvhandoff",
            "simulate",
            "push",
            "--seeds",
            "3",
            "--variant",
            "write-wrong-blocks",
            "--jobs",
            "1",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert broken.returncode == 1
    assert "replay: kvhandoff simulate push --seeds 1 --first-seed 0" in broken.stdout
    assert "event log" in broken.stdout and "simulate FAILED" in broken.stdout
    result = run_push_seed(0, SimulateOptions(variant="write-wrong-blocks"))
    assert replay_command(result, SimulateOptions(variant="write-wrong-blocks")).endswith(
        "--variant write-wrong-blocks"
    )
