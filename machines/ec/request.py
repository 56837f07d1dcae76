"""Request availability: may this request run, must it wait, or has it lost an encoding (B-05).

Keyed by request id, on the consumer side (`ec_consumer`, `ec_both`). The request's
encodings are settled one by one by `ec.settlement` machines (one per `mm_hash`), which
report here:

- `settled(mm_hash)`: the encoding is held in the tier for this request.
- `fall_back(mm_hash, reason)`: it will not come from the tier or a peer, so the request
  encodes it locally. When the request's media for that `mm_hash` was rewritten into a
  metadata-only reference there is nothing to encode: the request goes to `failed` with
  a `FailRequest(request_id, reason)`, the scheduler-side failure path that the seed
  lacked (its worker crashed later instead).
- `available`: asked by `ensure_cache_available`: when every `mm_hash` is settled the
  request goes to `available` (it may be scheduled); otherwise it keeps waiting.
- `encoding_lost`: a load the request depended on failed -> `failed`.
- `finished` (the request finished or was aborted).

Leaving for `failed` or `finished` releases every settlement of the request
(`ReleaseSettlements`: pins held for it, places among a read's waiters).

The parsed `ec_transfer_params` live in the context: the request's input, parsed once.

Tags: `unsettled` (waiting: some `mm_hash` is not settled yet), `schedulable` (available),
`failed_cleanly` (failed, holding nothing, until the engine finishes it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.ec_publication import PublishedEncoding

__all__ = [
    "EC_REQUEST",
    "Available",
    "EncodingLost",
    "FailRequest",
    "FallBack",
    "Finished",
    "ReleaseSettlements",
    "RequestCtx",
    "Settled",
]


@dataclass(slots=True)
class RequestCtx:
    key: str
    """The request id."""
    mm_hashes: tuple[str, ...] = ()
    """Its encodings, each once, in order."""
    metadata_only: frozenset[str] = frozenset()
    """`mm_hash`es without media: they cannot be encoded locally."""
    published: dict[str, PublishedEncoding | None] = field(default_factory=dict)
    """Its `ec_transfer_params`, parsed (None: published as unservable)."""
    params_error: str = ""
    """Why its `ec_transfer_params` were refused, if they were."""
    settled: set[str] = field(default_factory=set)
    """`mm_hash`es held in the tier or encoded locally."""
    local: dict[str, str] = field(default_factory=dict)
    """`mm_hash` -> why it is encoded locally."""
    failure: str = ""


@dataclass(frozen=True, slots=True)
class Settled(Event):
    """`mm_hash` is held in the tier for this request."""

    mm_hash: str


@dataclass(frozen=True, slots=True)
class FallBack(Event):
    """`mm_hash` will not come from the tier or a peer (`reason`): encode it locally."""

    mm_hash: str
    reason: str


@dataclass(frozen=True, slots=True)
class Available(Event):
    """May the request be scheduled now?"""


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


@dataclass(frozen=True, slots=True)
class ReleaseSettlements(Effect):
    """The scheduler: release every live settlement of `request_id` (one per `mm_hash`)."""

    request_id: str
    mm_hashes: tuple[str, ...]


def _media_missing(ctx: RequestCtx, event: FallBack) -> bool:
    return event.mm_hash in ctx.metadata_only


def _all_settled(ctx: RequestCtx, event: Available) -> bool:
    return ctx.settled.issuperset(ctx.mm_hashes)


def _settled(ctx: RequestCtx, event: Settled) -> None:
    ctx.settled.add(event.mm_hash)


def _note_local(ctx: RequestCtx, event: FallBack) -> None:
    ctx.local[event.mm_hash] = event.reason
    ctx.settled.add(event.mm_hash)


def _release(ctx: RequestCtx) -> list[Effect]:
    return [ReleaseSettlements(ctx.key, ctx.mm_hashes)]


def _fail(ctx: RequestCtx, reason: str) -> list[Effect]:
    ctx.failure = reason
    return [FailRequest(ctx.key, reason), Metric("ec.request.failed"), *_release(ctx)]


def _lost_after_fallback(ctx: RequestCtx, event: FallBack) -> list[Effect]:
    return _fail(
        ctx,
        f"encoding {event.mm_hash} was announced but is lost ({event.reason}) and its media "
        "was rewritten to a metadata-only reference",
    )


def _load_lost(ctx: RequestCtx, event: EncodingLost) -> list[Effect]:
    return _fail(ctx, f"loading encoding {event.mm_hash} from the CPU tier failed")


def _finished(ctx: RequestCtx, event: Finished) -> list[Effect]:
    return _release(ctx)


EC_REQUEST: Declaration[RequestCtx] = Declaration(
    name="ec.request",
    context=RequestCtx,
    description=(
        "Consumer-side availability of one request's encodings (B-05): available once "
        "every encoding is held in the tier or encoded locally; failed cleanly with a "
        "reason when an announced encoding is lost after the media was rewritten to a "
        "metadata-only reference, or its load failed."
    ),
    states=[
        {"name": "waiting", "tags": ("unsettled",)},
        {"name": "available", "tags": ("schedulable",)},
        {"name": "failed", "tags": ("failed_cleanly",)},
        {"name": "finished", "final": True},
    ],
    initial="waiting",
    transitions=[
        {"trigger": Settled, "source": "waiting", "dest": None, "after": "settled"},
        {
            "trigger": FallBack,
            "source": "waiting",
            "dest": "failed",
            "conditions": "media_missing",
            "after": "lost_after_fallback",
        },
        {"trigger": FallBack, "source": "waiting", "dest": None, "after": "note_local"},
        {
            "trigger": Available,
            "source": "waiting",
            "dest": "available",
            "conditions": "all_settled",
        },
        {"trigger": Available, "source": "waiting", "dest": None},
        {
            "trigger": EncodingLost,
            "source": ["waiting", "available"],
            "dest": "failed",
            "after": "load_lost",
        },
        {
            "trigger": Finished,
            "source": ["waiting", "available"],
            "dest": "finished",
            "after": "finished",
        },
        {"trigger": Finished, "source": "failed", "dest": "finished"},
    ],
    ignore=[
        ("available", Available),
        ("failed", Available),
        ("failed", Settled),
        ("failed", FallBack),
        ("failed", EncodingLost),
    ],
    callbacks={
        "media_missing": _media_missing,
        "all_settled": _all_settled,
        "settled": _settled,
        "note_local": _note_local,
        "lost_after_fallback": _lost_after_fallback,
        "load_lost": _load_lost,
        "finished": _finished,
    },
)
