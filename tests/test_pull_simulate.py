"""`kvhandoff simulate pull` (B-09): pull mode on the push simulator's world, every TP
topology without PP, under the same faults, with its own planted variants.

The budget demands zero leaks, zero hung requests and zero invariant violations; among
the invariants, every READ goes from the attempt's P blocks (the tail D lacks) into
exactly the blocks D lacks, and no receive D reports holds bytes other than P's. The
self-check runs each broken pull variant and demands the simulator catch it within 200
seeds: D taking a READ done after P's lease may have ended (under partitions and clock
jumps P reaps and reuses the blocks, and such a READ read them), and a P rank freeing its
lease on the first of several reading D ranks' completions.
"""

from __future__ import annotations

import pytest

from kvhandoff.sim.push.variants import PULL_VARIANTS
from kvhandoff.sim.push.world import SimulatedPullWorld
from kvhandoff.sim.run import SimulateOptions, run_pull_seed, simulate


def test_B09_R_T03_R_T05_simulate_pull_budget_keeps_every_invariant() -> None:
    report = simulate(["pull"], 150, first_seed=0, options=SimulateOptions(requests=12))
    details = [(f.seed, f.violations[:3]) for f in report.failures[:3]]
    assert report.ok, details
    assert report.runs == 150 and report.requests >= 150 * 12
    assert report.completed > 0 and report.failed_cleanly > 0  # faults really struck
    assert report.completed + report.failed_cleanly == report.requests


def test_B09_pull_worlds_draw_every_topology_without_pp() -> None:
    drawn = {SimulatedPullWorld(seed).topology for seed in range(60)}
    assert {(t.p_tp, t.p_pp, t.d_tp) for t in drawn} == {(1, 1, 1), (2, 1, 1), (1, 1, 2), (2, 1, 2)}


@pytest.mark.parametrize("variant", sorted(PULL_VARIANTS))
def test_B09_simulate_pull_self_check_catches_a_broken_variant_within_200_seeds(
    variant: str,
) -> None:
    options = SimulateOptions(variant=variant)
    for seed in range(200):
        if not run_pull_seed(seed, options).ok:
            return
    raise AssertionError(f"the simulator missed the broken pull variant {variant!r} in 200 seeds")


def test_B09_a_pull_seed_replays_exactly() -> None:
    options = SimulateOptions(requests=10)
    assert run_pull_seed(7, options) == run_pull_seed(7, options)
