"""Request availability: may this request run, must it wait, or has it lost an encoding (B-05).

Keyed by request id, on the consumer side (`ec_consumer`, `ec_both`). The scheduler's
`ensure_cache_available` settles each `mm_hash` of the request once:

- `hold` (the encoding is in the tier): pin its entry until the scheduler allocates the
  request's encoder inputs (`load` hands the pin over to the load), so no eviction can
  take it between "available" and "loaded".
- `fall_back` (`FallBack(mm_hash, reason)`): the encoding will not come from the tier or a
  peer, so the request encodes it locally. When the request's media for that `mm_hash`
  was rewritten into a metadata-only reference there is nothing to encode: the request
  goes to `failed` with a `FailRequest(request_id, reason)`, the scheduler-side failure
  path that the seed lacked (its worker crashed later instead).
- `available`: every `mm_hash` is held or settled locally; the request may be scheduled.
- `encoding_lost`: a load the request depended on failed -> `failed`.
- `finished` (the request finished or was aborted): holds are released.

While `waiting` the request depends on consumer reads, each bounded by its own timeouts,
and on the next scheduler step.

Tags: `unsettled` (waiting: some `mm_hash` is not settled yet), `schedulable` (available),
`failed_cleanly` (failed, holding nothing, until the engine finishes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.events import Pin, Unpin
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Emit, Metric
from kvhandoff.machines.runtime.events import Event

__all__ = [
    "EC_REQUEST",
    "Available",
    "EncodingLost",
    "FailRequest",
    "FallBack",
    "Finished",
    "Hold",
    "Load",
    "RequestCtx",
]


@dataclass(slots=True)
class RequestCtx:
    key: str
    """The request id."""
    metadata_only: frozenset[str] = frozenset()
    """`mm_hash`es without media: they cannot be encoded locally."""
    held: set[str] = field(default_factory=set)
    """Entries pinned for this request and not yet handed to a load."""
    local: dict[str, str] = field(default_factory=dict)
    """`mm_hash` -> why it is encoded locally."""
    failure: str = ""


@dataclass(frozen=True, slots=True)
class Hold(Event):
    """`mm_hash` is in the tier: pin it until the request's load is scheduled."""

    mm_hash: str


@dataclass(frozen=True, slots=True)
class FallBack(Event):
    """`mm_hash` will not come from the tier or a peer (`reason`): encode it locally."""

    mm_hash: str
    reason: str


@dataclass(frozen=True, slots=True)
class Available(Event):
    """Every `mm_hash` is held or settled locally."""


@dataclass(frozen=True, slots=True)
class Load(Event):
    """The load of `mm_hash` was scheduled: the hold becomes the load's pin."""

    mm_hash: str


@dataclass(frozen=True, slots=True)
class EncodingLost(Event):
    """The load of `mm_hash` the request depended on failed."""

    mm_hash: str


@dataclass(frozen=True, slots=True)
class Finished(Event):
    """The request finished or was aborted."""


@dataclass(frozen=True, slots=True)
class FailRequest(Effect):
    """Engine scheduler: fail `request_id` cleanly with `reason` (B-05)."""

    request_id: str
    reason: str


def _media_missing(ctx: RequestCtx, event: FallBack) -> bool:
    return event.mm_hash in ctx.metadata_only


def _hold(ctx: RequestCtx, event: Hold) -> list[Effect]:
    ctx.held.add(event.mm_hash)
    return [Emit(EC_CACHE_ENTRY, event.mm_hash, Pin())]


def _note_local(ctx: RequestCtx, event: FallBack) -> None:
    ctx.local[event.mm_hash] = event.reason


def _release_holds(ctx: RequestCtx) -> list[Effect]:
    held, ctx.held = ctx.held, set()
    return [Emit(EC_CACHE_ENTRY, mm_hash, Unpin()) for mm_hash in sorted(held)]


def _fail(ctx: RequestCtx, reason: str) -> list[Effect]:
    ctx.failure = reason
    return [FailRequest(ctx.key, reason), Metric("ec.request.failed"), *_release_holds(ctx)]


def _lost_after_fallback(ctx: RequestCtx, event: FallBack) -> list[Effect]:
    return _fail(
        ctx,
        f"encoding {event.mm_hash} was announced but is lost ({event.reason}) and its media "
        "was rewritten to a metadata-only reference",
    )


def _load_lost(ctx: RequestCtx, event: EncodingLost) -> list[Effect]:
    return _fail(ctx, f"loading encoding {event.mm_hash} from the CPU tier failed")


def _hand_over(ctx: RequestCtx, event: Load) -> None:
    ctx.held.discard(event.mm_hash)


def _finished(ctx: RequestCtx, event: Finished) -> list[Effect]:
    return _release_holds(ctx)


EC_REQUEST: Declaration[RequestCtx] = Declaration(
    name="ec.request",
    context=RequestCtx,
    description=(
        "Consumer-side availability of one request's encodings (B-05): held in the tier, "
        "encoded locally, or failed cleanly with a reason when an announced encoding is "
        "lost after the media was rewritten to a metadata-only reference."
    ),
    states=[
        {"name": "waiting", "tags": ("unsettled",)},
        {"name": "available", "tags": ("schedulable",)},
        {"name": "failed", "tags": ("failed_cleanly",)},
        {"name": "finished", "final": True},
    ],
    initial="waiting",
    transitions=[
        {"trigger": Hold, "source": "waiting", "dest": None, "after": "hold"},
        {
            "trigger": FallBack,
            "source": "waiting",
            "dest": "failed",
            "conditions": "media_missing",
            "after": "lost_after_fallback",
        },
        {"trigger": FallBack, "source": "waiting", "dest": None, "after": "note_local"},
        {"trigger": Available, "source": "waiting", "dest": "available"},
        {"trigger": Load, "source": "available", "dest": None, "after": "hand_over"},
        {
            "trigger": EncodingLost,
            "source": ["waiting", "available"],
            "dest": "failed",
            "after": "load_lost",
        },
        {
            "trigger": Finished,
            "source": ["waiting", "available", "failed"],
            "dest": "finished",
            "after": "finished",
        },
    ],
    ignore=[("failed", FallBack), ("failed", EncodingLost), ("failed", Load)],
    callbacks={
        "media_missing": _media_missing,
        "hold": _hold,
        "note_local": _note_local,
        "lost_after_fallback": _lost_after_fallback,
        "hand_over": _hand_over,
        "load_lost": _load_lost,
        "finished": _finished,
    },
)
