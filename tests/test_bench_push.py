"""`kvhandoff bench push --json` on the CPU with a tiny KV layout.

Checks the shape of the JSON line and that both measurements moved verified bytes; the
throughput numbers themselves belong to the benchmark, never to a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from kvhandoff.bench.push import QUICK, run_push_bench

pytestmark = pytest.mark.integration


def test_bench_push_json_reports_verified_framework_and_baseline() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "bench", "push", "--json", "--quick"],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    for key in ("framework_gbps", "baseline_gbps", "ratio"):
        assert isinstance(result[key], float) and result[key] > 0, (key, result)
    assert result["device"] == "cpu"
    assert result["framework_verified"] is True, result["notes"]
    assert result["baseline_verified"] is True, result["notes"]
    assert result["bytes"] == (
        result["regions"] * result["requests"] * result["blocks_per_request"] * result["block_len"]
    )
    assert len(result["framework_samples_gbps"]) == result["config"]["reps"]


def test_bench_push_cross_layer_scattered_blocks_verified() -> None:
    """One region whose blocks span every layer; blocks scattered on both sides."""
    cfg = replace(QUICK, kv_layout="cross_layer", scattered=True, reps=1, diagnose=True)
    result = run_push_bench(cfg)
    assert result["descriptors_per_request"] == result["blocks_per_request"]
    assert result["framework_verified"] is True, result["notes"]
    assert result["baseline_verified"] is True, result["notes"]
    assert result["raw_per_request_verified"] is True, result["notes"]
    assert result["raw_one_write_verified"] is True, result["notes"]
