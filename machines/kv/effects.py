"""Effects of the push-mode and pull-mode machines (the base both modes share): what they
ask the edges to do, as data.

- Scheduler effects (`push.d_request`, `push.p_request`) report to the engine: the
  aggregated `finished_recving`, `failed_recving`, `finished_sending`.
- Rank main-thread effects report to the scheduler (the rank's output) and hand typed
  commands to the writer thread (`WriterCommand`: one FIFO, because their relative order
  matters: a lease revoked after its blocks were staged must reach the writer after them).
- Writer effects are NIXL notifs, WRITEs and READs, handshakes on the executor, the
  writer's reports to its main thread, and the self-poll switch.

In the sans-IO tests they land in the bus outbox and a simulated fabric executes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.legs import PullSource
from kvhandoff.protocol.notifs import Notif
from kvhandoff.protocol.push_wire import PushRegistration

# -- reports (rank -> scheduler, scheduler -> engine) ----------------------------------


@dataclass(frozen=True, slots=True)
class ReportFinishedRecving(Effect):
    """D: the request's KV arrived (a rank's part of it, or all of it) (R-P09)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReportFailedRecving(Effect):
    """D: the pre-allocated blocks are invalid; the receive failed (R-P12, B-10)."""

    request_id: str
    block_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class ReportReleased(Effect):
    """D: the engine ended a request it was waiting for (its abort path) and no rank
    holds it any more: its blocks are the engine's again (vLLM frees them once it sees the
    id in `finished_recving`). `reason` says why the receive did not happen; `failed`, that
    a rank had failed its part first (the engine ended it for the failed load, B-14)."""

    request_id: str
    reason: str
    failed: bool = False


@dataclass(frozen=True, slots=True)
class ReportTransferred(Effect):
    """Scheduler: every rank is done with the request and its KV moved, so the engine hears
    of it (`finished_sending` on P, `finished_recving` on D), timed from `since` (the `now`
    the scheduler created it at: P's prefill end, D's block allocation) to the step it
    ends, with the blocks it moved (B-14). One effect per request: the report and its
    timing are one fact."""

    request_id: str
    since: float
    num_blocks: int


@dataclass(frozen=True, slots=True)
class ReportFinishedSending(Effect):
    """P: the blocks may be freed (WRITEs done or failed, or the lease ran out) (R-P09)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReportEnded(Effect):
    """A rank dropped a request the scheduler ended: its memory is the engine's again."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReportPosted(Effect):
    """Pull mode: a rank posted the READ into D's blocks (the scheduler's watchdog stops)."""

    request_id: str


@dataclass(frozen=True, slots=True)
class CountFailure(Effect):
    """Count one failure under its cause (B-14): handshake, post, transfer_error, timeout,
    peer_gone, rejected."""

    cause: str


@dataclass(frozen=True, slots=True)
class Warn(Effect):
    """Log a warning with the request it concerns."""

    request_id: str
    message: str


# -- main thread -> writer thread (typed commands, one FIFO) ---------------------------


@dataclass(frozen=True, slots=True)
class SendRegistration(Effect):
    """D: send this rank's `PUSH_REG` to the P ranks that write into it (R-P02)."""

    request_id: str
    registration: PushRegistration


@dataclass(frozen=True, slots=True)
class StageBlocks(Effect):
    """P: the finished blocks, for matching with D's registrations (R-P03)."""

    request_id: str
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RevokeLease(Effect):
    """P: the lease ran out; post nothing from these blocks any more and say `Revoked`."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReportWriteError(Effect):
    """P: the request's WRITEs ended in error; tell the D ranks they went to (`d_ranks`,
    empty: every target) where they speak `PUSH_FAIL` (B-10)."""

    request_id: str
    reason: str
    d_ranks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class EvictRegistration(Effect):
    """D: the registration ended; drop any send of it still waiting for a handshake."""

    request_id: str


@dataclass(frozen=True, slots=True)
class StartRead(Effect):
    """D, pull mode: READ P's blocks (through the handshake)."""

    request_id: str
    source: PullSource
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class RevokeRead(Effect):
    """D, pull mode: the read ended; post nothing for it any more and say `Revoked`."""

    request_id: str


WriterCommand = (
    SendRegistration
    | StageBlocks
    | RevokeLease
    | ReportWriteError
    | EvictRegistration
    | StartRead
    | RevokeRead
)
"""What a rank's main thread hands its writer thread, in one FIFO."""


@dataclass(frozen=True, slots=True)
class WakeWriter(Effect):
    """Set the writer's wake event (R-P07)."""


@dataclass(frozen=True, slots=True)
class PollTransfer(Effect):
    """Main thread: check the request's posted WRITEs (or pull READ) and report
    `WriteDone` / `WriteError` (`ReadDone` / `ReadError`) once they all ended."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ReleaseTransfer(Effect):
    """Main thread: the transfer timed out; release its handles (NIXL cancels them)."""

    request_id: str


# -- writer thread ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankRegistration:
    """One D rank's `PUSH_REG` for a request, and the agent it came from."""

    d_rank: int
    registration: PushRegistration
    sender: str
    known: bool = True
    """The sender is an agent of an engine this rank is connected to: it holds from the
    connected engines' budget, not the share of agents of no known engine (S-03)."""


