"""The configuration of `kvhandoff bench ec` (see `bench/ec.py`): sizes, reps, the CUDA
copy method and the extra copy paths to sweep, and the vocabulary the bench modules share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

__all__ = ["Device", "ECBenchConfig", "Layout", "Progress", "config_for"]

Device = Literal["cpu", "cuda"]
Layout = Literal["scattered", "contiguous"]
Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ECBenchConfig:
    device: Device = "cpu"
    blocks: int = 8192
    block_size_bytes: int = 8192
    tokens_per_item: int = 512
    reps: int = 15
    warmup: int = 3
    per_block_reps: int = 3
    method: str = "auto"
    """CUDA copy method of the framework measurement (`ec_copy_cuda.METHODS`)."""
    sweep: tuple[str, ...] = ()
    """More copy paths to measure on both layouts, each against its own baseline: CUDA
    methods on `cuda`; `batched` (`BatchedCpuCopy`) or `per_block` on `cpu`."""
    seed: int = 1


def config_for(device: Device, quick: bool = False, blocks: int | None = None) -> ECBenchConfig:
    sweep = ("row_kernel", "kernel", "runs") if device == "cuda" else ("batched",)
    config = ECBenchConfig(device=device, sweep=sweep)
    if quick:
        config = replace(config, blocks=1024, reps=3, warmup=1, per_block_reps=1)
    if blocks is not None:
        config = replace(config, blocks=blocks, tokens_per_item=min(config.tokens_per_item, blocks))
    return config
