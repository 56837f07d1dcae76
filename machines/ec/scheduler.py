"""Scheduler half of the CPU encoder-cache connector (R-E04..R-E08, R-E13, R-T02, R-T06, B-05).

A thin API over the machines on the scheduler's bus: `ec.cache_entry` and
`ec.transfer` (always), `ec.request` and `ec.settlement` (consumer roles), and, with
`ec_enable_nixl`, `ec.consumer_read` and `ec.producer_grant` from the lazily imported
P2P module. It gathers facts, reserves blocks, creates instances and delivers events;
every decision and every state change happens in a machine. It shares no object with the
worker halves (R-T01): `build_connector_meta` hands down an `ECConnectorMeta`, and
`update_connector_output` takes the ranks' reports back (`ECWorkerMeta`), validated as a
whole before any of it is applied (R-T02).

The calls carry vLLM 0.33's `ECConnectorBase` names, each with the time as its last
argument: `has_cache_item(identifier)`, `ensure_cache_available(request,
num_computed_tokens, now)`, `update_state_after_alloc(request, index, now)`,
`build_connector_meta(now)`, `update_connector_output(output, now)`,
`request_finished(request, now)`, `take_unavailable_requests()`;
`adapters.ec_connector.ECConnector` offers them with vLLM's exact signatures.

Roles (`ECTransferConfig.ec_role`): `ec_producer` saves encoder outputs to the tier and,
with P2P, serves them; `ec_consumer` loads from the tier and, with P2P, pulls from
producers; `ec_both` does both. A producer alone runs encoder-only (R-E13).

Effects for adapters appear on `bus` (register handlers with `bus.handle`) or in
`drain_effects()`: `SendXferReq`, `IssueRead`, `ReleaseRead`, `SendXferDone`,
`SendXferAck`, and for an orchestrator `EncodingEvicted` (B-01). Requests failed on the
scheduler side (B-05) come back from `take_unavailable_requests()` (ids, vLLM's call) or
`take_failed_requests()` (with their reasons).

Time is an argument: every entry point that may change state takes `now` (the engine's
clock, read by its caller); nothing here reads a clock. The bus fires every timeout due
at `now` before it applies anything, and an entry point that looks at the machines
before it acts gives the bus the time first. After `shutdown` nothing is cached any
more and every call raises `LocalProtocolError`.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from kvhandoff.machines.ec.cache import EmbeddingCache, EvictionObserver
from kvhandoff.machines.ec.events import Pin
from kvhandoff.machines.ec.meta import (
    CopyItem,
    ECConnectorMeta,
    ECRequest,
    ECWorkerMeta,
    computed_inputs,
    input_of,
    tokens_by_hash,
)
from kvhandoff.machines.ec.nixl_gate import require_nixl
from kvhandoff.machines.ec.notices import EC_REQUEST_FAILURE, FailureCtx, take_notices
from kvhandoff.machines.ec.publication import Publisher
from kvhandoff.machines.ec.reports import plan_reports
from kvhandoff.machines.ec.request import (
    EC_REQUEST,
    Available,
    EncodingLost,
    FailRequest,
    Finished,
    ReleaseSettlements,
    RequestCtx,
)
from kvhandoff.machines.ec.scheduler_p2p import P2PAdapterEvents
from kvhandoff.machines.ec.settlement import (
    EC_SETTLEMENT,
    Consider,
    Load,
    Release,
    SettlementCtx,
)
from kvhandoff.machines.ec.transfer import EC_TRANSFER, Dispatch, LoadLost, TransferCtx
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.ec_publication import PublishedEncoding, parse_ec_transfer_params
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

if TYPE_CHECKING:
    from kvhandoff.machines.ec.p2p import P2PConsumer, P2PProducer, TransferIds

__all__ = ["ECScheduler"]

log = logging.getLogger("kvhandoff.ec.scheduler")


class ECScheduler(P2PAdapterEvents):
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
        tp_size: int = 1,
        pcp_size: int = 1,
        transfer_ids: TransferIds | None = None,
    ) -> None:
        """`compat_hash`: this engine's `compatibility_hash` (R-E10), needed with P2P.
        `machine_config` overrides machine config keys (e.g.
        `consumer_max_not_ready_retries`); the timeouts come from the extra config.
        `tp_size` x `pcp_size` worker ranks report each load (R-T02). `transfer_ids`
        draws the id of each `XferReq` (random 128 bits by default, S-02)."""
        self.config = config
        self.extra = config.extra_config(env)
        if self.extra.ec_cpu_bytes != layout.ec_cpu_bytes:
            raise LocalProtocolError(
                f"layout is for ec_cpu_bytes={layout.ec_cpu_bytes}, the extra config says "
                f"{self.extra.ec_cpu_bytes}"
            )
        for name, size in (("tp_size", tp_size), ("pcp_size", pcp_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise LocalProtocolError(f"{name} must be a positive int, got {size!r}")
        self.layout = layout
        self.tp_size, self.pcp_size = tp_size, pcp_size
        self.ranks = frozenset(range(tp_size * pcp_size))
        """Every worker rank (`pcp_rank * tp_size + tp_rank`): each loads (R-T02)."""
        self.writer_ranks = frozenset({0})
        """The rank that saves: TP 0 / PCP 0 (R-E03)."""
        self.bus = EventBus()
        self.cache = EmbeddingCache(self.bus, layout.num_blocks, observer=eviction_observer)
        self.bus.register(EC_TRANSFER)
        self.bus.register(EC_REQUEST_FAILURE)
        self._failure_serials = itertools.count(1)
        self.rejections = RejectionLog(log, what="worker report")
        self.report_counts = {"stale": 0, "duplicate": 0, "misdirected": 0, "refused": 0}
        self.bad_params = 0
        self.loads_shared = 0
        """Allocations served by a load of the same `mm_hash` already staged this step."""
        self.closed = False
        self._transfer_serials = itertools.count(1)
        self.bus.handle(FailRequest, self._request_failed)
        self.bus.handle(LoadLost, self._load_lost)
        if config.is_consumer:
            self.bus.register(EC_REQUEST)
            self.bus.register(EC_SETTLEMENT)
            self.bus.handle(ReleaseSettlements, self._release_settlements)
        self.consumer: P2PConsumer | None = None
        self.producer: P2PProducer | None = None
        self.publisher: Publisher | None = None
        if self.extra.ec_enable_nixl:
            self._start_p2p(compat_hash, machine_config or {}, transfer_ids)

    def _start_p2p(
        self, compat_hash: str, overrides: Mapping[str, float], ids: TransferIds | None
    ) -> None:
        require_nixl()
        if not compat_hash:
            raise LocalProtocolError("ec_enable_nixl needs this engine's compat_hash (R-E10)")
        from kvhandoff.machines.ec import p2p as ec_p2p  # P2P only: loads msgspec (R-E02)

        extra = self.extra
        consumer_keys = {
            "consumer_ack_timeout_s": extra.consumer_ack_timeout_s,
            "nixl_read_timeout_s": extra.nixl_read_timeout_s,
            "read_quarantine_s": extra.read_quarantine_s,
            "consumer_not_ready_timeout_s": extra.consumer_not_ready_timeout_s,
        }
        producer_keys = {"pin_lease_s": extra.pin_lease_s}
        if self.config.is_consumer:
            self.consumer = ec_p2p.P2PConsumer(
                self.bus,
                self.cache,
                self.layout,
                engine_id=self.config.engine_id,
                compat_hash=compat_hash,
                config=consumer_keys | dict(overrides),
                transfer_ids=ids or ec_p2p.random_transfer_id,
            )
        if self.config.is_producer:
            self.publisher = Publisher(self.bus, self.cache, self.layout, extra, overrides)
            self.producer = ec_p2p.P2PProducer(
                self.bus,
                self.cache,
                self.layout,
                compat_hash=compat_hash,
                config=producer_keys | dict(overrides),
            )

    def _open(self, call: str) -> None:
        if self.closed:
            raise LocalProtocolError(f"ECScheduler.{call}: the connector was shut down")

    # -- facts -----------------------------------------------------------------------------

    @property
    def is_mm_encoder_only(self) -> bool:
        """True for `ec_producer` alone: the engine skips the language model (R-E13)."""
        return self.config.encoder_only

    def has_cache_item(self, identifier: str) -> bool:
        """True when this consumer can load `identifier` (an `mm_hash`) from the tier
        instead of encoding it (as of the last time given); never after `shutdown`."""
        return not self.closed and self.config.is_consumer and self.cache.is_loadable(identifier)

    def poll(self, now: float) -> int:
        """Fire timeouts due at `now` (ack, read, quarantine, pin lease); the number fired."""
        self._open("poll")
        return self.bus.fire_due(now)

    def has_pending_work(self) -> bool:
        """Whether the engine must keep stepping for this connector (vLLM 0.33's
        `has_pending_push_work`): while a save or a load is unconfirmed or an entry is held
        (R-E05), while a P2P read is in flight, and always on a P2P producer, whose work
        (`XferReq`s, READ notifs, pin leases) arrives from peers between requests."""
        self._open("has_pending_work")
        if self.producer is not None or self.cache.has_held():
            return True
        consumer = self.consumer
        return consumer is not None and consumer.has_reads()

    def local_reason(self, request_id: str, mm_hash: str) -> str:
        """Why `mm_hash` of a live request is encoded locally ("" if it is not)."""
        inst = self.bus.get(EC_REQUEST, request_id)
        return "" if inst is None else inst.ctx.local.get(mm_hash, "")

    def failure_reason(self, request_id: str) -> str:
        """Why a live request failed cleanly ("" if it did not, B-05)."""
        inst = self.bus.get(EC_REQUEST, request_id)
        return "" if inst is None else inst.ctx.failure

    # -- consumer: availability ----------------------------------------------------------

    def _new_request(self, request: ECRequest, now: float) -> Instance[RequestCtx]:
        published: dict[str, PublishedEncoding | None] = {}
        error = ""
        try:
            published = parse_ec_transfer_params(request.ec_transfer_params)
        except RemoteProtocolError as exc:
            self.bad_params += 1
            error = f"malformed ec_transfer_params: {exc}"
        ctx = RequestCtx(
            request.request_id,
            mm_hashes=tuple(dict.fromkeys(request.mm_hashes)),
            metadata_only=frozenset(request.metadata_only),
            published=published,
            params_error=error,
        )
        return self.bus.create(EC_REQUEST, ctx, now)

    def ensure_cache_available(
        self, request: ECRequest, num_computed_tokens: int, now: float
    ) -> bool:
        """May `request` be scheduled now? False defers it (a read or a save is in flight)
        or means it failed (then it comes back from `take_unavailable_requests`, B-05).
        Each encoding is settled by its `ec.settlement` machine."""
        self._open("ensure_cache_available")
        self.bus.advance(now)
        if not self.config.is_consumer:
            return True
        bus, rid = self.bus, request.request_id
        inst = bus.get(EC_REQUEST, rid) or self._new_request(request, now)
        if not inst.has("unsettled"):
            return inst.has("schedulable")
        tokens = tokens_by_hash(request)
        computed = computed_inputs(request, num_computed_tokens)
        for mm_hash in inst.ctx.mm_hashes:
            key = (rid, mm_hash)
            item = bus.get(EC_SETTLEMENT, key)
            if item is None:
                item = bus.create(EC_SETTLEMENT, SettlementCtx(key), now)
            elif not item.has("unsettled"):
                continue
            if mm_hash in computed:  # vLLM 0.33: nothing to read for what is computed
                consider = Consider(computed=True)
            else:
                consider = self._consider(inst.ctx, mm_hash, tokens.get(mm_hash, 0))
            bus.dispatch(EC_SETTLEMENT, key, consider, now)
            if not inst.has("unsettled"):  # failed: an encoding it had no media for is lost
                return False
        bus.dispatch(EC_REQUEST, rid, Available(), now)
        return inst.has("schedulable")

    def _consider(self, ctx: RequestCtx, mm_hash: str, tokens: int) -> Consider:
        """What the settlement of `mm_hash` decides on: the facts as of now."""
        entry = self.cache.entry(mm_hash)
        consumer = self.consumer
        in_flight = consumer is not None and consumer.in_flight(mm_hash)
        awaiting = entry is not None and entry.has("awaiting_bytes")
        own_save = awaiting and entry is not None and entry.ctx.origin == "save"
        published = ctx.published.get(mm_hash)
        return Consider(
            loadable=entry is not None and entry.has("loadable"),
            read_in_flight=in_flight,
            own_save_pending=own_save,
            quarantined=awaiting and not own_save and not in_flight,
            size_problem="" if published is None else self._size_problem(published, tokens),
            published=published,
            p2p=consumer is not None,
            unservable=mm_hash in ctx.published and published is None,
            params_error=ctx.params_error,
        )

    def _size_problem(self, published: PublishedEncoding, tokens: int) -> str:
        """S-04: the announced size must be what the request's own token count takes in
        this layout; checked before any reservation or eviction."""
        expected = tokens * self.layout.block_size_bytes
        if tokens < 1:
            return "announced size_bytes cannot be checked: the request names no token count"
        if published.size_bytes != expected:
            return (
                f"announced size_bytes {published.size_bytes} is not {tokens} tokens of "
                f"{self.layout.block_size_bytes} bytes"
            )
        return ""

    def _release_settlements(self, inst: Instance[Any] | None, effect: ReleaseSettlements) -> None:
        bus = self.bus
        for mm_hash in effect.mm_hashes:
            key = (effect.request_id, mm_hash)
            if bus.get(EC_SETTLEMENT, key) is not None:
                bus.dispatch(EC_SETTLEMENT, key, Release(), bus.now)

    # -- allocation and the step -----------------------------------------------------------

    def update_state_after_alloc(self, request: ECRequest, index: int, now: float) -> None:
        """The engine allocated encoder cache for input `index` of `request`: plan its
        load from the tier (consumer) or its save (producer), each a new transfer."""
        self._open("update_state_after_alloc")
        mm_hash, tokens = input_of(request, index)
        self.bus.advance(now)
        cache, rid = self.cache, request.request_id
        if self.has_cache_item(mm_hash) and self._load_staged(mm_hash):
            # Asked again in the same step (another request, or the same input twice):
            # one load serves both, as in vLLM 0.33; this request's pin goes back.
            held = self.bus.get(EC_SETTLEMENT, (rid, mm_hash))
            if held is not None and held.has("holds_pin"):
                self.bus.dispatch(EC_SETTLEMENT, held.key, Release(), now)
            self.loads_shared += 1
            return
        if self.has_cache_item(mm_hash):
            transfer_id = next(self._transfer_serials)
            held = self.bus.get(EC_SETTLEMENT, (rid, mm_hash))
            if held is not None and held.has("holds_pin"):
                self.bus.dispatch(EC_SETTLEMENT, held.key, Load(transfer_id), now)
            else:
                cache.deliver(mm_hash, Pin(), now)
            entry = cache.entry(mm_hash)
            assert entry is not None
            self._plan(transfer_id, mm_hash, "load", entry.ctx.blocks, tokens, rid, now)
            return
        if self.config.is_producer and cache.entry(mm_hash) is None:
            size = tokens * self.layout.block_size_bytes
            entry = cache.reserve(mm_hash, tokens, size, "save", now)
            if entry is not None:
                transfer_id = next(self._transfer_serials)
                self._plan(transfer_id, mm_hash, "save", entry.ctx.blocks, tokens, rid, now)

    def _load_staged(self, mm_hash: str) -> bool:
        """Whether a load of `mm_hash` waits for this step's `build_connector_meta`."""
        return any(
            inst.ctx.mm_hash == mm_hash and inst.ctx.direction == "load"
            for inst in self.bus.tagged(EC_TRANSFER, "staged")
        )

    def _plan(
        self,
        transfer_id: int,
        mm_hash: str,
        direction: str,
        blocks: tuple[int, ...],
        tokens: int,
        request_id: str,
        now: float,
    ) -> None:
        ranks = self.writer_ranks if direction == "save" else self.ranks
        ctx = TransferCtx(
            transfer_id,
            mm_hash=mm_hash,
            direction="save" if direction == "save" else "load",
            blocks=blocks,
            num_tokens=tokens,
            request_id=request_id,
            participants=ranks,
            pending=set(ranks),
        )
        self.bus.create(EC_TRANSFER, ctx, now)

    def build_connector_meta(self, now: float) -> ECConnectorMeta:
        """Once per step: fire timeouts, re-ask deferred reads, hand the staged loads and
        saves to the workers, each under its transfer id (R-T06)."""
        self._open("build_connector_meta")
        bus = self.bus
        bus.advance(now)
        if self.consumer is not None:
            self.consumer.step(now)
        loads: list[CopyItem] = []
        saves: list[CopyItem] = []
        for inst in bus.tagged(EC_TRANSFER, "staged"):
            ctx = inst.ctx
            item = CopyItem(ctx.mm_hash, ctx.blocks, ctx.num_tokens, ctx.key)
            (saves if ctx.direction == "save" else loads).append(item)
            bus.dispatch(EC_TRANSFER, ctx.key, Dispatch(), now)
        return ECConnectorMeta(tuple(loads), tuple(saves))

    def update_connector_output(self, output: ECWorkerMeta | object | None, now: float) -> None:
        """Apply the ranks' reports (R-E05): a transfer lands or fails once every rank
        taking part reported it (R-T02, R-T06): saved entries become ready, loaded ones
        are unpinned, failed saves are discarded, failed loads fail their requests
        (B-05). The whole output is validated first; stale, duplicate and misdirected
        items are counted and ignored, a malformed output is refused and logged, and
        nothing is raised into the engine."""
        self._open("update_connector_output")
        if output is None:
            return
        bus = self.bus
        bus.advance(now)
        plan = plan_reports(bus, output, self.tp_size, self.pcp_size)
        counts = self.report_counts
        if plan.refused:
            counts["refused"] += 1
            self.rejections.reject("workers", f"worker report refused: {plan.refused}", now)
            return
        counts["stale"] += plan.stale
        counts["duplicate"] += plan.duplicate
        counts["misdirected"] += plan.misdirected
        if plan.misdirected:
            self.rejections.reject("workers", f"{plan.misdirected} misdirected report(s)", now)
        for transfer_id, event in plan.apply:
            try:
                bus.dispatch(EC_TRANSFER, transfer_id, event, now)
            except RemoteProtocolError as exc:  # ended by an earlier item: never raised
                counts["stale"] += 1
                self.rejections.reject("workers", exc, now)
        if self.publisher is not None:
            self.publisher.after_reports(now)

    def _load_lost(self, inst: Instance[Any] | None, effect: LoadLost) -> None:
        request = self.bus.get(EC_REQUEST, effect.request_id)
        if request is not None and not request.has("failed_cleanly"):
            self.bus.dispatch(EC_REQUEST, request.key, EncodingLost(effect.mm_hash), self.bus.now)

    # -- end of a request ----------------------------------------------------------------

    def request_finished(self, request: ECRequest, now: float) -> dict[str, dict[str, Any]]:
        """Release the request; on a P2P producer return its `ec_transfer_params`: per
        `mm_hash`, metadata and address of a resident encoding, or empty metadata and no
        address when it cannot be served (R-E06)."""
        self._open("request_finished")
        self.bus.advance(now)
        rid = request.request_id
        if self.bus.get(EC_REQUEST, rid) is not None:
            self.bus.dispatch(EC_REQUEST, rid, Finished(), now)
        publisher = self.publisher
        return {} if publisher is None else publisher.publish(request, now)

    def take_unavailable_requests(self) -> set[str]:
        """Ids of the requests failed on the scheduler side since the last call (B-05)."""
        return {failed.request_id for failed in self.take_failed_requests()}

    def take_failed_requests(self) -> list[FailRequest]:
        """The same, with their reasons (use one of the two: both take the same
        `ec.request_failure` notices), oldest first."""
        taken = take_notices(self.bus, EC_REQUEST_FAILURE)
        return [FailRequest(notice.ctx.request_id, notice.ctx.reason) for notice in taken]

    def _request_failed(self, inst: Instance[Any] | None, effect: FailRequest) -> None:
        """A request failed cleanly (B-05): an `ec.request_failure` notice for the engine."""
        ctx = FailureCtx(next(self._failure_serials), effect.request_id, effect.reason)
        self.bus.create(EC_REQUEST_FAILURE, ctx, self.bus.now)

    def shutdown(self) -> None:
        """From now on nothing is cached (`has_cache_item` is False) and every call raises
        `LocalProtocolError`. The adapters close the edges. Idempotent."""
        self.closed = True

    def drain_effects(self) -> list[object]:
        """Effects no handler took, in emission order."""
        return [effect for _, effect in self.bus.drain_outbox()]

    def counters(self) -> dict[str, int]:
        """Counts of rejected input, worker reports and P2P anomalies."""
        out = {"bad_params": self.bad_params, "evictions": self.cache.evictions}
        out.update({f"reports_{name}": n for name, n in self.report_counts.items()})
        if self.consumer is not None:
            out["consumer_remote_errors"] = self.consumer.remote_errors
            out["stale_acks"] = self.consumer.stale_acks
            out["late_completions"] = self.consumer.late_completions
            out["unused_grants_released"] = self.consumer.unused_grants_released
        if self.producer is not None:
            out["producer_remote_errors"] = self.producer.remote_errors
        if self.publisher is not None:
            out["publication_holds"] = self.publisher.holds()
            out["publications_unheld"] = self.publisher.publications_unheld
        return out
