"""Batched NIXL WRITEs of one worker rank (B-13): the NIXL side of `WriteBatches`.

`NixlPushTransport.write_blocks` checks its arguments and works out the descriptor
indices at once (errors are raised there, as before), then queues a `BatchedWrite`.
`NixlBatchIO` posts a batch as ONE `make_prepped_xfer` per (D engine, D rank, local
descriptor list) with every descriptor of every request in it and no notif, polls it
with `check_xfer_state`, releases it, and sends the requests' completion notifs with the
transport's `send_notifs` (one bundle toward a peer that speaks B-13, else one notif
each) once the machine says the bytes landed. So D receives one completion notif per
request, in the same form and from the same agent as before (D's accounting is
unchanged). The lifecycle is `push.write_batch`; the queue is `adapters/write_batches.py`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.adapters.nixl.agent import NixlAgent, PreppedBlocks, XferHandle
from kvhandoff.adapters.push_transport import XferState
from kvhandoff.adapters.write_batches import WriteBatches


@dataclass(eq=False, slots=True)
class BatchedWrite:
    """One request's WRITE inside a batch: what `NixlPushTransport.write_blocks` returns.
    `xfer_status` and `error` are written by the writer thread, `released` by the main
    thread."""

    engine_id: str
    rank: int
    local: PreppedBlocks
    local_idx: Any
    remote: PreppedBlocks
    remote_idx: Any
    notif: bytes
    xfer_status: XferState = "PROC"
    released: bool = False
    error: str | None = None
    post_failed: bool = False
    """Its batch failed to post (B-14 counts it under "post")."""
    batch_key: int = 0
    """Its `push.write_batch` instance, once posted (0: not posted)."""
    transfer: object = None
    """The NIXL transfer carrying it, once posted."""


class NixlBatchIO:
    """How a batch of `BatchedWrite`s is posted, polled, released and notified."""

    def __init__(
        self, agent: NixlAgent, send_notifs: Callable[[str, int, Sequence[bytes]], None]
    ) -> None:
        self.agent = agent
        self._send_notifs = send_notifs
        """(engine id, rank, notifs): the transport's `send_notifs` (bundles, B-13)."""
        self._handle_guard = threading.Lock()
        """Held for one `check_xfer_state` or one release of a transfer handle: the writer
        polls and frees a batch's handle while the main thread may cancel it (a timed-out
        request), and NIXL must never see a released handle polled or released twice.
        It guards that native handle only, never machine state."""

    def group(self, write: BatchedWrite) -> tuple[str, int, int]:
        """Writes that can share one transfer: same D rank, same local descriptor list."""
        return (write.engine_id, write.rank, id(write.local))

    def engine_of(self, write: BatchedWrite) -> tuple[str, int]:
        return (write.engine_id, write.rank)

    def post(self, members: list[BatchedWrite]) -> XferHandle:
        first = members[0]
        local_idx = np.concatenate([np.asarray(m.local_idx, dtype=np.int32) for m in members])
        remote_idx = np.concatenate([np.asarray(m.remote_idx, dtype=np.int32) for m in members])
        return self.agent.write(first.local, local_idx, first.remote, remote_idx, b"")

    def state(self, transfer: object) -> tuple[XferState, str]:
        assert isinstance(transfer, XferHandle)
        with self._handle_guard:
            status = self.agent.poll(transfer)
        if transfer.released and status == "PROC":  # cancelled by the main thread
            return "ERR", "batch cancelled"
        return status, transfer.error or "transfer failed"

    def release(self, transfer: object) -> None:
        assert isinstance(transfer, XferHandle)
        with self._handle_guard:
            self.agent.release(transfer)  # idempotent: a released handle is left alone

    def send_notifs(self, first: BatchedWrite, notifs: tuple[bytes, ...]) -> None:
        self._send_notifs(first.engine_id, first.rank, notifs)


WriteBatcher = WriteBatches[BatchedWrite]
"""One NIXL rank's batched WRITEs."""
