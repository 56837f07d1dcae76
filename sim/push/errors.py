"""What the simulated push fabric raises (deterministic simulation ONLY)."""

from __future__ import annotations

from kvhandoff.protocol.errors import KvHandoffError

__all__ = ["SimTransportError"]


class SimTransportError(KvHandoffError):
    """A simulated transport failure: an injected fault, a dead or partitioned peer.

    `peer_gone` is true when the remote agent no longer exists, as NIXL reports a
    disconnected remote (`push_transport.peer_gone`, B-08).
    """

    def __init__(self, message: str, *, peer_gone: bool = False) -> None:
        self.peer_gone = peer_gone
        super().__init__(message)
