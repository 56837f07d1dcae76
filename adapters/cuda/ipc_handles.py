"""The records of the CUDA IPC push transport (issue 18): one request's WRITE
(`IpcHandle`, a `write_batches.BatchMember`), one kernel launch carrying several of them
(`IpcLaunch`, the transfer of a `push.write_batch` instance), and the transport's
counters (`IpcStats`). The writer thread writes them; the main thread reads a handle's
`xfer_status` and sets its `released` flag."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvhandoff.adapters.push_transport import XferState

if TYPE_CHECKING:
    from kvhandoff.adapters.cuda.ipc_peer import Copy, OpenedPeer
    from kvhandoff.adapters.write_batches import WriteBatches

__all__ = ["IpcHandle", "IpcLaunch", "IpcStats"]


@dataclass(eq=False, slots=True)
class IpcHandle:
    """A WRITE through CUDA IPC: queued, launched, then DONE once its notif left."""

    engine_id: str
    rank: int
    local_ids: Sequence[int]
    remote_ids: Sequence[int]
    notif: bytes
    xfer_status: XferState = "PROC"
    released: bool = False
    error: str | None = None
    post_failed: bool = False
    """Its launch failed to start (B-14 counts it under "post")."""
    batch_key: int = 0
    """Its `push.write_batch` instance, once launched (0: queued)."""
    transfer: object = None
    """The `IpcLaunch` carrying it, once launched."""


@dataclass(eq=False, slots=True)
class IpcLaunch:
    """One gather-scatter launch to one D rank (`key`): what ends it, and the peer whose
    buffers it uses until `retired`."""

    key: str
    copy: Copy
    """Ends with the launch (`query`, `synchronize`); given back to `peer` once done."""
    peer: OpenedPeer
    error: str = ""
    """Set once the launch ended in a CUDA error: its requests fail, no notif leaves."""
    retired: bool = False


@dataclass(slots=True)
class IpcStats:
    queue: WriteBatches[Any] | None = field(default=None, repr=False)
    """The transport's launch queue, which counts the launches."""
    ipc_writes: int = 0
    nixl_writes: int = 0
    opened_peers: int = 0
    refused_peers: dict[str, str] = field(default_factory=dict)
    kernel: str = ""
    """The gather-scatter kernel of the last opened peer ("cuda_core" or "triton")."""
    routes: dict[str, str] = field(default_factory=dict)
    """Each opened D rank's route (`ipc_route.Route`)."""

    @property
    def launches(self) -> int:
        """Gather-scatter kernels launched (the launch queue's posted batches)."""
        return 0 if self.queue is None else self.queue.batches_posted
