"""The gather-scatter kernel of the CUDA IPC push path (Triton; issue 18).

One launch moves every block of every request a writer pass matched for one peer: grid
`(blocks, regions)`, each program copies one block of one region from P's KV into D's
IPC-mapped KV. Addresses are computed on the device: the per-region word offsets (from
one base pointer on each side) are uploaded once per peer; each launch uploads only
the int32 block ids (P's then D's) of its requests.

This module imports Triton at import time: only `ipc_transport.py` imports it, lazily,
once a peer's mapping is opened on a CUDA machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import triton
import triton.language as tl

if TYPE_CHECKING:
    import torch


@triton.jit  # type: ignore[untyped-decorator]
def _gather_scatter(  # type: ignore[no-untyped-def]
    src,  # P's base pointer (int64 words)
    dst,  # D's base pointer, IPC-mapped
    src_off,  # int64 [regions]: word offset of each region from src
    dst_off,  # int64 [regions]
    ids,  # int32 [2 * n_blocks]: P's block ids, then D's
    n_blocks,
    WORDS: tl.constexpr,  # int64 words per block
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    r = tl.program_id(1)
    s = tl.load(ids + n).to(tl.int64)
    d = tl.load(ids + n_blocks + n).to(tl.int64)
    s_base = tl.multiple_of(tl.load(src_off + r) + s * WORDS, 2)
    d_base = tl.multiple_of(tl.load(dst_off + r) + d * WORDS, 2)
    for start in tl.static_range(0, WORDS, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        if WORDS % BLOCK == 0:
            tl.store(dst + d_base + offs, tl.load(src + s_base + offs))
        else:
            mask = offs < WORDS
            tl.store(dst + d_base + offs, tl.load(src + s_base + offs, mask=mask), mask=mask)


def launch(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_off: torch.Tensor,
    dst_off: torch.Tensor,
    ids: torch.Tensor,
    words: int,
) -> None:
    """Copy `words` int64 words per (block, region): `ids` holds P's block ids then D's
    (int32, `2 * n`), `src_off` / `dst_off` each region's word offset from `src` / `dst`
    (int64). Runs on the current torch stream."""
    n = ids.numel() // 2
    regions = src_off.numel()
    if n == 0:
        return
    block = min(triton.next_power_of_2(words), 4096)
    _gather_scatter[(n, regions)](
        src, dst, src_off, dst_off, ids, n, WORDS=words, BLOCK=block, num_warps=8
    )
