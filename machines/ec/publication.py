"""A P2P producer's publication (R-E06, B-01): the `ec_transfer_params` of a finished
request, and the hold that keeps each published encoding until a consumer read it.

`Publisher.publish(request, now)` returns, per `mm_hash`, the metadata and address of a
resident encoding (with vLLM 0.33's keys too, C-03), or empty metadata and no address
when it cannot be served, and marks the entry published. Each published entry is then
held (`ec.publication_hold`): pinned until its first completed READ or for
`producer_publish_pin_s` at most. An entry published before its save landed is held
once its bytes are there (`after_reports`). Holds are bounded: at most
`producer_max_publish_pins` at once, pinning at most half of the tier's blocks (the
other half stays evictable for new saves and READ destinations); a publication past
either bound is published unheld and counted (`publications_unheld`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvhandoff.machines.ec.cache import EmbeddingCache
from kvhandoff.machines.ec.cache_entry import EntryConsumed
from kvhandoff.machines.ec.events import Publish
from kvhandoff.machines.ec.meta import ECRequest
from kvhandoff.machines.ec.publication_hold import (
    EC_PUBLICATION_HOLD,
    Consumed,
    Hold,
    HoldCtx,
    HoldReleased,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_config import ECExtraConfig, ECLayout
from kvhandoff.protocol.ec_publication import publish_entry, unservable_entry

__all__ = ["Publisher"]


class Publisher:
    """Publication and its holds, on one producer scheduler's bus."""

    def __init__(
        self,
        bus: EventBus,
        cache: EmbeddingCache,
        layout: ECLayout,
        extra: ECExtraConfig,
        overrides: Mapping[str, float],
    ) -> None:
        self.bus, self.cache, self.layout, self.extra = bus, cache, layout, extra
        config = {"producer_publish_pin_s": extra.producer_publish_pin_s} | dict(overrides)
        machine = bus.register(EC_PUBLICATION_HOLD, config)
        self.max_holds = int(machine.config["producer_max_publish_pins"])
        self.max_held_blocks = layout.num_blocks // 2
        self.held_blocks = 0
        self.publications_unheld = 0
        """Published encodings not held: a bound was reached."""
        self._awaiting_bytes: dict[str, None] = {}
        """Published while their save was in flight: held once it lands."""
        bus.handle(EntryConsumed, self._consumed)
        bus.handle(HoldReleased, self._released)

    def publish(self, request: ECRequest, now: float) -> dict[str, dict[str, Any]]:
        params: dict[str, dict[str, Any]] = {}
        # vLLM 0.33's keys too (C-03): where each mm_hash sits, its modality when the
        # request says it, and the shape a stock vLLM consumer reads an entry by.
        indices: dict[str, list[int]] = {}
        for index, mm_hash in enumerate(request.mm_hashes):
            indices.setdefault(mm_hash, []).append(index)
        modalities = tuple(getattr(request, "mm_modalities", ()) or ())
        for mm_hash, where in indices.items():
            entry = self.cache.entry(mm_hash)
            metadata = request.mm_metadata.get(mm_hash)
            modality = modalities[where[0]] if where[0] < len(modalities) else ""
            if entry is None or not metadata:
                params[mm_hash] = unservable_entry(modality=modality, item_indices=tuple(where))
                continue
            size = entry.ctx.size_bytes
            rows = -(-size // self.layout.block_size_bytes)
            params[mm_hash] = publish_entry(
                metadata,
                self.extra.side_channel_host,
                self.extra.side_channel_port,
                size,
                modality=modality,
                item_indices=tuple(where),
                shape=(rows, self.layout.hidden_dim),
            )
            self.cache.deliver(mm_hash, Publish(), now)
            self._hold(mm_hash, now)
        return params

    def after_reports(self, now: float) -> None:
        """Hold the published entries whose save landed since (or forget those lost)."""
        for mm_hash in list(self._awaiting_bytes):
            if not self.cache.has(mm_hash, "awaiting_bytes"):
                del self._awaiting_bytes[mm_hash]
                self._hold(mm_hash, now)

    def _hold(self, mm_hash: str, now: float) -> None:
        bus, cache = self.bus, self.cache
        entry = cache.entry(mm_hash)
        if entry is None or bus.get(EC_PUBLICATION_HOLD, mm_hash) is not None:
            return
        if entry.has("awaiting_bytes"):
            if len(self._awaiting_bytes) < self.max_holds:
                self._awaiting_bytes[mm_hash] = None
            else:
                self.publications_unheld += 1
            return
        blocks = len(entry.ctx.blocks)
        if entry.ctx.consumed or not entry.has("loadable"):
            return
        if (
            bus.live(EC_PUBLICATION_HOLD) >= self.max_holds
            or self.held_blocks + blocks > self.max_held_blocks
        ):
            self.publications_unheld += 1
            return
        bus.create(EC_PUBLICATION_HOLD, HoldCtx(mm_hash, blocks), now)
        self.held_blocks += blocks
        bus.dispatch(EC_PUBLICATION_HOLD, mm_hash, Hold(), now)

    def _released(self, inst: Instance[Any] | None, effect: HoldReleased) -> None:
        self.held_blocks -= effect.blocks

    def _consumed(self, inst: Instance[Any] | None, effect: EntryConsumed) -> None:
        hold = self.bus.get(EC_PUBLICATION_HOLD, effect.mm_hash)
        if hold is not None and hold.has("holding"):
            self.bus.dispatch(EC_PUBLICATION_HOLD, effect.mm_hash, Consumed(), self.bus.now)

    def holds(self) -> int:
        """Publication holds alive (pinning their entry)."""
        return self.bus.live(EC_PUBLICATION_HOLD)

    def holding(self, mm_hash: str) -> bool:
        """Whether `mm_hash` is pinned by its publication hold (or waits for its bytes to
        be)."""
        return mm_hash in self._awaiting_bytes or self.bus.has_tag(
            EC_PUBLICATION_HOLD, mm_hash, "holding"
        )
