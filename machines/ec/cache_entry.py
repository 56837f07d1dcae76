"""Embedding-cache entry: one encoding in the CPU tier, keyed by `mm_hash` (R-E04, B-01).

An entry is born `allocated` when blocks of the shared region are reserved for it: either
as the destination of a GPU->CPU save of a local encoder output, or as the destination of
a P2P NIXL READ. Its bytes are not there yet, so it is neither loadable nor servable.

- `saved` (the save's end event was reported, or the READ completed): `allocated -> ready`.
  A ready entry is evictable.
- `pin` (a load into the GPU encoder cache, a producer grant, or a request holding it until
  its load is scheduled): `ready -> pinned`; further pins count up in `pins`. A pinned
  entry is never evicted.
- `unpin`: counts down; the last one takes `pinned -> ready`. `Unpin(consumed=True)`
  reports a peer's completed READ (the encoding was consumed); the first one emits
  `EntryConsumed` (a producer's publication hold lets go of the entry on it).
- `evict` (FIFO, when space is needed): `ready -> evicted`, blocks freed.
- `discard` (the save was abandoned or failed, the READ failed or its quarantine ended):
  `allocated -> evicted`, blocks freed.
- `publish` (the producer's `request_finished` announced it in `ec_transfer_params`)
  marks the entry published, in any live state.

B-01: when an entry that was published and never consumed leaves the tier, the entry
emits `EncodingEvicted(mm_hash, reason)`, an effect an orchestrator subscribes to with
`bus.handle(EncodingEvicted, ...)`; unhandled, it waits in the bus outbox.

The entry does not own the pool: it asks for its blocks to be released (`ReleaseBlocks`)
and tells the eviction order when it becomes evictable or not (`MarkEvictable`); the
`EmbeddingCache` executes those effects.

Tags: `awaiting_bytes` (allocated: a save or READ destination), `loadable` (ready or
pinned: the bytes are in the tier), `evictable` (ready: loadable and held by nobody),
`held` (allocated or pinned: a save, READ or load is unconfirmed, or someone holds it;
the engine must keep stepping, as vLLM 0.33's connector keeps it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.ec.events import Discard, Evict, Pin, Publish, Saved, Unpin
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect

__all__ = [
    "EC_CACHE_ENTRY",
    "EncodingEvicted",
    "EntryConsumed",
    "EntryCtx",
    "MarkEvictable",
    "ReleaseBlocks",
]


@dataclass(slots=True)
class EntryCtx:
    """What an entry remembers besides its state."""

    key: str
    """The entry's `mm_hash`."""
    blocks: tuple[int, ...] = ()
    """Indices of its blocks in the region, in encoding order."""
    size_bytes: int = 0
    """Bytes of the encoding (the last block may be partly used)."""
    origin: str = "save"
    """`"save"`: a local encoder output; `"read"`: the destination of a P2P READ."""
    pins: int = 0
    published: bool = False
    consumed: bool = False


@dataclass(frozen=True, slots=True)
class ReleaseBlocks(Effect):
    """Return the entry's blocks to the pool and forget it in the eviction order."""

    mm_hash: str
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MarkEvictable(Effect):
    """The entry became evictable (`evictable=True`: ready and unpinned) or stopped being."""

    mm_hash: str
    evictable: bool


@dataclass(frozen=True, slots=True)
class EncodingEvicted(Effect):
    """B-01: a published encoding left the tier before any peer consumed it.

    `reason` is `"evicted"` (FIFO eviction) or `"discarded"` (its save or READ was lost).
    """

    mm_hash: str
    reason: str


@dataclass(frozen=True, slots=True)
class EntryConsumed(Effect):
    """A peer's READ of the entry completed, the first time (`Unpin(consumed=True)`)."""

    mm_hash: str


def _last_pin(ctx: EntryCtx, event: Unpin) -> bool:
    return ctx.pins <= 1


def _became_ready(ctx: EntryCtx, event: Saved) -> list[Effect]:
    return [MarkEvictable(ctx.key, True)]


def _first_pin(ctx: EntryCtx, event: Pin) -> list[Effect]:
    ctx.pins = 1
    return [MarkEvictable(ctx.key, False)]


def _add_pin(ctx: EntryCtx, event: Pin) -> None:
    ctx.pins += 1


def _drop_pin(ctx: EntryCtx, event: Unpin) -> list[Effect]:
    ctx.pins -= 1
    if event.consumed and not ctx.consumed:
        ctx.consumed = True
        return [EntryConsumed(ctx.key)]
    return []


def _last_unpin(ctx: EntryCtx, event: Unpin) -> list[Effect]:
    return [*_drop_pin(ctx, event), MarkEvictable(ctx.key, True)]


def _publish(ctx: EntryCtx, event: Publish) -> None:
    ctx.published = True


def _released(ctx: EntryCtx, reason: str) -> list[Effect]:
    effects: list[Effect] = [ReleaseBlocks(ctx.key, ctx.blocks)]
    if ctx.published and not ctx.consumed:
        effects.append(EncodingEvicted(ctx.key, reason))
    return effects


def _evicted(ctx: EntryCtx, event: Evict) -> list[Effect]:
    return _released(ctx, "evicted")


def _discarded(ctx: EntryCtx, event: Discard) -> list[Effect]:
    return _released(ctx, "discarded")


EC_CACHE_ENTRY: Declaration[EntryCtx] = Declaration(
    name="ec.cache_entry",
    context=EntryCtx,
    description=(
        "Embedding-cache entry keyed by mm_hash (R-E04): allocated (bytes not there yet) "
        "-> ready -> pinned (counted) -> ready -> evicted, FIFO among ready and unpinned "
        "entries. Evicting or discarding a published, unconsumed encoding emits "
        "EncodingEvicted (B-01)."
    ),
    states=[
        # Its bytes are not there yet: a save or a READ is filling it.
        {"name": "allocated", "tags": ("awaiting_bytes", "held")},
        # Its bytes are there and nobody holds it: FIFO may evict it.
        {"name": "ready", "tags": ("loadable", "evictable")},
        # Its bytes are there and someone holds it: never evicted.
        {"name": "pinned", "tags": ("loadable", "held")},
        {"name": "evicted", "final": True},
    ],
    initial="allocated",
    transitions=[
        {"trigger": Saved, "source": "allocated", "dest": "ready", "after": "became_ready"},
        {"trigger": Discard, "source": "allocated", "dest": "evicted", "after": "discarded"},
        {"trigger": Pin, "source": "ready", "dest": "pinned", "after": "first_pin"},
        {"trigger": Pin, "source": "pinned", "dest": None, "after": "add_pin"},
        {
            "trigger": Unpin,
            "source": "pinned",
            "dest": "ready",
            "conditions": "last_pin",
            "after": "last_unpin",
        },
        {"trigger": Unpin, "source": "pinned", "dest": None, "after": "drop_pin"},
        {"trigger": Evict, "source": "ready", "dest": "evicted", "after": "evicted"},
        {
            "trigger": Publish,
            "source": ["allocated", "ready", "pinned"],
            "dest": None,
            "after": "publish",
        },
    ],
    callbacks={
        "last_pin": _last_pin,
        "became_ready": _became_ready,
        "first_pin": _first_pin,
        "add_pin": _add_pin,
        "drop_pin": _drop_pin,
        "last_unpin": _last_unpin,
        "publish": _publish,
        "evicted": _evicted,
        "discarded": _discarded,
    },
)
