"""Events of the push-mode and pull-mode lifecycles (`push.*`, `pull.*`).

D's registration and read, P's push and pull leases share this vocabulary: the engine
API delivers some (`Drained`, `Enqueued`, `Staged`, `FinishedRecving`, `Abort`...), the
writer thread reports others back to the main thread (`ReportToMain`: the handshake, the
PUSH_REG send, the WRITE or READ post), get_finished's poll of a posted transfer the
rest. The handshake machine's own events live in `handshake.py`.

Peer events, provoked by bytes from the other engine: `Completion` (a WRITE's or READ's
completion notif), `WriteFailed` (P's `PUSH_FAIL` notif), `Heartbeat` (D's `HB:` notif)
and `Matched` (D's `PUSH_REG` met P's finished blocks). A state that does not declare one
rejects it with `RemoteProtocolError` and changes nothing; the worker counts and logs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.events import Event, PeerEvent

__all__ = [
    "Abort",
    "Completion",
    "Drained",
    "Enqueued",
    "FinishedRecving",
    "FinishedSending",
    "HandshakeDone",
    "HandshakeFailed",
    "HandshakeStarted",
    "Heartbeat",
    "LeaseExpired",
    "Matched",
    "Poll",
    "ReadDone",
    "ReadError",
    "ReadPosted",
    "ReadSubmitFailed",
    "ReadTimeout",
    "RegSent",
    "SendFailed",
    "Staged",
    "WatchdogExpired",
    "WriteDone",
    "WriteError",
    "WriteFailed",
    "WritePosted",
    "WriteSubmitFailed",
    "WriteTimeout",
]


# -- the engine API ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Drained(Event):
    """`build_connector_meta` put the registration or read in this step's meta."""


@dataclass(frozen=True, slots=True)
class Enqueued(Event):
    """`start_load_kv` handed the registration or read to the writer thread."""


@dataclass(frozen=True, slots=True)
class Staged(Event):
    """`start_load_kv` handed P's finished blocks to the writer thread."""


@dataclass(frozen=True, slots=True)
class FinishedRecving(Event):
    """The engine took the reported receive (`update_connector_output`)."""


@dataclass(frozen=True, slots=True)
class FinishedSending(Event):
    """The engine took the reported send and frees the blocks (`update_connector_output`)."""


@dataclass(frozen=True, slots=True)
class Abort(Event):
    """The engine's request-level abort path ends the registration or read."""


# -- reports of the writer thread ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HandshakeStarted(Event):
    """The operation waits for a handshake with its peer (R-P05)."""


@dataclass(frozen=True, slots=True)
class HandshakeDone(Event):
    """The handshake completed; the operation was replayed."""


@dataclass(frozen=True, slots=True)
class HandshakeFailed(Event):
    """The handshake failed or timed out; nothing retries it (R-P12)."""


@dataclass(frozen=True, slots=True)
class RegSent(Event):
    """D's `PUSH_REG` left for P."""


@dataclass(frozen=True, slots=True)
class SendFailed(Event):
    """D's `PUSH_REG` could not be sent (R-P12)."""


@dataclass(frozen=True, slots=True)
class Matched(PeerEvent):
    """P's writer matched the finished blocks with D's `PUSH_REG` (R-P04)."""


@dataclass(frozen=True, slots=True)
class WritePosted(Event):
    """P's WRITE into D's blocks left (R-P06)."""


@dataclass(frozen=True, slots=True)
class WriteSubmitFailed(Event):
    """P's WRITE failed to post; D was told (B-06)."""


@dataclass(frozen=True, slots=True)
class ReadPosted(Event):
    """Pull mode: D's READ of P's blocks left (B-09)."""


@dataclass(frozen=True, slots=True)
class ReadSubmitFailed(Event):
    """Pull mode: D's READ failed to post."""


# -- get_finished's poll of a posted transfer ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Poll(Event):
    """get_finished asks for the state of the posted transfer."""


@dataclass(frozen=True, slots=True)
class WriteDone(Event):
    """The WRITE completed."""


@dataclass(frozen=True, slots=True)
class WriteError(Event):
    """The WRITE ended in error."""


@dataclass(frozen=True, slots=True)
class ReadDone(Event):
    """The READ completed."""


@dataclass(frozen=True, slots=True)
class ReadError(Event):
    """The READ ended in error."""


# -- from the peer -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Completion(PeerEvent):
    """A completion notif `<request_id>:<tp_size>`: the peer's WRITE landed in D's blocks
    (push), or D's READ of P's blocks is done (pull) (R-P06, R-P08)."""


@dataclass(frozen=True, slots=True)
class WriteFailed(PeerEvent):
    """P's `PUSH_FAIL` notif: its WRITE into D's blocks failed to post (B-06)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat(PeerEvent):
    """D's `HB:` notif names the request: extend its lease (R-P08, R-P15)."""


# -- timeouts --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WatchdogExpired(Event):
    """D's registration or read waited `push_registration_timeout` (R-P10)."""


@dataclass(frozen=True, slots=True)
class LeaseExpired(Event):
    """P's lease ran out (R-P11)."""


@dataclass(frozen=True, slots=True)
class WriteTimeout(Event):
    """P's posted WRITE outlived `push_write_timeout`."""


@dataclass(frozen=True, slots=True)
class ReadTimeout(Event):
    """D's posted READ outlived `push_write_timeout` (pull mode)."""
