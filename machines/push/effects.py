"""Effects of the push-mode machines: what they ask the edges to do, as data.

Main-thread effects are executed by the worker's adapter (inbox hand-offs, heartbeats,
engine reports); writer-thread effects by the push writer thread (NIXL notifs, WRITEs,
handshakes on the executor, self-poll). In the sans-IO tests they land in the bus
outbox and a simulated fabric executes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.legs import PullSource
from kvhandoff.protocol.notifs import Notif
from kvhandoff.protocol.push_wire import PushRegistration

# -- main thread -> writer thread (the seed's inboxes) ---------------------------------


@dataclass(frozen=True, slots=True)
class EnqueueRegistration(Effect):
    """D worker: put (request_id, registration) on the reg-send inbox (R-P02)."""

    request_id: str
    registration: PushRegistration


@dataclass(frozen=True, slots=True)
class EnqueueFinishedBlocks(Effect):
    """P worker: put (request_id, block_ids) on the finished-blocks inbox (R-P03)."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class QueueEviction(Effect):
    """Put request_id on the evict-finished inbox: the writer drops its stale state (R-P09)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class WakeWriter(Effect):
    """Set the writer's wake event (R-P07)."""


@dataclass(frozen=True, slots=True)
class PollTransfer(Effect):
    """Main thread: check a posted WRITE's (or pull READ's) transfer status and report
    `WriteDone` / `WriteError` (`ReadDone` / `ReadError`)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReleaseTransfer(Effect):
    """P main thread: a WRITE timed out; release its handle (NIXL cancels it in flight)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class SendHeartbeat(Effect):
    """D main thread: send `HB:<ids>` to the prefill engine (R-P08, R-P15)."""

    engine_id: str
    request_ids: tuple[str, ...]


# -- reports to the engine -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReportFinishedRecving(Effect):
    """D: the request's KV arrived; reported by get_finished (R-P09)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReportFailedRecving(Effect):
    """D: the pre-allocated blocks are invalid; the receive failed (R-P12, B-06)."""

    request_id: str
    block_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class ReportFinishedSending(Effect):
    """P: the blocks may be freed (WRITE done or lease reaped) (R-P09, R-P11)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class Warn(Effect):
    """Log a warning once, with the request it concerns."""

    request_id: str
    message: str


# -- writer thread -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartHandshake(Effect):
    """Run the side-channel handshake with `engine_id` on the handshake executor (R-P05)."""

    engine_id: str
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class DropRemoteAgent(Effect):
    """Forget a remote agent whose peer was lost, so the next use re-handshakes (B-08)."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class SendPushReg(Effect):
    """D writer: send_notif `PUSH_REG:<msgpack>` to P's agent; report reg_sent / send_failed."""

    request_id: str
    registration: PushRegistration


@dataclass(frozen=True, slots=True)
class IssueWrite(Effect):
    """P writer: NIXL WRITE `block_ids` into D's registered blocks (R-P06).

    The executor expands D's logical ids with the ratio learnt in the handshake, posts the
    WRITE with completion notif `<registration.request_id>:<tp_size>`, and reports
    write_posted, or write_submit_failed after sending the WRITE-failed notif (B-06).
    """

    request_id: str
    block_ids: tuple[int, ...]
    registration: PushRegistration
    sender_agent: str = ""  # the agent the PUSH_REG came from; WRITE only into that one


@dataclass(frozen=True, slots=True)
class ReplayRegistration(Effect):
    """Handshake done: re-queue a deferred registration on the reg-send inbox (R-P05)."""

    request_id: str
    registration: PushRegistration


@dataclass(frozen=True, slots=True)
class ReplayPush(Effect):
    """Handshake done: re-queue a matched push on the deferred-push inbox (R-P05)."""

    request_id: str
    block_ids: tuple[int, ...]
    registration: PushRegistration
    sender_agent: str = ""


@dataclass(frozen=True, slots=True)
class ForwardToMain(Effect):
    """Put a HB / completion / WRITE-failed notif on the pending-completion-notifs queue."""

    notif: Notif
    peer: str


@dataclass(frozen=True, slots=True)
class ReportToMain(Effect):
    """Tell the main thread's lifecycle `request_id` that `event` happened on the writer;
    `peer` names the agent whose input provoked it, for a peer event (`Matched`)."""

    request_id: str
    event: Event
    peer: str | None = None


@dataclass(frozen=True, slots=True)
class ArmSelfPoll(Effect):
    """P finished blocks wait for a PUSH_REG: poll notifs every `interval_s` (R-P07)."""

    interval_s: float


@dataclass(frozen=True, slots=True)
class DisarmSelfPoll(Effect):
    """Nothing waits for a PUSH_REG any more: block on the wake event again (R-P07)."""


# -- pull mode on the same base (B-09) -------------------------------------------------


@dataclass(frozen=True, slots=True)
class EnqueueRead(Effect):
    """D worker: hand a pull read to the writer thread (it goes through the handshake)."""

    request_id: str
    source: PullSource
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReplayRead(Effect):
    """Handshake done: re-queue a deferred pull read on the pull-read inbox."""

    request_id: str
    source: PullSource
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class IssueRead(Effect):
    """D writer: NIXL READ P's blocks into D's, with completion notif to P; report
    read_posted or read_submit_failed."""

    request_id: str
    source: PullSource
    block_ids: tuple[int, ...]
