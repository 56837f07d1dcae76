"""What crosses between an engine's scheduler and its worker ranks, and back to the engine
(R-T01, R-T02, B-14).

Every record here is a msgspec Struct of plain data: in an engine the scheduler runs in
one process and each TP/PP rank in another, so these are all they share.

- `PushConnectorMeta`, scheduler -> every rank, once per step: D's registrations, P's
  finished blocks, pull reads, the requests the scheduler ended (each rank drops them
  and says so), and the heartbeats due (one batch per P engine).
- `PushWorkerOutput`, each rank -> scheduler, once per step: what the rank finished,
  failed or dropped, pull READs it posted, its failures by cause and its rejected inputs.
- `PushConnectorOutput`, scheduler -> engine: the aggregate, where a request is finished
  or failed only once every participating rank reported (R-T02).
"""

from __future__ import annotations

import msgspec

from kvhandoff.protocol.legs import PullSource
from kvhandoff.protocol.push_wire import PushRegistration

__all__ = [
    "FAILURE_CAUSES",
    "PullRead",
    "PushConnectorMeta",
    "PushConnectorOutput",
    "PushWorkerOutput",
    "Timing",
]

FAILURE_CAUSES = ("handshake", "post", "transfer_error", "timeout", "peer_gone", "rejected")
"""B-14: the causes failures are counted under."""


class PullRead(msgspec.Struct, frozen=True):
    """Pull mode (B-09): where D reads from, and D's own blocks the READ lands in."""

    source: PullSource
    block_ids: tuple[int, ...]


class PushConnectorMeta(msgspec.Struct, kw_only=True):
    """What one scheduler step hands to every worker rank."""

    step: int = 0
    push_registrations: dict[str, PushRegistration] = msgspec.field(default_factory=dict)
    push_finished_blocks: dict[str, tuple[int, ...]] = msgspec.field(default_factory=dict)
    pull_reads: dict[str, PullRead] = msgspec.field(default_factory=dict)
    ended: tuple[str, ...] = ()
    """Requests the scheduler gave up on (watchdog, abort): ranks drop them."""
    heartbeats: dict[str, tuple[str, ...]] = msgspec.field(default_factory=dict)
    """P engine id -> the ids P knows the waiting requests by (R-P15)."""


class PushWorkerOutput(msgspec.Struct, kw_only=True):
    """What one worker rank reports after a step (get_finished)."""

    rank: int
    step: int
    """The step of the last metadata this rank took."""
    finished_sending: tuple[str, ...] = ()
    finished_recving: tuple[str, ...] = ()
    failed_recving: dict[str, str] = msgspec.field(default_factory=dict)
    invalid_block_ids: tuple[int, ...] = ()
    """The blocks of this step's failed receives: the rank's load errors (the engine's
    worker reports them in the same step as the failure, R-P12)."""
    ended: tuple[str, ...] = ()
    posted: tuple[str, ...] = ()
    failures: dict[str, int] = msgspec.field(default_factory=dict)
    """Failures since the last output, by cause (`FAILURE_CAUSES`)."""


class Timing(msgspec.Struct, frozen=True):
    """One finished transfer, timed by the scheduler's machines (B-14)."""

    seconds: float
    """From its start (P: the prefill's end; D: the blocks' allocation) to the step every
    rank reported it done."""
    num_blocks: int


class PushConnectorOutput(msgspec.Struct, kw_only=True):
    """What the engine learns after a step: requests every rank is done with."""

    finished_sending: set[str] = msgspec.field(default_factory=set)
    finished_recving: set[str] = msgspec.field(default_factory=set)
    failed_recving: dict[str, str] = msgspec.field(default_factory=dict)
    invalid_block_ids: set[int] = msgspec.field(default_factory=set)
    released: dict[str, str] = msgspec.field(default_factory=dict)
    """D requests the engine ended (abort path) that no rank holds any more, with why the
    receive did not happen: their blocks may be freed (`ReportReleased`)."""
    failed_released: set[str] = msgspec.field(default_factory=set)
    """The released requests a rank had failed its part of (the engine ended them for the
    failed load, as vLLM does under `kv_load_failure_policy="fail"`): failed transfers."""
    timings: dict[str, Timing] = msgspec.field(default_factory=dict)
    """Each request of `finished_sending` and `finished_recving`, timed (`Timing`)."""
