"""Batched WRITEs in the simulator: the simulated fabric's side of `WriteBatches` (B-13).

The queue, the posts and the `push.write_batch` instances are the real transport's
(`adapters/write_batches.py`); this says only how the fabric carries a batch. `post`
sends one combined transfer per D agent (and routing) carrying no notif; `state` reads
what the network did to it (delivered, failed, lost); `release` cancels it on the wire;
`send_notifs` posts each request's completion notif with `post_notif`, so a notif can be
dropped, delayed or reordered like any other. The network's observer sees each
request's WRITE (posted, landed) as before, so the simulator's contracts check every
request as they did.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING

from kvhandoff.adapters.push_transport import XferState
from kvhandoff.adapters.write_batches import WriteBatches
from kvhandoff.sim.push.fabric import SimTransfer

if TYPE_CHECKING:
    from kvhandoff.sim.push.transport import SimPushTransport


class SimBatchIO:
    def __init__(self, transport: SimPushTransport) -> None:
        self.transport = transport

    def group(self, write: SimTransfer) -> Hashable:
        return (write.dst_agent, write.pairs, write.local_chunk, write.remote_chunk)

    def engine_of(self, write: SimTransfer) -> tuple[str, int]:
        info = self.transport.engine(write.dst_engine)
        rank = 0 if info is None else info.rank_of(write.dst_agent) or 0
        return (write.dst_engine, rank)

    def post(self, members: list[SimTransfer]) -> SimTransfer:
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
        self.transport.network.post_transfer(batch)
        return batch

    def state(self, transfer: object) -> tuple[XferState, str]:
        assert isinstance(transfer, SimTransfer)
        return transfer.xfer_status, "transfer failed"

    def release(self, transfer: object) -> None:
        assert isinstance(transfer, SimTransfer)
        if transfer.released:
            return
        transfer.released = True
        if transfer.xfer_status == "PROC":
            self.transport.network.cancel(transfer)
            transfer.xfer_status = "ERR"

    def send_notifs(self, first: SimTransfer, notifs: tuple[bytes, ...]) -> None:
        network = self.transport.network
        for notif in notifs:
            network.post_notif(self.transport, first.dst_agent, notif)


SimWriteBatcher = WriteBatches[SimTransfer]


def sim_write_batcher(transport: SimPushTransport) -> SimWriteBatcher:
    return WriteBatches(SimBatchIO(transport))
