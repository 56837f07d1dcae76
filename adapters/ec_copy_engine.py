"""The encoder-cache copy engine interface (R-E05): batched block copies between the
encoder cache and the shared region, completion reported as events.

The region is a flat uint8 tensor over the `/dev/shm` mapping, cut into blocks of
`block_size_bytes`; one block holds one token row (`hidden_dim` elements of the
encoder's dtype). An item's `blocks[t]` holds token `t` of encoding `mm_hash`.

- `submit(batch_id, "save", items, encoder_cache)` copies each item's rows from
  `encoder_cache[mm_hash]` (a [num_tokens, hidden_dim] tensor) into its blocks;
- `submit(batch_id, "load", items, encoder_cache)` copies the blocks back into
  `encoder_cache[mm_hash]` (the engine allocated it, [num_tokens, hidden_dim]);
- `poll()` never blocks: it returns `(batch_id, ok)` for every batch whose end event has
  fired since the last call; the worker turns each into `ECWorker.on_copy_done`.

Two implementations: `ec_copy_cpu.CpuCopyEngine` (torch CPU tensors; the demo and CI)
and `cuda.ec_copy.CudaCopyEngine` (pooled CUDA streams, a host-registered region).
A batch is never one copy call per block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch

from kvhandoff.machines.ec.meta import CopyDirection, CopyItem

__all__ = ["CopyDirection", "CopyEngine"]


class CopyEngine(Protocol):
    def submit(
        self,
        batch_id: int,
        direction: CopyDirection,
        items: Sequence[CopyItem],
        encoder_cache: Mapping[str, torch.Tensor],
    ) -> None: ...

    def poll(self) -> list[tuple[int, bool]]: ...

    def close(self) -> None: ...
