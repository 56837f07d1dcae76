"""Request availability: may this request run, must it wait, or has it lost an encoding (B-05).

Keyed by request id, on the consumer side (`ec_consumer`, `ec_both`). The scheduler's
`ensure_cache_available` settles each `mm_hash` of the request once:

- `hold` (the encoding is in the tier): pin its entry until the scheduler allocates the
  request's encoder inputs (`load` hands the pin over to the load), so no eviction can
  take it between "available" and "loaded".
- `fall_back` (payload `(mm_hash, reason)`): the encoding will not come from the tier or a
  peer, so the request encodes it locally. When the request's media for that `mm_hash`
  was rewritten into a metadata-only reference there is nothing to encode: the request
  goes to `failed` with a `FailRequest(request_id, reason)`, the scheduler-side failure
  path that the seed lacked (its worker crashed later instead).
- `available`: every `mm_hash` is held or settled locally; the request may be scheduled.
- `encoding_lost`: a load the request depended on failed -> `failed`.
- `finished` (the request finished or was aborted): holds are released.

While `waiting` the request depends on consumer reads, each bounded by its own timeouts,
and on the next scheduler step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvhandoff.machines.ec.cache_entry import ENTRY_KIND
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Emit, Metric

__all__ = ["EC_REQUEST", "REQUEST_KIND", "FailRequest", "RequestCtx"]

REQUEST_KIND = "ec.request"


@dataclass(slots=True)
class RequestCtx:
    metadata_only: frozenset[str] = frozenset()
    """`mm_hash`es without media: they cannot be encoded locally."""
    held: set[str] = field(default_factory=set)
    """Entries pinned for this request and not yet handed to a load."""
    local: dict[str, str] = field(default_factory=dict)
    """`mm_hash` -> why it is encoded locally."""
    failure: str = ""


@dataclass(frozen=True, slots=True)
class FailRequest:
    """Engine scheduler: fail `request_id` cleanly with `reason` (B-05)."""

    request_id: str
    reason: str


def _media_missing(inst: Any, payload: tuple[str, str]) -> bool:
    return payload[0] in inst.ctx.metadata_only


def _hold(inst: Any, mm_hash: str) -> list[object]:
    inst.ctx.held.add(mm_hash)
    return [Emit(ENTRY_KIND, mm_hash, "pin")]


def _note_local(inst: Any, payload: tuple[str, str]) -> None:
    mm_hash, reason = payload
    inst.ctx.local[mm_hash] = reason


def _release_holds(inst: Any) -> list[object]:
    held, inst.ctx.held = inst.ctx.held, set()
    return [Emit(ENTRY_KIND, mm_hash, "unpin") for mm_hash in sorted(held)]


def _fail(inst: Any, reason: str) -> list[object]:
    inst.ctx.failure = reason
    return [FailRequest(inst.key, reason), Metric("ec.request.failed"), *_release_holds(inst)]


def _lost_after_fallback(inst: Any, payload: tuple[str, str]) -> list[object]:
    mm_hash, reason = payload
    return _fail(
        inst,
        f"encoding {mm_hash} was announced but is lost ({reason}) and its media "
        "was rewritten to a metadata-only reference",
    )


def _load_lost(inst: Any, payload: str) -> list[object]:
    return _fail(inst, f"loading encoding {payload} from the CPU tier failed")


def _hand_over(inst: Any, mm_hash: str) -> None:
    inst.ctx.held.discard(mm_hash)


def _finished(inst: Any, payload: Any) -> list[object]:
    return _release_holds(inst)


EC_REQUEST = Declaration(
    name=REQUEST_KIND,
    description=(
        "Consumer-side availability of one request's encodings (B-05): held in the tier, "
        "encoded locally, or failed cleanly with a reason when an announced encoding is "
        "lost after the media was rewritten to a metadata-only reference."
    ),
    states=["waiting", "available", "failed", {"name": "finished", "final": True}],
    initial="waiting",
    transitions=[
        {"trigger": "hold", "source": "waiting", "dest": None, "after": "hold"},
        {
            "trigger": "fall_back",
            "source": "waiting",
            "dest": "failed",
            "conditions": "media_missing",
            "after": "lost_after_fallback",
        },
        {"trigger": "fall_back", "source": "waiting", "dest": None, "after": "note_local"},
        {"trigger": "available", "source": "waiting", "dest": "available"},
        {"trigger": "load", "source": "available", "dest": None, "after": "hand_over"},
        {
            "trigger": "encoding_lost",
            "source": ["waiting", "available"],
            "dest": "failed",
            "after": "load_lost",
        },
        {
            "trigger": "finished",
            "source": ["waiting", "available", "failed"],
            "dest": "finished",
            "after": "finished",
        },
    ],
    ignore=[("failed", "fall_back"), ("failed", "encoding_lost"), ("failed", "load")],
    callbacks={
        "media_missing": _media_missing,
        "hold": _hold,
        "note_local": _note_local,
        "lost_after_fallback": _lost_after_fallback,
        "hand_over": _hand_over,
        "load_lost": _load_lost,
        "finished": _finished,
    },
    context=RequestCtx,
)
