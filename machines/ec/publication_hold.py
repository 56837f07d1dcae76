"""Publication hold: a producer keeps a just-published encoding until it is read, for a
bounded time (R-E06, B-01).

Keyed by `mm_hash`, on a P2P producer. When `request_finished` publishes an encoding
whose bytes are in the tier, the scheduler's publisher creates a hold and delivers
`Hold`: the entry is pinned, so FIFO eviction under pressure cannot take it before a
consumer that asks promptly (the decode leg follows the prefill leg at once) is served.
The hold lets go (unpins) at the first completed READ of the entry (`Consumed`, a
grant released by `XferDone(ok)` or a READ notif), or after `producer_publish_pin_s`
(5 s by default), whichever comes first; the entry is then evictable as before, and
evicting it unconsumed is still announced (B-01). How many entries and how much of the
tier holds may pin is bounded by the publisher (`producer_max_publish_pins`, half of the
tier's blocks), so publication never pins the whole tier. A re-publication while held
keeps the first hold.

Tags: `holding` (the entry is pinned by this hold).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.events import Pin, Unpin
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Emit, Metric
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.ec_config import DEFAULT_PUBLISH_PIN_S

__all__ = [
    "DEFAULT_MAX_PUBLISH_PINS",
    "EC_PUBLICATION_HOLD",
    "Consumed",
    "Hold",
    "HoldCtx",
    "HoldExpired",
    "HoldReleased",
]

DEFAULT_MAX_PUBLISH_PINS = 1024.0
"""Published entries held at once at most (`producer_max_publish_pins`; the rest are
published unheld, and counted)."""


@dataclass(slots=True)
class HoldCtx:
    key: str
    """The `mm_hash` held."""
    blocks: int = 0
    """Blocks of the entry it pins (the publisher's cap counts them)."""


@dataclass(frozen=True, slots=True)
class Hold(Event):
    """The encoding was published: pin it."""


@dataclass(frozen=True, slots=True)
class Consumed(Event):
    """A peer's READ of the entry completed: the hold has done its job."""


@dataclass(frozen=True, slots=True)
class HoldExpired(Event):
    """`producer_publish_pin_s` passed."""


@dataclass(frozen=True, slots=True)
class HoldReleased(Effect):
    """The hold let go of its entry (the publisher's cap counts its blocks no more)."""

    mm_hash: str
    blocks: int


def _pin(ctx: HoldCtx, event: Hold) -> list[Effect]:
    return [Emit(EC_CACHE_ENTRY, ctx.key, Pin()), Metric("ec.producer.publication_held")]


def _unpin_consumed(ctx: HoldCtx, event: Consumed) -> list[Effect]:
    return [Emit(EC_CACHE_ENTRY, ctx.key, Unpin()), HoldReleased(ctx.key, ctx.blocks)]


def _unpin_expired(ctx: HoldCtx, event: HoldExpired) -> list[Effect]:
    return [
        Emit(EC_CACHE_ENTRY, ctx.key, Unpin()),
        HoldReleased(ctx.key, ctx.blocks),
        Metric("ec.producer.publication_hold_expired"),
    ]


EC_PUBLICATION_HOLD: Declaration[HoldCtx] = Declaration(
    name="ec.publication_hold",
    context=HoldCtx,
    description=(
        "A producer pins a just-published encoding until its first completed READ, for "
        "producer_publish_pin_s at most, so a consumer that asks promptly is served "
        "before eviction can take it (R-E06, B-01)."
    ),
    states=[
        "new",
        {
            "name": "holding",
            "tags": ("holding",),
            "timeout": Timeout(
                "producer_publish_pin_s", "released", HoldExpired, action="unpin_expired"
            ),
        },
        {"name": "released", "final": True},
    ],
    initial="new",
    transitions=[
        {"trigger": Hold, "source": "new", "dest": "holding", "after": "pin"},
        {"trigger": Consumed, "source": "holding", "dest": "released", "after": "unpin_consumed"},
    ],
    ignore=[("holding", Hold), ("new", Consumed)],
    callbacks={"pin": _pin, "unpin_consumed": _unpin_consumed, "unpin_expired": _unpin_expired},
    config_defaults={
        "producer_publish_pin_s": DEFAULT_PUBLISH_PIN_S,
        "producer_max_publish_pins": DEFAULT_MAX_PUBLISH_PINS,
    },
)
