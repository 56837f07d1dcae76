"""The two error kinds of kvhandoff.

`LocalProtocolError` is a misuse by the caller in this process (an event that is not
legal in the current state, a malformed declaration, a bad configuration).
`RemoteProtocolError` is a bad peer or bad bytes: something that arrived from outside.
Untrusted input only ever raises `RemoteProtocolError`; callers count and log it and carry on.
"""

from __future__ import annotations


class KvHandoffError(Exception):
    """Base class of every error kvhandoff raises on purpose."""


class LocalProtocolError(KvHandoffError):
    """The caller in this process broke a rule of the protocol or of a declaration."""


class RemoteProtocolError(KvHandoffError):
    """A peer sent bytes or a message that the protocol does not accept."""

    def __init__(self, message: str, *, peer: str | None = None) -> None:
        self.peer = peer
        super().__init__(f"{message} (peer {peer})" if peer else message)
