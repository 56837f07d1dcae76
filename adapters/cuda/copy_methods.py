"""The copy methods of the CUDA encoder-cache copy engine (`ec_copy.CudaCopyEngine`), the
word sizes its indexing kernels move, and the runs of consecutive blocks that DMA copies
follow (GPU-free helpers; see `ec_copy` for what each method does).
"""

from __future__ import annotations

from typing import Any, Final, Literal

import numpy as np
import torch

__all__ = ["METHODS", "CopyMethod", "runs_of", "word"]

CopyMethod = Literal["auto", "row_kernel", "kernel", "runs", "batch_memcpy", "per_block"]
METHODS: Final[tuple[CopyMethod, ...]] = (
    "auto",
    "row_kernel",
    "kernel",
    "runs",
    "batch_memcpy",
    "per_block",
)

_WORDS: Final[tuple[tuple[int, torch.dtype], ...]] = (
    (16, torch.complex128),  # plain 16-byte loads and stores; bits are never interpreted
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def word(nbytes: int, *ptrs: int, widest: int = 16) -> tuple[int, torch.dtype]:
    """The widest word that divides the row size and aligns every address."""
    for size, dtype in _WORDS:
        if size <= widest and nbytes % size == 0 and all(p % size == 0 for p in ptrs):
            return size, dtype
    return 1, torch.uint8


def runs_of(blocks: np.ndarray[Any, Any]) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """Maximal runs of consecutive block ids: (start offsets in `blocks`, run lengths)."""
    if blocks.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [blocks.size]))).astype(np.int64)
    return starts, lengths
