"""`bench/vllm_gpu.sh --device cpu --tiny` (issue 28's GPU tier, its CPU mode): both
connectors, kvhandoff's and vLLM's own push connector, move the same requests between two
real vLLM Schedulers with their workers in processes of their own; every D block holds
P's bytes and both engines end with every block free (C-05, R-T01)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def gpu_script(*args: str, timeout: float) -> dict[str, Any]:
    """`bench/vllm_gpu.sh ARGS` with this interpreter; its JSON line (it must exit 0)."""
    run = subprocess.run(
        ["bash", str(ROOT / "bench" / "vllm_gpu.sh"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ, PY=sys.executable),
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


def test_C_05_gpu_bench_cpu_mode_verifies_bytes_and_frees_every_block() -> None:
    result = gpu_script("--device", "cpu", "--tiny", timeout=280)
    assert result["ok"] and result["device"] == "cpu"
    for name in ("kvhandoff", "vllm", "kvhandoff_nixl"):
        side = result[name]
        assert side["verified"] and side["all_blocks_free"] and not side["errors"], side
        assert side["bytes"] == result["requests"] * 4 * 3 * 8192  # 4 blocks, 3 layers
        assert side["p99_ms"] >= side["p50_ms"] > 0
    # DRAM KV: the connector's rank never wraps NIXL in the CUDA IPC transport (B-12).
    assert result["kvhandoff"]["p_writes"] == {"transport": "nixl"}
    assert result["raw_write"]["verified"] and result["raw_write"]["between"] == "two processes"
    assert result["kvhandoff_over_vllm_gbps"] > 0


def test_R_E05_C_05_gpu_ec_script_cpu_mode_moves_and_checks_encodings() -> None:
    """`bench/vllm_gpu.sh ec --device cpu`: the encoder-cache connector's save, P2P READ
    and load through vLLM's calls, each encoding compared byte for byte (the script
    raises on any difference), on the CPU copy engine here."""
    result = gpu_script("ec", "--device", "cpu", "--encodings", "2", timeout=200)
    assert result["device"] == "cpu" and result["encodings"] == 2 and result["verified"]
    assert result["copy_engines"] == ["CpuCopyEngine"]
