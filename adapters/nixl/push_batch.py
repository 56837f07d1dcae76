"""Batched NIXL WRITEs of one worker rank (B-13).

`NixlPushTransport.write_blocks` checks its arguments and works out the descriptor
indices at once (errors are raised there, as before), but only queues the WRITE. The
writer thread calls `flush` at the end of each writer pass: the WRITEs queued since the
last flush are posted as ONE NIXL transfer per (D engine, D rank) pair, with every
descriptor of every request in it and no notif attached (a transfer carries at most one).
With `post_every` K, the K-th WRITE queued for one D rank posts those K at once, before
the pass ends, so the transfer overlaps the matching of the pass's other requests.
Each request keeps its own handle (`BatchedWrite`): `poll` on it says "PROC" until its
batch completed; the first `poll` that sees the batch DONE sends the completion notifs of
every request in it (`send_notifs`: one bundle toward a peer that speaks B-13, else one
notif each; when that fails the batch's requests are "ERR"), and only then do their
handles say "DONE". So D receives one completion notif per request, in the same form and
from the same agent as before, after the bytes landed (D's accounting is unchanged).

Failure: a batch that fails to post or completes in error fails every request in it
("ERR"), exactly as a failed single WRITE would (B-10). A request released while its
batch is in flight (its transfer timed out) cancels the whole batch, so nothing lands
after P gave up on it; the batch's other requests then fail too. A request released
before the flush is simply never posted.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.adapters.nixl.agent import NixlAgent, PreppedBlocks, XferHandle
from kvhandoff.adapters.push_transport import XferState
from kvhandoff.protocol.errors import KvHandoffError


@dataclass(eq=False, slots=True)
class BatchedWrite:
    """One request's WRITE inside a batch: what `NixlPushTransport.write_blocks` returns."""

    engine_id: str
    rank: int
    local: PreppedBlocks
    local_idx: Any
    remote: PreppedBlocks
    remote_idx: Any
    notif: bytes
    batch: _Batch | None = None
    xfer_status: XferState = "PROC"
    released: bool = False
    error: str | None = None
    post_failed: bool = False
    """Its batch failed to post (B-14 counts it under "post")."""


@dataclass(eq=False, slots=True)
class _Batch:
    handle: XferHandle
    members: list[BatchedWrite] = field(default_factory=list)


class WriteBatcher:
    """The queue of one rank's WRITEs and the batches posted from it."""

    def __init__(
        self,
        agent: NixlAgent,
        send_notifs: Callable[[str, int, Sequence[bytes]], None],
        post_every: int = 0,
    ) -> None:
        self.agent = agent
        self._send_notifs = send_notifs
        """(engine id, rank, notifs): the transport's `send_notifs` (bundles, B-13)."""
        self.post_every = post_every
        """Queued WRITEs to one D rank that are posted at once, before the pass ends, so
        their transfer overlaps the matching of the pass's other requests (0: never)."""
        self._lock = threading.RLock()  # queue/flush on the writer, poll/release on main
        self._queued: list[BatchedWrite] = []
        self._errors: list[tuple[str, KvHandoffError]] = []  # early posts', for `flush`
        self.batches_posted = 0
        """NIXL transfers posted (one per flush per D rank)."""
        self.writes_batched = 0
        """Request WRITEs those transfers carried."""

    def queue(self, write: BatchedWrite) -> BatchedWrite:
        with self._lock:
            self._queued.append(write)
            if self.post_every:
                key = _group(write)
                members = [w for w in self._queued if not w.released and _group(w) == key]
                if len(members) >= self.post_every:
                    posted = {id(w) for w in members}
                    self._queued = [w for w in self._queued if id(w) not in posted]
                    error = self._post(members)
                    if error is not None:
                        self._errors.append((write.engine_id, error))
        return write

    def flush(self) -> list[tuple[str, KvHandoffError]]:
        """Post what is queued, one transfer per (engine, rank, local list); returns the
        (engine id, error) of each batch that failed to post since the last flush (its
        requests are "ERR")."""
        with self._lock:
            queued, self._queued = self._queued, []
            groups: dict[tuple[str, int, int], list[BatchedWrite]] = {}
            for write in queued:
                if not write.released:
                    groups.setdefault(_group(write), []).append(write)
            errors, self._errors = self._errors, []
            for members in groups.values():
                error = self._post(members)
                if error is not None:
                    errors.append((members[0].engine_id, error))
            return errors

    def _post(self, members: list[BatchedWrite]) -> KvHandoffError | None:
        first = members[0]
        local_idx = np.concatenate([np.asarray(m.local_idx, dtype=np.int32) for m in members])
        remote_idx = np.concatenate([np.asarray(m.remote_idx, dtype=np.int32) for m in members])
        try:
            handle = self.agent.write(first.local, local_idx, first.remote, remote_idx, b"")
        except KvHandoffError as exc:
            for member in members:
                member.xfer_status, member.error, member.post_failed = "ERR", str(exc), True
            return exc
        batch = _Batch(handle, members)
        for member in members:
            member.batch = batch
        self.batches_posted += 1
        self.writes_batched += len(members)
        return None

    def poll(self, write: BatchedWrite) -> XferState:
        with self._lock:
            batch = write.batch
            if write.xfer_status != "PROC" or write.released or batch is None:
                return write.xfer_status
            state = self.agent.poll(batch.handle)
            if state == "PROC":
                return "PROC"
            # The whole batch at once: D hears of all of it.
            live = [m for m in batch.members if m.xfer_status == "PROC" and not m.released]
            self._finish(live, state, batch.handle.error)
            return write.xfer_status

    def _finish(self, members: list[BatchedWrite], state: XferState, error: str | None) -> None:
        if state == "ERR":
            for write in members:
                write.xfer_status, write.error = "ERR", error or "transfer failed"
            return
        # B-13: a request's completion notif leaves only after its batch landed; and
        # the batch's notifs to one D rank leave together (all members share the rank).
        notifs = [w.notif for w in members if w.notif]  # an empty notif is none
        try:
            if notifs:
                self._send_notifs(members[0].engine_id, members[0].rank, notifs)
        except KvHandoffError as exc:
            for write in members:
                write.xfer_status, write.error = "ERR", str(exc)
        else:
            for write in members:
                write.xfer_status = "DONE"

    def release(self, write: BatchedWrite) -> None:
        """Idempotent. In flight: cancels the whole batch (nothing lands after P gave up)."""
        with self._lock:
            if write.released:
                return
            write.released = True
            batch = write.batch
            if batch is None:
                if write in self._queued:
                    self._queued.remove(write)  # never posted: never lands
                return
            if write.xfer_status == "PROC" and self.agent.poll(batch.handle) == "PROC":
                for member in batch.members:
                    if member.xfer_status == "PROC":
                        member.xfer_status, member.error = "ERR", "batch cancelled"
                self.agent.release(batch.handle)
            elif all(member.released for member in batch.members):
                self.agent.release(batch.handle)


def _group(write: BatchedWrite) -> tuple[str, int, int]:
    """Writes that can share one transfer: same D rank, same local descriptor list."""
    return (write.engine_id, write.rank, id(write.local))
