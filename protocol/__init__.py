"""Wire vocabulary of kvhandoff: pure data and functions, no I/O, no threads, no clock."""

from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError, RemoteProtocolError

__all__ = ["KvHandoffError", "LocalProtocolError", "RemoteProtocolError"]
