"""Embedding-cache entry: one encoding in the CPU tier, keyed by `mm_hash` (R-E04, B-01).

An entry is born `allocated` when blocks of the shared region are reserved for it: either
as the destination of a GPU->CPU save of a local encoder output, or as the destination of
a P2P NIXL READ. Its bytes are not there yet, so it is neither loadable nor servable.

- `saved` (the save's end event was reported, or the READ completed): `allocated -> ready`.
  A ready entry is evictable.
- `pin` (a load into the GPU encoder cache, a producer grant, or a request holding it until
  its load is scheduled): `ready -> pinned`; further pins count up in `pins`. A pinned
  entry is never evicted.
- `unpin`: counts down; the last one takes `pinned -> ready`. Its payload is True when the
  unpin reports a peer's completed READ (the encoding was consumed).
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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.runtime.declaration import Declaration

__all__ = [
    "EC_CACHE_ENTRY",
    "ENTRY_KIND",
    "EncodingEvicted",
    "EntryCtx",
    "MarkEvictable",
    "ReleaseBlocks",
]

ENTRY_KIND = "ec.cache_entry"


@dataclass(slots=True)
class EntryCtx:
    """What an entry remembers besides its state."""

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
class ReleaseBlocks:
    """Return the entry's blocks to the pool and forget it in the eviction order."""

    mm_hash: str
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class MarkEvictable:
    """The entry became evictable (`evictable=True`: ready and unpinned) or stopped being."""

    mm_hash: str
    evictable: bool


@dataclass(frozen=True, slots=True)
class EncodingEvicted:
    """B-01: a published encoding left the tier before any peer consumed it.

    `reason` is `"evicted"` (FIFO eviction) or `"discarded"` (its save or READ was lost).
    """

    mm_hash: str
    reason: str


def _last_pin(inst: Any, payload: Any) -> bool:
    return bool(inst.ctx.pins <= 1)


def _became_ready(inst: Any, payload: Any) -> list[object]:
    return [MarkEvictable(inst.key, True)]


def _first_pin(inst: Any, payload: Any) -> list[object]:
    inst.ctx.pins = 1
    return [MarkEvictable(inst.key, False)]


def _add_pin(inst: Any, payload: Any) -> None:
    inst.ctx.pins += 1


def _drop_pin(inst: Any, payload: Any) -> None:
    inst.ctx.pins -= 1
    if payload:
        inst.ctx.consumed = True


def _last_unpin(inst: Any, payload: Any) -> list[object]:
    _drop_pin(inst, payload)
    return [MarkEvictable(inst.key, True)]


def _publish(inst: Any, payload: Any) -> None:
    inst.ctx.published = True


def _released(inst: Any, reason: str) -> list[object]:
    ctx = inst.ctx
    effects: list[object] = [ReleaseBlocks(inst.key, ctx.blocks)]
    if ctx.published and not ctx.consumed:
        effects.append(EncodingEvicted(inst.key, reason))
    return effects


def _evicted(inst: Any, payload: Any) -> list[object]:
    return _released(inst, "evicted")


def _discarded(inst: Any, payload: Any) -> list[object]:
    return _released(inst, "discarded")


EC_CACHE_ENTRY = Declaration(
    name=ENTRY_KIND,
    description=(
        "Embedding-cache entry keyed by mm_hash (R-E04): allocated (bytes not there yet) "
        "-> ready -> pinned (counted) -> ready -> evicted, FIFO among ready and unpinned "
        "entries. Evicting or discarding a published, unconsumed encoding emits "
        "EncodingEvicted (B-01)."
    ),
    states=[
        "allocated",
        "ready",
        "pinned",
        {"name": "evicted", "final": True},
    ],
    initial="allocated",
    transitions=[
        {"trigger": "saved", "source": "allocated", "dest": "ready", "after": "became_ready"},
        {"trigger": "discard", "source": "allocated", "dest": "evicted", "after": "discarded"},
        {"trigger": "pin", "source": "ready", "dest": "pinned", "after": "first_pin"},
        {"trigger": "pin", "source": "pinned", "dest": None, "after": "add_pin"},
        {
            "trigger": "unpin",
            "source": "pinned",
            "dest": "ready",
            "conditions": "last_pin",
            "after": "last_unpin",
        },
        {"trigger": "unpin", "source": "pinned", "dest": None, "after": "drop_pin"},
        {"trigger": "evict", "source": "ready", "dest": "evicted", "after": "evicted"},
        {
            "trigger": "publish",
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
    context=EntryCtx,
)
