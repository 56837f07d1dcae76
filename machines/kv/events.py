"""Events of the push-mode and pull-mode lifecycles (`push.*`, `pull.*`): the base both
modes share, so that neither imports the other.

Three buses per engine share this vocabulary (R-T01):

- the scheduler's (`push.d_request`, `push.p_request`): the engine API (`Drained`,
  `Abort`), the watchdog, and the ranks' reports aggregated from their outputs
  (`RankReceived`, `RankRecvFailed`, `RankSent`, `RankEnded`, `RankPosted`);
- each worker rank's main thread (`push.d_registration`, `push.p_lease`, `pull.*`): the
  step's metadata (`Enqueued`, `Staged`, `End`), the writer thread's reports
  (`ReportToMain`: handshake, PUSH_REG sent, WRITE posted, lease revoked), the peers'
  notifs the writer forwards, and get_finished's poll of a posted transfer;
- each rank's writer thread (`push.match`, `push.remote_engine`): their events live in
  their own modules.

Peer events, provoked by bytes from the other engine, derive from `PeerEvent`:
`Completion`, `WriteFailed` (P's `PUSH_FAIL`), `Heartbeat` (D's `HB:`) and `Matched` (D's
`PUSH_REG` met P's blocks). Each names the engine and rank the sending agent belongs to,
as far as this side knows (None for an agent of no known engine), so a machine accepts it
only from the peer the request is bound to (S-02); an event a state does not declare, or
that its guards refuse, is a `RemoteProtocolError` that changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.events import Event, PeerEvent

__all__ = [
    "Abort",
    "Completion",
    "Drained",
    "End",
    "Enqueued",
    "HandshakeDone",
    "HandshakeFailed",
    "HandshakeStarted",
    "Heartbeat",
    "LeaseExpired",
    "Matched",
    "Poll",
    "RankEnded",
    "RankPosted",
    "RankReceived",
    "RankRecvFailed",
    "RankSent",
    "ReadDone",
    "ReadError",
    "ReadPosted",
    "ReadSubmitFailed",
    "ReadTimeout",
    "RegSent",
    "Revoked",
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


# -- the engine API and the scheduler ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Drained(Event):
    """`build_connector_meta` put the registration, blocks or read in this step's meta."""


@dataclass(frozen=True, slots=True)
class Abort(Event):
    """The engine's request-level abort path ends the request."""


@dataclass(frozen=True, slots=True)
class RankReceived(Event):
    """Worker rank `rank` has every byte of the request (its completions all arrived)."""

    rank: int


@dataclass(frozen=True, slots=True)
class RankRecvFailed(Event):
    """Worker rank `rank` failed its part of the receive."""

    rank: int
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RankSent(Event):
    """Worker rank `rank` is done with P's blocks (its WRITEs ended or its lease ran out)."""

    rank: int


@dataclass(frozen=True, slots=True)
class RankEnded(Event):
    """Worker rank `rank` dropped the request the scheduler ended."""

    rank: int


@dataclass(frozen=True, slots=True)
class RankPosted(Event):
    """Pull mode: worker rank `rank` posted its READ into D's blocks."""

    rank: int


# -- a worker rank's main thread: the step's metadata ------------------------------------


@dataclass(frozen=True, slots=True)
class Enqueued(Event):
    """`start_load_kv` handed the registration or read to the writer thread."""


@dataclass(frozen=True, slots=True)
class Staged(Event):
    """`start_load_kv` handed P's finished blocks to the writer thread."""


@dataclass(frozen=True, slots=True)
class End(Event):
    """The scheduler ended the request (watchdog, abort): drop it."""


# -- reports of the writer thread -----------------------------------------------------------


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
    """D's `PUSH_REG` left for the P ranks that write into this rank."""


@dataclass(frozen=True, slots=True)
class SendFailed(Event):
    """D's `PUSH_REG` could not be sent (R-P12)."""


@dataclass(frozen=True, slots=True)
class Matched(PeerEvent):
    """P's writer matched the blocks with the `PUSH_REG`s of D engine `engine` (R-P04),
    sent by the D agents `agents`."""

    engine: str = ""
    agents: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class WritePosted(Event):
    """P's WRITEs into D's blocks left, `targets` of them (R-P06, R-T03)."""

    targets: int = 1


@dataclass(frozen=True, slots=True)
class WriteSubmitFailed(Event):
    """P's WRITE failed to post; D was told where it listens (B-10)."""

    cause: str = "post"


@dataclass(frozen=True, slots=True)
class Revoked(Event):
    """The writer acknowledged a revoked lease: it will post nothing from it any more."""


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
    """Every WRITE of the request completed."""


@dataclass(frozen=True, slots=True)
class WriteError(Event):
    """The request's WRITEs ended, at least one in error: those into `failed_ranks`.
    `cause` (B-14) is "post" when the batched transfer carrying it failed to post (B-13)."""

    failed_ranks: tuple[int, ...] = ()
    cause: str = "transfer_error"


@dataclass(frozen=True, slots=True)
class ReadDone(Event):
    """The READ completed, seen at `wall` (D's wall clock; None: not told)."""

    wall: float | None = None


@dataclass(frozen=True, slots=True)
class ReadError(Event):
    """The READ ended in error."""


# -- from the peer -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Completion(PeerEvent):
    """A completion notif `<request_id>:<tp_size>`: a P rank's WRITE landed in this D
    rank's blocks (push), or D's READ of P's blocks is done (pull) (R-P06, R-P08).
    `engine` / `rank` identify the sending agent (None: an agent of no known engine)."""

    sender: str = ""
    engine: str | None = None
    rank: int | None = None
    tp_size: int = 1


@dataclass(frozen=True, slots=True)
class WriteFailed(PeerEvent):
    """P's `PUSH_FAIL` notif: a P rank's WRITE into this rank failed (B-10); counted like
    a completion, it marks the blocks invalid."""

    sender: str = ""
    engine: str | None = None
    rank: int | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat(PeerEvent):
    """D's `HB:` notif names the request: extend its lease (R-P08, R-P15). `engine`
    identifies the sending agent (None: not yet handshaked), `sender` is its name."""

    engine: str | None = None
    sender: str = ""


# -- timeouts --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WatchdogExpired(Event):
    """D's registration or read waited `push_registration_timeout` (R-P10)."""


@dataclass(frozen=True, slots=True)
class LeaseExpired(Event):
    """P's lease ran out (R-P11)."""


@dataclass(frozen=True, slots=True)
class WriteTimeout(Event):
    """P's posted WRITEs outlived `push_write_timeout`."""


@dataclass(frozen=True, slots=True)
class ReadTimeout(Event):
    """D's posted READ outlived `push_write_timeout` (pull mode)."""
