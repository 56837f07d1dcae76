"""`kvhandoff soak --hostile`: legitimate traffic while attackers flood every listener
(issue 27; S-01, S-03, S-06, S-02, B-11).

Five real processes, as a user runs the command: P and D over NIXL WRITE and the ZMQ side
channel, an encoder-cache producer and consumer over the ZMQ ROUTER and NIXL READ, and
the attackers from 127.0.0.2 (idle connections past the side channel's per-host cap,
oversized frames and many identities at the ROUTER, forged, replayed and malformed NIXL
notifs at P, READ notifs naming no grant at the producer). Nothing here waits on a clock:
the soak ends when its roles have reported, and its last stdout line is the JSON verdict.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvhandoff.soak.hostile import ATTACK_KINDS

SOAK_SECONDS = 4
RSS_GROWTH_BOUND_MB = 150.0  # generous: a few seconds of warm-up, not a leak detector


@pytest.mark.integration
def test_S_01_S_03_S_06_hostile_soak_serves_every_legitimate_request_and_counts_every_attack() -> (
    None
):
    run = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "soak", "--hostile", "--seconds", str(SOAK_SECONDS)],
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
    push, ec = result["legitimate"]["push"], result["legitimate"]["ec"]
    assert push["requests"] > 0 and ec["requests"] > 0, "both protocols carried traffic"
    assert result["failed"] == 0 and result["roles_without_summary"] == []
    assert push["failed"] == 0 and push["done"] == push["requests"]
    assert ec["failed"] == 0 and ec["done"] == ec["requests"] > 0
    assert ec["served_p2p"] > 0, "encodings were pulled over NIXL under attack"
    assert result["leaked"] == 0
    sent, counted = result["attacks_sent"], result["counted"]
    for kind in ATTACK_KINDS:
        assert sent.get(kind, 0) > 0, f"no {kind} attack was sent"
        assert counted.get(kind, 0) > 0, f"no role counted the {kind} attack"
    assert result["uncounted"] == [] and result["unsent"] == []
    assert result["attack_errors"] == {}
    assert set(result["attack_targets_gone"]) <= {"side_channel"}  # closed at its role's end
    # The floods go past the caps: more idle connections than the side channel keeps for
    # one host, and past the producer's per-host grant cap.
    assert result["rejected"]["prefill"]["side_channel_shed"].get("host_cap", 0) > 0
    assert result["rejected"]["producer"]["grants_over_cap"] > 0
    assert set(result["rss"]) == {"prefill", "decode", "producer", "consumer"}
    for role, rss in result["rss"].items():
        assert rss["growth_mb"] is not None, f"{role} reported no resident memory"
        assert rss["growth_mb"] < RSS_GROWTH_BOUND_MB, f"{role} grew {rss['growth_mb']} MiB"
