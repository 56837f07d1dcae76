"""CUDA IPC launches as batched WRITEs (issue 18, issue 26 item 1): the CUDA side of
`WriteBatches`, as `nixl/push_batch.py` is the NIXL side.

A batch is the WRITEs queued for one D rank since the last flush (or `launch_every` of
them): `post` launches ONE gather-scatter kernel for all their blocks on the peer's copy
stream and returns an `IpcLaunch`; `state` asks its CUDA event; the machine
(`push.write_batch`) sends the requests' completion notifs through NIXL once it ended,
as one bundle toward a D rank that speaks B-13, then publishes each request's outcome
on its handle. `release` gives the event back to its peer once the launch ended,
waiting for it when the machine ends a launch still running (a failed peer, B-08). A
launch cannot be cancelled: the queue runs with `cancels_in_flight` off, so a request
released under a running kernel only keeps its notif back.

Every call here runs on the writer thread, which owns the bus, the queue and the opened
peers: no lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvhandoff.adapters.cuda.ipc_handles import IpcHandle, IpcLaunch
from kvhandoff.adapters.push_transport import XferState
from kvhandoff.adapters.write_batches import WriteBatches
from kvhandoff.protocol.errors import KvHandoffError

if TYPE_CHECKING:
    from kvhandoff.adapters.cuda.ipc_peer import OpenedPeer

log = logging.getLogger("kvhandoff.adapters.cuda.ipc_transport")

__all__ = ["IpcLaunchIO", "IpcLaunches", "launch_group"]


def launch_group(engine_id: str, rank: int) -> str:
    """The key of a D rank: its WRITEs share a launch, its peer instance is keyed so."""
    return f"{engine_id}/{rank}"


class IpcLaunchIO:
    """How a batch of `IpcHandle`s is launched, polled, given back and notified."""

    def __init__(
        self,
        peer_of: Callable[[str], OpenedPeer | None],
        send_notifs: Callable[[str, int, Sequence[bytes]], None],
    ) -> None:
        self._peer_of = peer_of
        """The opened mapping of a D rank's key (None: closed meanwhile)."""
        self._send_notifs = send_notifs

    def group(self, write: IpcHandle) -> str:
        return launch_group(write.engine_id, write.rank)

    def engine_of(self, write: IpcHandle) -> tuple[str, int]:
        return (write.engine_id, write.rank)

    def post(self, members: list[IpcHandle]) -> IpcLaunch:
        key = self.group(members[0])
        peer = self._peer_of(key)
        if peer is None:
            raise KvHandoffError(f"CUDA IPC mapping of {key} closed before its launch")
        local = [b for h in members for b in h.local_ids]
        remote = [b for h in members for b in h.remote_ids]
        try:
            # On the peer's copy stream, after P's KV writes on the engine's stream.
            copy = peer.launch(local, remote)
        except (RuntimeError, KvHandoffError) as exc:
            raise KvHandoffError(f"IPC gather-scatter launch failed: {exc}") from exc
        return IpcLaunch(key, copy, peer)

    def state(self, transfer: object) -> tuple[XferState, str]:
        launch = _launch(transfer)
        if launch.error:
            return "ERR", launch.error
        try:
            ended = launch.copy.query()
        except (RuntimeError, KvHandoffError) as exc:
            self._failed(launch, exc)
            return "ERR", launch.error
        return ("DONE" if ended else "PROC"), ""

    def release(self, transfer: object) -> None:
        """Give the launch's event back to its peer, after it ended (waiting for it)."""
        launch = _launch(transfer)
        if launch.retired:
            return
        launch.retired = True
        self.wait(launch)  # at once when it ended; never reuse a running one
        launch.peer.retire(launch.copy)

    def wait(self, transfer: object) -> None:
        """Until the launch ended (the wait releases the GIL); an error ends it too."""
        launch = _launch(transfer)
        try:
            launch.copy.synchronize()
        except (RuntimeError, KvHandoffError) as exc:
            self._failed(launch, exc)

    def send_notifs(self, first: IpcHandle, notifs: tuple[bytes, ...]) -> None:
        self._send_notifs(first.engine_id, first.rank, notifs)

    @staticmethod
    def _failed(launch: IpcLaunch, exc: BaseException) -> None:
        if not launch.error:
            log.warning("IPC gather-scatter copy to %s failed: %s", launch.key, exc)
            launch.error = f"IPC gather-scatter copy failed: {exc}"


def _launch(transfer: object) -> IpcLaunch:
    assert isinstance(transfer, IpcLaunch), "an IPC batch's transfer is its launch"
    return transfer


IpcLaunches = WriteBatches[IpcHandle]
"""One P rank's queued and running CUDA IPC launches."""
