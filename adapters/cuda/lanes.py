"""The stream pool of the CUDA encoder-cache copy engine: one lane per CUDA stream, with
the pinned id buffer and the wait event its batches reuse, and the record of one batch in
flight (its end event, what it keeps alive, whether it was reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from kvhandoff.adapters.cuda.region_mapping import RegionMapping

__all__ = ["Batch", "IdBuffer", "Lane"]

_cuda: Any = torch.cuda  # its Stream, Event and cudart() carry no type annotations


@dataclass(slots=True)
class Batch:
    batch_id: int
    event: Any  # a torch.cuda.Event once recorded
    ok: bool
    keep: list[object] = field(default_factory=list)  # alive until the end event fires
    finished: bool = False  # reported by poll()

    def landed(self) -> bool:
        """Whether the end event fired (a failed query fails the batch)."""
        if self.event is None:
            return True
        try:
            return bool(self.event.query())
        except RuntimeError:
            self.ok = False
            return True


@dataclass(slots=True)
class IdBuffer:
    """A pinned int64 buffer of `2 * capacity`: a batch's block ids in `[0, capacity)` and
    its rows' device addresses in `[capacity, 2 * capacity)` (row-kernel items)."""

    host: torch.Tensor
    array: np.ndarray[Any, Any]
    ptr: int
    capacity: int
    mapped_ptr: int  # the buffer's device address, 0 where it has no device mapping
    mapped: torch.Tensor | None  # the ids part as a CUDA int64 tensor over that mapping


class Lane:
    """One stream of the pool with the buffers its batches reuse.

    `ids` (pinned) receives a batch's block ids (and row addresses). Kernels read them in
    place through the buffer's device mapping, or, where there is none, from `dev_ids`
    after one `cudaMemcpyAsync` per group. `dev_ids` is only used on this stream, so
    stream order makes its reuse safe; `ids` may be rewritten once the last batch that used
    it (`last`) has finished (its end event fired), else a batch takes a buffer of its own.
    """

    __slots__ = ("dev_ids", "dev_ptr", "handle", "ids", "last", "stream", "wait_event", "waits")

    def __init__(self, engine: RegionMapping, capacity: int) -> None:
        self.stream: Any = _cuda.Stream(engine.device)
        self.handle = int(self.stream.cuda_stream)
        self.waits: Any = _cuda.Event()  # the caller's stream, which this one waits for
        self.wait_event = engine._runtime.new_event()  # the same, raw (0 if none)
        self.last: Batch | None = None
        self.ids = engine._new_ids(capacity)
        self.dev_ids = torch.empty(0, dtype=torch.int64, device=engine.device)
        self.dev_ptr = 0

    def device_ids(self, capacity: int) -> None:
        if self.dev_ids.numel() < capacity:
            with torch.cuda.stream(self.stream):  # allocated on (and reused by) this stream
                self.dev_ids = torch.empty(capacity, dtype=torch.int64, device=self.stream.device)
            self.dev_ptr = self.dev_ids.data_ptr()

    def host_free(self) -> bool:
        last = self.last
        if last is None or last.finished:
            return True
        return last.event is not None and last.landed()
