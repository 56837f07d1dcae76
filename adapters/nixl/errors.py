"""`NixlTransferError`: the one type every exception NIXL raises leaves `agent.NixlAgent` as."""

from __future__ import annotations

from kvhandoff.protocol.errors import KvHandoffError

__all__ = ["NixlTransferError", "describe"]


class NixlTransferError(KvHandoffError):
    """A NIXL call failed; `op` names the wrapper operation, `detail` what NIXL said."""

    def __init__(self, op: str, detail: str) -> None:
        self.op = op
        self.detail = detail
        super().__init__(f"NIXL {op} failed: {detail}")

    @property
    def peer_gone(self) -> bool:
        """True when NIXL reported the remote agent disconnected (B-08: forget it)."""
        return "RemoteDisconnect" in self.detail


def describe(exc: BaseException) -> str:
    """Render a NIXL exception as `TypeName: message`."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
