"""The records of the CUDA IPC push transport (issue 18): one request's WRITE
(`IpcHandle`), one kernel launch carrying several of them (`IpcBatch`), and the
transport's counters (`IpcStats`). `ipc_transport.py` owns and mutates them."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvhandoff.adapters.push_transport import XferState
from kvhandoff.protocol.errors import KvHandoffError

if TYPE_CHECKING:
    from kvhandoff.adapters.cuda.ipc_peer import Copy

log = logging.getLogger("kvhandoff.adapters.cuda.ipc_transport")

__all__ = ["IpcBatch", "IpcHandle", "IpcStats"]


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
    batch: IpcBatch | None = None
    """The launch that carries it (None while queued)."""


@dataclass(eq=False, slots=True)
class IpcBatch:
    """One launch to one D rank (`key`) and the WRITEs it carries."""

    key: str
    event: Copy
    """Ends with the launch (`query`, `synchronize`); given back to its peer once done."""
    handles: list[IpcHandle]
    failed: bool = False
    """The launch ended in a CUDA error: its requests fail, no notif leaves."""

    def ended(self) -> bool:
        """Whether the launch ended (an error ends it too, as a failure)."""
        try:
            return self.event.query()
        except (RuntimeError, KvHandoffError) as exc:
            self._failed(exc)
            return True

    def wait(self) -> None:
        """Until the launch ended (an error ends it too, as a failure)."""
        try:
            self.event.synchronize()
        except (RuntimeError, KvHandoffError) as exc:
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        log.warning("IPC gather-scatter copy to %s failed: %s", self.key, exc)
        self.failed = True


@dataclass(slots=True)
class IpcStats:
    ipc_writes: int = 0
    nixl_writes: int = 0
    launches: int = 0
    opened_peers: int = 0
    refused_peers: dict[str, str] = field(default_factory=dict)
    kernel: str = ""
    routes: dict[str, str] = field(default_factory=dict)
    """Each opened D rank's route (`ipc_route.Route`)."""
    """The gather-scatter kernel of the last opened peer ("cuda_core" or "triton")."""
