"""Push into VRAM: KV regions as CUDA tensors registered with NIXL as VRAM, P and D as two
processes on one GPU, every byte D received checked against P's pattern on the GPU.

Skipped, with the reason printed, where CUDA is absent.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvhandoff.bench.push import QUICK, run_push_bench

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

if not torch.cuda.is_available():
    pytest.skip(
        "CUDA is not available here: the VRAM push test runs on a GPU machine",
        allow_module_level=True,
    )


def test_vram_push_bytes_verified() -> None:
    result = run_push_bench(replace(QUICK, device="cuda"), print)
    assert result["framework_verified"] is True, result["notes"]
    assert result["baseline_verified"] is True, result["notes"]
    assert result["device"] == torch.cuda.get_device_name(0)
    assert result["bytes"] > 0


def test_vram_push_cross_layer_scattered_blocks_bytes_verified() -> None:
    """One cross-layer region, blocks that are not one run on either side, UCX SGL on."""
    cfg = replace(
        QUICK, device="cuda", kv_layout="cross_layer", scattered=True, ucx_sgl=True, reps=1
    )
    result = run_push_bench(cfg, print)
    assert result["framework_verified"] is True, result["notes"]
    assert result["baseline_verified"] is True, result["notes"]