@dataclass(frozen=True, slots=True)
class StartHandshake(Effect):
    """Fetch `engine_id`'s handshake at host:port on the handshake executor (R-P05);
    its result names `attempt`, so a late result of an older attempt is told apart."""

    engine_id: str
    host: str
    port: int
    attempt: int = 0
    tp_size: int = 1
    """The peer's TP size as the operation names it (a stock vLLM peer does not say)."""
    pp_size: int = 1


@dataclass(frozen=True, slots=True)
class DropRemoteAgent(Effect):
    """Forget a remote engine's agents (evicted idle, or lost), so the next use
    re-handshakes (B-08, B-11)."""

    engine_id: str


@dataclass(frozen=True, slots=True)
class ReplayRegistration(Effect):
    """D: send a `PUSH_REG` once its P engine is connected (R-P05)."""

    request_id: str
    registration: PushRegistration
    retried: bool = False
    """Sent again after a re-handshake (B-08): P's agent was gone (P restarted)."""


@dataclass(frozen=True, slots=True)
class ReplayPush(Effect):
    """P: WRITE `block_ids` into the D ranks that registered, once D is connected (R-P05).

    The executor trims P's blocks to D's count (R-T05), expands both sides' logical ids,
    checks every registration against D's handshake (S-04) and posts one WRITE per
    target rank with completion notif `<D request id>:<P tp_size>` (R-P06, R-T03)."""

    request_id: str
    block_ids: tuple[int, ...]
    engine_id: str
    registrations: tuple[RankRegistration, ...]
    retried: bool = False
    """Sent again after a re-handshake (B-08): a registration that still disagrees with
    D's agents is stale."""


@dataclass(frozen=True, slots=True)
class ReplayRead(Effect):
    """D, pull mode: READ P's blocks once P is connected."""

    request_id: str
    source: PullSource
    block_ids: tuple[int, ...]


DeferredOp = ReplayRegistration | ReplayPush | ReplayRead
"""An operation that needs its remote engine connected."""


@dataclass(frozen=True, slots=True)
class CancelDeferred(Effect):
    """Drop `request_id`'s operation if it still waits for `engine_id`'s handshake."""

    engine_id: str
    request_id: str


@dataclass(frozen=True, slots=True)
class DeferredFailed(Effect):
    """`op` waited for a handshake that failed; it will never run (R-P12)."""

    op: DeferredOp


@dataclass(frozen=True, slots=True)
class SendPushReg(Effect):
    """D writer: send_notif `PUSH_REG:<msgpack>` to the P ranks that write into this rank."""

    request_id: str
    registration: PushRegistration
    retried: bool = False


@dataclass(frozen=True, slots=True)
class IssueWrite(Effect):
    """P writer: post the WRITEs of a matched push (see `ReplayPush`)."""

    op: ReplayPush


@dataclass(frozen=True, slots=True)
class IssueRead(Effect):
    """D writer, pull mode: READ P's blocks into D's, with completion notif to P."""

    request_id: str
    source: PullSource
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SendPushFail(Effect):
    """P writer: tell D ranks `d_ranks` of a failed push (empty: every target of `op`),
    where they speak `PUSH_FAIL` (B-10)."""

    op: ReplayPush
    reason: str
    d_ranks: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class ForwardToMain(Effect):
    """Put a HB / completion / `PUSH_FAIL` notif on the pending-completion-notifs queue,
    with the engine and global rank of the sending agent as far as the writer knows them
    (None for an agent of no known engine)."""

    notif: Notif
    peer: str
    engine: str | None = None
    rank: int | None = None
    at: float | None = None
    """When the writer took it from NIXL: the main thread applies it at that time, before
    the timeouts due after it (a heartbeat that arrived before its lease's deadline
    extends the lease, R-P08); None applies it at the main thread's `now`."""


@dataclass(frozen=True, slots=True)
class ReportToMain(Effect):
    """Tell the main thread's lifecycle `request_id` that `event` happened on the writer;
    `peer` names the agent whose input provoked it, for a peer event (`Matched`)."""

    request_id: str
    event: Event
    peer: str | None = None


@dataclass(frozen=True, slots=True)
class DroppedRegistration(Effect):
    """P writer: a `PUSH_REG` was dropped without being matched (`reason`: duplicate of
    a registration already held or served, superseded, expired)."""

    d_request_id: str
    reason: str
    d_rank: int = -1


@dataclass(frozen=True, slots=True)
class HoldPending(Effect):
    """P writer: a `PUSH_REG` from `peer` holding `blocks` ids starts (`count` 1) or stops
    (`count` -1) waiting for its blocks: the caps' accounting (S-03)."""

    peer: str
    blocks: int
    count: int
    known: bool = True


@dataclass(frozen=True, slots=True)
class ArmSelfPoll(Effect):
    """P finished blocks wait for a PUSH_REG: poll notifs every `interval_s` (R-P07)."""

    interval_s: float


@dataclass(frozen=True, slots=True)
class DisarmSelfPoll(Effect):
    """Nothing waits for a PUSH_REG any more: block on the wake event again (R-P07)."""
