"""`kvhandoff soak`: push and encoder-cache traffic together under injected faults (issue 8).

A short soak runs the CLI as a user would: four real processes (P and D over NIXL WRITE,
an encoder-cache producer and consumer over ZMQ + NIXL READ) with seeded faults on every
side. Nothing here waits on a clock: the soak ends when its roles have reported, and its
last stdout line is the JSON verdict.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvhandoff.adapters.ec_fault_injection import ECFaultPlan
from kvhandoff.protocol.errors import LocalProtocolError

SOAK_SECONDS = 8


def test_ec_fault_plan_parses_named_probabilities_and_rejects_the_rest() -> None:
    plan = ECFaultPlan.parse("read_fail=0.02, ack_drop=0.5,garble=0")
    assert (plan.read_fail, plan.ack_drop, plan.garble, plan.req_drop) == (0.02, 0.5, 0.0, 0.0)
    assert plan.any and not ECFaultPlan.parse("").any
    for bad in ("write_fail=0.1", "read_fail=x", "slow_save=1.5"):
        with pytest.raises(LocalProtocolError):
            ECFaultPlan.parse(bad)


@pytest.mark.integration
def test_R_E08_R_E12_B01_soak_push_and_ec_under_faults_resolves_all_and_leaks_nothing() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "soak", "--seconds", str(SOAK_SECONDS), "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=280,
    )
    lines = run.stdout.strip().splitlines()
    assert lines, run.stderr[-2000:]
    result = json.loads(lines[-1])
    print(json.dumps(result, indent=1))
    assert run.returncode == 0, run.stderr[-2000:]
    assert result["leaked"] == 0
    push, ec = result["push"], result["ec"]
    assert push["requests"] > 0 and ec["requests"] > 0, "both protocols carried traffic"
    assert result["requests"] == push["requests"] + ec["requests"]
    assert push["completed"] > 0 and ec["completed"] > 0
    assert push["leaked"] == 0 and ec["leaked"] == 0 and ec["leaks"] == {}
    # Every encoder-cache request resolved with verified bytes: pulled over NIXL READ, or
    # encoded locally after a fallback. None failed, none was left open.
    assert ec["completed"] == ec["requests"] == ec["served_p2p"] + ec["fallback_local"]
    assert ec["failed"] == 0 and ec["unresolved"] == 0
    assert ec["served_p2p"] > 0 and ec["fallback_local"] > 0, "the faults made some fall back"
    assert ec["injected"]["producer"] and ec["injected"]["consumer"], "faults on both sides"
    assert push["completed"] + push["failed"] == push["requests"], "every push request resolved"
