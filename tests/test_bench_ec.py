"""`kvhandoff bench ec` on the CPU with a tiny batch: the JSON's shape and verified bytes.

No timing is asserted: the numbers are only checked to be positive and consistent.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from kvhandoff.bench.ec import BatchedCpuCopy, config_for, run_ec_bench
from kvhandoff.machines.ec.meta import CopyItem

PAIR_KEYS = {"framework_gbps", "baseline_gbps", "ratio"}


def _check_pair(part: dict[str, object]) -> None:
    assert set(part) >= PAIR_KEYS
    fw, base, ratio = part["framework_gbps"], part["baseline_gbps"], part["ratio"]
    assert isinstance(fw, float) and isinstance(base, float) and isinstance(ratio, float)
    assert fw > 0 and base > 0 and ratio > 0


def test_bench_ec_json_on_cpu_has_save_and_load_with_bytes_verified(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "bench", "ec", "--json", "--quick", "--blocks", "48"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for direction in ("save", "load"):
        part = result[direction]
        assert set(part) == PAIR_KEYS | {"device"}
        assert part["device"] == "cpu"
        _check_pair(part)
        _check_pair(result["contiguous"][direction])
        per_block = result["per_block"][direction]
        assert {"gbps", "baseline_gbps", "ratio", "framework_speedup"} <= set(per_block)
    assert result["verified"] is True
    assert result["bytes"] == 48 * 8192
    for method in result.get("methods", {}).values():
        for layout in ("scattered", "contiguous"):
            assert method[layout]["verified"] == {"save": True, "load": True}


def test_bench_ec_several_encodings_and_every_cpu_path_verify_bytes() -> None:
    config = replace(
        config_for("cpu", quick=True, blocks=40),
        tokens_per_item=7,  # 6 encodings, the last one shorter
        block_size_bytes=1000,  # 8-byte words
        sweep=("batched", "per_block"),
    )
    result = run_ec_bench(config)
    assert result["verified"] is True
    assert result["encodings"] == 6
    assert set(result["methods"]) == {"batched", "per_block"}
    for method in result["methods"].values():
        for layout in ("scattered", "contiguous"):
            assert method[layout]["verified"] == {"save": True, "load": True}
            _check_pair(method[layout]["save"])
            _check_pair(method[layout]["load"])


def test_batched_cpu_copy_reports_bad_batches_failed() -> None:
    region = torch.zeros(8 * 64, dtype=torch.uint8)
    engine = BatchedCpuCopy(region, 64)
    cache = {"a": torch.arange(2 * 64, dtype=torch.uint8).view(2, 64)}
    engine.submit(1, "save", [CopyItem("missing", (0, 1), 2)], cache)
    engine.submit(2, "save", [CopyItem("a", (0, 8), 2)], cache)  # block 8 is outside
    engine.submit(3, "save", [CopyItem("a", (5, 2), 2)], cache)
    assert engine.poll() == [(1, False), (2, False), (3, True)]
    assert engine.poll() == []
    rows = region.view(8, 64)
    assert torch.equal(rows[5], cache["a"][0]) and torch.equal(rows[2], cache["a"][1])


def test_R_E02_cuda_copy_engine_and_bench_import_no_p2p_stack(tmp_path: Path) -> None:
    # The copy engines are part of the local tier: torch and numpy only.
    code = (
        "import sys, json\n"
        "import kvhandoff.adapters.cuda.ec_copy, kvhandoff.bench.ec\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "    if m.split('.')[0].split('_')[0] in ('nixl', 'zmq', 'msgspec'))))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []
