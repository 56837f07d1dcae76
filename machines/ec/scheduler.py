"""Scheduler half of the CPU encoder-cache connector (R-E04..R-E08, R-E13, B-01, B-05).

A thin API over the machines on the scheduler's bus: `ec.cache_entry` (always),
`ec.request` (consumer roles), and, with `ec_enable_nixl`, `ec.consumer_read` and
`ec.producer_grant` from the lazily imported P2P module. It reserves blocks, creates
instances and delivers events; every state change happens in a machine.

Roles (`ECTransferConfig.ec_role`): `ec_producer` saves encoder outputs to the tier and,
with P2P, serves them; `ec_consumer` loads from the tier and, with P2P, pulls from
producers; `ec_both` does both. A producer alone runs encoder-only (R-E13).

Effects for adapters appear on `bus` (register handlers with `bus.handle`) or in
`drain_effects()`: `SendXferReq`, `IssueRead`, `SendXferDone`, `SendXferAck`, and for an
orchestrator `EncodingEvicted` (B-01). Requests failed on the scheduler side (B-05) are
collected as `FailRequest`s in `take_failed_requests()`.

Time is an argument: every entry point that may change state takes `now` (the engine's
clock, read by its caller); nothing here reads a clock. The bus fires every timeout due
at `now` before it applies anything, and an entry point that looks at the machines
before it acts gives the bus the time first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvhandoff.machines.ec.cache import EmbeddingCache, EvictionObserver
from kvhandoff.machines.ec.events import Discard, Pin, Publish, Saved, Unpin
from kvhandoff.machines.ec.meta import CopyItem, ECConnectorMeta, ECRequest, ECWorkerMeta
from kvhandoff.machines.ec.nixl_gate import require_nixl
from kvhandoff.machines.ec.request import (
    EC_REQUEST,
    Available,
    EncodingLost,
    FailRequest,
    FallBack,
    Finished,
    Hold,
    Load,
    RequestCtx,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.ec_publication import (
    PublishedEncoding,
    parse_ec_transfer_params,
    publish_entry,
    unservable_entry,
)
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

if TYPE_CHECKING:
    from kvhandoff.machines.ec.p2p import P2PConsumer, P2PProducer

__all__ = ["ECScheduler"]

Published = dict[str, PublishedEncoding | None]


class ECScheduler:
    """The scheduler half of one engine instance (one DP rank)."""

    def __init__(
        self,
        config: ECTransferConfig,
        layout: ECLayout,
        *,
        compat_hash: str = "",
        env: Mapping[str, str] | None = None,
        machine_config: Mapping[str, float] | None = None,
        eviction_observer: EvictionObserver | None = None,
    ) -> None:
        """`compat_hash`: this engine's `compatibility_hash` (R-E10), needed with P2P.
        `machine_config` overrides machine config keys (e.g.
        `consumer_max_not_ready_retries`); the timeouts come from the extra config."""
        self.config = config
        self.extra = config.extra_config(env)
        if self.extra.ec_cpu_bytes != layout.ec_cpu_bytes:
            raise LocalProtocolError(
                f"layout is for ec_cpu_bytes={layout.ec_cpu_bytes}, the extra config says "
                f"{self.extra.ec_cpu_bytes}"
            )
        self.layout = layout
        self.bus = EventBus()
        self.cache = EmbeddingCache(self.bus, layout.num_blocks, observer=eviction_observer)
        self.failed_requests: list[FailRequest] = []
        self.bad_params = 0
        self._saves: list[CopyItem] = []
        self._loads: list[CopyItem] = []
        self._loading: dict[str, list[str]] = {}
        self._waiters: dict[str, set[str]] = {}
        self._params: dict[str, tuple[Published, str]] = {}
        self.bus.handle(FailRequest, lambda inst, effect: self.failed_requests.append(effect))
        if config.is_consumer:
            self.bus.register(EC_REQUEST)
        self.consumer: P2PConsumer | None = None
        self.producer: P2PProducer | None = None
        if self.extra.ec_enable_nixl:
            self._start_p2p(compat_hash, machine_config or {})

    def _start_p2p(self, compat_hash: str, overrides: Mapping[str, float]) -> None:
        require_nixl()
        if not compat_hash:
            raise LocalProtocolError("ec_enable_nixl needs this engine's compat_hash (R-E10)")
        from kvhandoff.machines.ec import p2p as ec_p2p  # P2P only: loads msgspec (R-E02)

        extra = self.extra
        timeouts = {
            "consumer_ack_timeout_s": extra.consumer_ack_timeout_s,
            "nixl_read_timeout_s": extra.nixl_read_timeout_s,
            "read_quarantine_s": extra.read_quarantine_s,
            "pin_lease_s": extra.pin_lease_s,
        }
        config = timeouts | dict(overrides)
        if self.config.is_consumer:
            self.consumer = ec_p2p.P2PConsumer(
                self.bus,
                self.cache,
                self.layout,
                engine_id=self.config.engine_id,
                compat_hash=compat_hash,
                on_fallback=self._read_fell_back,
                on_retired=self._read_retired,
                config={k: v for k, v in config.items() if k != "pin_lease_s"},
            )
        if self.config.is_producer:
            self.producer = ec_p2p.P2PProducer(
                self.bus,
                self.cache,
                self.layout,
                compat_hash=compat_hash,
                config={"pin_lease_s": config["pin_lease_s"]},
            )

    # -- facts -----------------------------------------------------------------------------

    @property
    def is_mm_encoder_only(self) -> bool:
        """True for `ec_producer` alone: the engine skips the language model (R-E13)."""
        return self.config.encoder_only

    def has_cache_item(self, mm_hash: str) -> bool:
        """True when this consumer can load `mm_hash` from the tier instead of encoding
        (as of the last time given)."""
        return self.config.is_consumer and self.cache.is_loadable(mm_hash)

    def poll(self, now: float) -> int:
        """Fire timeouts due at `now` (ack, read, quarantine, pin lease); the number fired."""
        return self.bus.fire_due(now)

    # -- consumer: availability ----------------------------------------------------------

    def _request(self, request: ECRequest, now: float) -> Instance[RequestCtx]:
        inst = self.bus.get(EC_REQUEST, request.request_id)
        if inst is None:
            ctx = RequestCtx(request.request_id, metadata_only=frozenset(request.metadata_only))
            inst = self.bus.create(EC_REQUEST, ctx, now)
        return inst

    def _published(self, request: ECRequest) -> tuple[Published, str]:
        cached = self._params.get(request.request_id)
        if cached is None:
            try:
                cached = (parse_ec_transfer_params(request.ec_transfer_params), "")
            except RemoteProtocolError as exc:
                self.bad_params += 1
                cached = ({}, f"malformed ec_transfer_params: {exc}")
            self._params[request.request_id] = cached
        return cached

    def ensure_cache_available(self, request: ECRequest, now: float) -> bool:
        """May `request` be scheduled now? False defers it (a read is in flight) or means
        it failed (then it is in `take_failed_requests()`, B-05)."""
        self.bus.advance(now)
        if not self.config.is_consumer:
            return True
        inst = self._request(request, now)
        if not inst.has("unsettled"):
            return inst.has("schedulable")
        published, params_error = self._published(request)
        rid = request.request_id
        waiting = False
        for mm_hash in dict.fromkeys(request.mm_hashes):
            ctx = inst.ctx
            if mm_hash in ctx.held or mm_hash in ctx.local:
                continue
            wait, reason = self._settle(rid, mm_hash, published, params_error, now)
            waiting = waiting or wait
            if reason:
                self.bus.dispatch(EC_REQUEST, rid, FallBack(mm_hash, reason), now)
            if not inst.has("unsettled"):  # failed, possibly from inside a read's fallback
                return False
        if waiting:
            return False
        self.bus.dispatch(EC_REQUEST, rid, Available(), now)
        return True

    def _settle(
        self, rid: str, mm_hash: str, published: Published, params_error: str, now: float
    ) -> tuple[bool, str]:
        """(wait, reason): wait for it, hold it (neither), or encode it locally (reason)."""
        cache = self.cache
        if cache.is_loadable(mm_hash):
            self.bus.dispatch(EC_REQUEST, rid, Hold(mm_hash), now)
            return False, ""
        consumer = self.consumer
        if consumer is not None and consumer.in_flight(mm_hash):
            self._waiters.setdefault(mm_hash, set()).add(rid)
            return True, ""
        entry = cache.entry(mm_hash)
        if entry is not None and entry.has("awaiting_bytes"):
            if entry.ctx.origin == "save":
                return True, ""  # our own save lands within a step or two
            return False, "destination quarantined"
        encoding = published.get(mm_hash)
        if consumer is None and encoding is not None:
            return False, "published, but P2P is off (ec_enable_nixl)"
        if consumer is not None and encoding is not None:
            self._waiters.setdefault(mm_hash, set()).add(rid)
            if consumer.start_read(mm_hash, encoding, now):
                if consumer.in_flight(mm_hash):
                    return True, ""
                return False, ""  # settled synchronously through the fallback hook
            self._waiters[mm_hash].discard(rid)
            return False, "no room in the CPU tier for the read destination"
        if params_error:
            return False, params_error
        if mm_hash in published:
            return False, "published as unservable"
        return False, "not cached and not published"

    def _read_fell_back(self, mm_hash: str, reason: str) -> None:
        """A read's `FallBackLocal` (inside the bus's step: its time is the bus's)."""
        for rid in sorted(self._waiters.pop(mm_hash, ())):
            inst = self.bus.get(EC_REQUEST, rid)
            if inst is not None and inst.has("unsettled") and mm_hash not in inst.ctx.local:
                self.bus.dispatch(EC_REQUEST, rid, FallBack(mm_hash, reason), self.bus.now)

    def _read_retired(self, mm_hash: str, landed: bool) -> None:
        waiters = self._waiters.pop(mm_hash, ())
        if not landed or not self.cache.is_loadable(mm_hash):
            return
        for rid in sorted(waiters):  # hold it at once: no eviction before they come back
            request = self.bus.get(EC_REQUEST, rid)
            if request is not None and request.has("unsettled"):
                self.bus.dispatch(EC_REQUEST, rid, Hold(mm_hash), self.bus.now)

    # -- allocation and the step -----------------------------------------------------------

    def update_state_after_alloc(
        self, request: ECRequest, mm_hash: str, num_tokens: int, now: float
    ) -> None:
        """The engine allocated encoder cache for `mm_hash` of `request` (`num_tokens`
        rows): load it from the tier (consumer) or plan its save (producer)."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise LocalProtocolError(f"num_tokens must be a positive int, got {num_tokens!r}")
        self.bus.advance(now)
        cache = self.cache
        if self.has_cache_item(mm_hash):
            rid = request.request_id
            inst = self.bus.get(EC_REQUEST, rid)
            if inst is not None and inst.has("schedulable") and mm_hash in inst.ctx.held:
                self.bus.dispatch(EC_REQUEST, rid, Load(mm_hash), now)
            else:
                cache.deliver(mm_hash, Pin(), now)
            entry = cache.entry(mm_hash)
            assert entry is not None
            self._loads.append(CopyItem(mm_hash, entry.ctx.blocks, num_tokens))
            self._loading.setdefault(mm_hash, []).append(rid)
            return
        if self.config.is_producer and cache.entry(mm_hash) is None:
            size = num_tokens * self.layout.block_size_bytes
            entry = cache.reserve(mm_hash, num_tokens, size, "save", now)
            if entry is not None:
                self._saves.append(CopyItem(mm_hash, entry.ctx.blocks, num_tokens))

    def build_connector_meta(self, now: float) -> ECConnectorMeta:
        """Once per step: fire timeouts, re-ask deferred reads, hand over loads and saves."""
        self.bus.advance(now)
        if self.consumer is not None:
            self.consumer.step(now)
        meta = ECConnectorMeta(tuple(self._loads), tuple(self._saves))
        self._loads, self._saves = [], []
        return meta

    def update_connector_output(self, output: ECWorkerMeta | None, now: float) -> None:
        """Apply the worker's report (R-E05): saved entries become ready, loaded ones are
        unpinned; failed saves are discarded; failed loads fail their requests (B-05)."""
        if output is None:
            return
        cache = self.cache
        for mm_hash in output.saved:
            cache.deliver(mm_hash, Saved(), now)
        for mm_hash in output.failed_saves:
            cache.deliver(mm_hash, Discard(), now)
        for mm_hash in output.loaded:
            self._load_finished(mm_hash)
            cache.deliver(mm_hash, Unpin(), now)
        for mm_hash in output.failed_loads:
            rid = self._load_finished(mm_hash)
            cache.deliver(mm_hash, Unpin(), now)
            inst = None if rid is None else self.bus.get(EC_REQUEST, rid)
            if inst is not None and not inst.has("failed_cleanly"):
                self.bus.dispatch(EC_REQUEST, inst.key, EncodingLost(mm_hash), now)

    def _load_finished(self, mm_hash: str) -> str | None:
        rids = self._loading.get(mm_hash)
        if not rids:
            return None
        rid = rids.pop(0)
        if not rids:
            del self._loading[mm_hash]
        return rid

    # -- end of a request ----------------------------------------------------------------

    def request_finished(self, request: ECRequest, now: float) -> dict[str, dict[str, Any]]:
        """Release the request; on a P2P producer return its `ec_transfer_params`: per
        `mm_hash`, metadata and address of a resident encoding, or empty metadata and no
        address when it cannot be served (R-E06)."""
        self.bus.advance(now)
        rid = request.request_id
        if self.bus.get(EC_REQUEST, rid) is not None:
            self.bus.dispatch(EC_REQUEST, rid, Finished(), now)
        self._params.pop(rid, None)
        for waiters in self._waiters.values():
            waiters.discard(rid)
        if self.producer is None:
            return {}
        params: dict[str, dict[str, Any]] = {}
        for mm_hash in dict.fromkeys(request.mm_hashes):
            entry = self.cache.entry(mm_hash)
            metadata = request.mm_metadata.get(mm_hash)
            if entry is None or not metadata:
                params[mm_hash] = unservable_entry()
                continue
            params[mm_hash] = publish_entry(
                metadata,
                self.extra.side_channel_host,
                self.extra.side_channel_port,
                entry.ctx.size_bytes,
            )
            self.cache.deliver(mm_hash, Publish(), now)
        return params

    def take_failed_requests(self) -> list[FailRequest]:
        """Requests failed on the scheduler side since the last call (B-05)."""
        failed, self.failed_requests = self.failed_requests, []
        return failed

    # -- P2P adapter events ----------------------------------------------------------------
    #
    # A message or completion that waited (a stalled process, a slow link) meets machines
    # in the state `now` decides, never one their deadlines would have left by then (an OK
    # ack arriving after the ack timeout, for a grant whose lease may be over, starts no
    # READ). Bad input raises `RemoteProtocolError` (counted) and changes nothing.

    def _need_consumer(self) -> P2PConsumer:
        if self.consumer is None:
            raise LocalProtocolError("this scheduler is not a P2P consumer (ec_enable_nixl)")
        return self.consumer

    def _need_producer(self) -> P2PProducer:
        if self.producer is None:
            raise LocalProtocolError("this scheduler is not a P2P producer (ec_enable_nixl)")
        return self.producer

    def on_xfer_ack(self, data: bytes, now: float, *, peer: str | None = None) -> None:
        """ZMQ: an `XferAck` arrived."""
        self._need_consumer().on_xfer_ack(data, now, peer=peer)

    def on_read_done(self, mm_hash: str, transfer_id: str, now: float) -> None:
        """NIXL: the READ of `transfer_id` completed."""
        self._need_consumer().on_read_done(mm_hash, transfer_id, now)

    def on_read_failed(self, mm_hash: str, transfer_id: str, now: float) -> None:
        """NIXL: the READ of `transfer_id` failed."""
        self._need_consumer().on_read_failed(mm_hash, transfer_id, now)

    def on_peer_disconnected(self, peer_host: str, peer_port: int, now: float) -> None:
        """ZMQ: the DEALER to producer `peer_host:peer_port` lost its peer."""
        self._need_consumer().on_peer_disconnected(peer_host, peer_port, now)

    def on_consumer_disconnected(self, peer: bytes | str, now: float) -> None:
        """ZMQ: consumer identity `peer` left the ROUTER (its grants keep their lease)."""
        self._need_producer().on_peer_disconnected(peer, now)

    def on_producer_message(self, peer: bytes | str, data: bytes, now: float) -> None:
        """ZMQ: an `XferReq`/`XferDone` arrived on the ROUTER from identity `peer`."""
        self._need_producer().on_message(peer, data, now)

    def register_nixl_agent(self, agent_name: str, agent_metadata: bytes, base_addr: int) -> None:
        """NIXL: the producer's agent registered the region at `base_addr`."""
        self._need_producer().register_nixl_agent(agent_name, agent_metadata, base_addr)

    def drain_effects(self) -> list[object]:
        """Effects no handler took, in emission order."""
        return [effect for _, effect in self.bus.drain_outbox()]

    def counters(self) -> dict[str, int]:
        """Counts of rejected input and P2P anomalies."""
        out = {"bad_params": self.bad_params, "evictions": self.cache.evictions}
        if self.consumer is not None:
            out["consumer_remote_errors"] = self.consumer.remote_errors
            out["stale_acks"] = self.consumer.stale_acks
            out["late_completions"] = self.consumer.late_completions
        if self.producer is not None:
            out["producer_remote_errors"] = self.producer.remote_errors
        return out
