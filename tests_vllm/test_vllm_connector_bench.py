"""`kvhandoff bench vllm --json` (issue 17, item 4) runs, small, under vLLM's real
Scheduler and prints the ratio's JSON; no timed assertion (the numbers are the bench's)."""

from __future__ import annotations

import json
import subprocess
import sys


def test_C_05_bench_vllm_prints_the_ratio_json() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvhandoff",
            "bench",
            "vllm",
            "--json",
            "--quick",
            "--vllm-requests",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    report = json.loads(lines[-1])
    for key in ("kvhandoff_us_per_step", "vllm_us_per_step", "ratio"):
        assert isinstance(report[key], int | float) and report[key] > 0, (key, report)
    assert set(report["by_side"]) == {"decode", "prefill"}
    for which in ("kvhandoff", "vllm"):  # per hook, each side: the figures add up
        for side in ("decode", "prefill"):
            hooks = report["hooks"][which][side]
            assert "update_connector_output" in hooks and "build_connector_meta" in hooks
            total = report["by_side"][side][f"{which}_us_per_step"]
            assert abs(sum(hooks.values()) - total) <= 0.02 * len(hooks) + 0.01 * total
    assert report["requests_in_flight"] == 40
