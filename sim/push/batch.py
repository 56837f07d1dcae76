"""Batched WRITEs in the simulator, as the real transport batches them (B-13).

`SimPushTransport.write_blocks` checks its arguments and queues the WRITE; `flush` posts
one combined transfer per D agent (and routing) for everything queued, carrying no notif.
Each request's handle polls "PROC" until the combined transfer is done; the first poll
that sees it done sends the completion notif of every request in it with `post_notif`
(so a notif can be dropped, delayed or reordered like any other), then reports "DONE".
A combined transfer that fails to post, errs or is lost fails all of its requests;
releasing a request while it is in flight cancels it; one released before the flush is
never posted. The network's observer sees each request's WRITE (posted, landed) as
before, so the simulator's contracts check every request as they did.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhandoff.adapters.push_transport import XferState
from kvhandoff.protocol.errors import KvHandoffError
from kvhandoff.sim.push.fabric import SimTransfer

if TYPE_CHECKING:
    from kvhandoff.sim.push.transport import SimPushTransport


class SimWriteBatcher:
    def __init__(self, transport: SimPushTransport) -> None:
        self.transport = transport
        self._queued: list[SimTransfer] = []
        self.batches_posted = 0
        self.writes_batched = 0

    def queue(self, write: SimTransfer) -> SimTransfer:
        self._queued.append(write)
        return write

    def flush(self) -> list[tuple[str, KvHandoffError]]:
        queued, self._queued = self._queued, []
        groups: dict[tuple[object, ...], list[SimTransfer]] = {}
        for write in queued:
            if not write.released:
                key = (write.dst_agent, write.pairs, write.local_chunk, write.remote_chunk)
                groups.setdefault(key, []).append(write)
        errors: list[tuple[str, KvHandoffError]] = []
        for members in groups.values():
            first = members[0]
            batch = SimTransfer(
                op="WRITE",
                src_engine=first.src_engine,
                src_agent=first.src_agent,
                dst_engine=first.dst_engine,
                dst_agent=first.dst_agent,
                local_ids=tuple(i for m in members for i in m.local_ids),
                remote_ids=tuple(i for m in members for i in m.remote_ids),
                pairs=first.pairs,
                notif=b"",
                local_chunk=first.local_chunk,
                remote_chunk=first.remote_chunk,
                members=tuple(members),
            )
            try:
                self.transport.network.post_transfer(batch)
            except KvHandoffError as exc:
                for member in members:
                    member.xfer_status, member.post_failed = "ERR", True
                errors.append((first.dst_engine, exc))
                continue
            for member in members:
                member.batch = batch
            self.batches_posted += 1
            self.writes_batched += len(members)
        return errors

    def poll(self, write: SimTransfer) -> XferState:
        batch = write.batch
        if write.xfer_status != "PROC" or write.released or batch is None:
            return write.xfer_status
        if batch.xfer_status == "PROC":
            return "PROC"
        for member in batch.members:
            if member.xfer_status != "PROC" or member.released:
                continue
            if batch.xfer_status == "ERR":
                member.xfer_status = "ERR"
                continue
            try:
                if member.notif:
                    network = self.transport.network
                    network.post_notif(self.transport, member.dst_agent, member.notif)
            except KvHandoffError:
                member.xfer_status = "ERR"
            else:
                member.xfer_status = "DONE"
        return write.xfer_status

    def release(self, write: SimTransfer) -> None:
        if write.released:
            return
        write.released = True
        batch = write.batch
        if batch is None:
            if write in self._queued:
                self._queued.remove(write)
            return
        if write.xfer_status == "PROC" and batch.xfer_status == "PROC":
            self.transport.network.cancel(batch)
            batch.xfer_status = "ERR"
            for member in batch.members:
                if member.xfer_status == "PROC":
                    member.xfer_status = "ERR"
