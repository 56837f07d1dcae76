"""Push-mode engine API, scheduler side: one per engine, shaped like the seed's connector
scheduler (R-P02, R-P03, R-P10, R-P13, R-T01, R-T02, R-T05, B-14).

The scheduler owns its bus and shares no object with the worker ranks: it hands each
step's work down in a `PushConnectorMeta` and aggregates the ranks' `PushWorkerOutput`s
into the engine's `PushConnectorOutput`. Time is an argument: every call that changes
state takes `now`.

    sched = PushScheduler("decode", local_engine, config)
    sched.update_state_after_alloc("cmpl-1-0-aaaa1111", [4, 5], decode_leg_params, now)
    meta = sched.build_connector_meta(now)          # to every rank
    out = sched.update_connector_output([rank0_output, rank1_output], now)

- A request with no transfer params, or with no blocks to move (a full prefix hit on D,
  an empty prefill on P), creates no state and raises nothing; D registers only the
  blocks it lacks (a partial prefix hit, R-T05). A P request that did not finish
  normally (aborted, errored) is freed at once (vLLM 0.33).
- A rank output is checked whole before any of it is applied (R-T02): its rank must be
  one of the engine's and its step newer than the last one it reported, else it is stale
  and ignored, counted. Entries about requests that no longer wait for the rank are
  counted stale too.
- Failures by cause (B-14) add up across the ranks: `stats()`. Each sent or received
  request is timed by its machine, from the `now` it was created at to the call that ends
  it (`PushConnectorOutput.timings`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from kvhandoff.machines.kv.effects import (
    ReportFailedRecving,
    ReportReleased,
    ReportTransferred,
    Warn,
)
from kvhandoff.machines.kv.events import (
    Abort,
    Drained,
    RankEnded,
    RankPosted,
    RankReceived,
    RankRecvFailed,
    RankSent,
)
from kvhandoff.machines.push.d_request import D_REQUEST, DRequestCtx
from kvhandoff.machines.push.meta import (
    FAILURE_CAUSES,
    PullRead,
    PushConnectorMeta,
    PushConnectorOutput,
    PushWorkerOutput,
    Timing,
)
from kvhandoff.machines.push.p_request import P_REQUEST, PRequestCtx
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.legs import (
    COORDINATE_KEYS,
    PrefillCoordinates,
    PullSource,
    prefill_coordinates,
    prefill_request_id,
    pull_params,
    pull_source,
    push_decode_params,
)
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PushRegistration
from kvhandoff.protocol.tp_mapping import check_tp_sizes

log = logging.getLogger("kvhandoff.push.scheduler")

Role = Literal["prefill", "decode"]
Mode = Literal["push", "pull"]

SCHEDULER_KINDS: tuple[Declaration[Any], ...] = (D_REQUEST, P_REQUEST)

_DRAINED = Drained()  # events are frozen: one instance serves every request
_ENGINES_SEEN = 256  # distinct P engine coordinates remembered (`_prefill_engine`)


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """This engine's coordinates, as peers reach its side channel."""

    engine_id: str
    host: str
    port: int


class PushScheduler:
    """The scheduler half of one engine (see the module docstring)."""

    def __init__(
        self,
        role: Role,
        engine: LocalEngine,
        config: PushConfig | None = None,
        mode: Mode = "push",
        *,
        bus: EventBus | None = None,
        now: float = 0.0,
    ) -> None:
        self.role = role
        self.engine = engine
        self.config = config or PushConfig()
        self.mode = mode
        if role == "decode" and self.config.pp_size > 1:
            raise LocalProtocolError(
                f"decode-side pipeline parallelism (pp_size={self.config.pp_size}) is not"
                " supported in push mode: completions are counted per consumer rank"
            )
        if mode == "pull" and self.config.kv_lease_duration <= self.config.sealed_notif_skew:
            raise LocalProtocolError(
                f"pull mode needs kv_lease_duration ({self.config.kv_lease_duration:g} s) above"
                f" sealed_notif_skew ({self.config.sealed_notif_skew:g} s): D takes a READ only"
                " if it is done within P's lease less the clocks' skew"
            )
        if mode == "pull" and self.config.pp_size > 1:
            raise LocalProtocolError(
                f"pull mode runs without pipeline parallelism (pp_size={self.config.pp_size}):"
                " D reads from, and P serves, one stage"
            )
        self.world = self.config.world_size
        self.bus = bus or EventBus()
        machine_config = self.config.machine_config()
        for kind in SCHEDULER_KINDS:
            self.bus.register(kind, machine_config)
        # Asked every step (`ended` in the metadata) while few of the live requests carry it.
        self.bus.watch(D_REQUEST, "ending")
        self.bus.watch(D_REQUEST, "given_up")  # counted by has_pending_push_work
        self.step = 0
        self.next_heartbeat = now + self.config.heartbeat_every
        self.stale_reports = 0
        self.failures: dict[str, int] = dict.fromkeys(FAILURE_CAUSES, 0)
        self._last_step: dict[int, int] = {}
        self._to_drain: list[str] = []
        self._engines_seen: dict[tuple[object, ...], PrefillCoordinates] = {}
        self._output = PushConnectorOutput()
        # This engine's coordinates as P hands them to D, built once.
        self._here_pull = PrefillCoordinates(
            engine.engine_id, engine.host, engine.port, self.config.tp_size
        )
        self._here_push = PrefillCoordinates(
            engine.engine_id, engine.host, engine.port, self.config.tp_size, self.config.pp_size
        )
        bus_ = self.bus
        bus_.handle(ReportFailedRecving, self._on_failed_recving)
        bus_.handle(ReportReleased, self._on_released)
        bus_.handle(ReportTransferred, self._on_transferred)
        bus_.handle(Warn, lambda _inst, warn: log.warning("%s: %s", warn.request_id, warn.message))

    # -- D side ----------------------------------------------------------------------

    def update_state_after_alloc(
        self,
        request_id: str,
        block_ids: Sequence[int],
        kv_transfer_params: Mapping[str, Any] | None,
        now: float,
    ) -> None:
        """D: stash the registration of the blocks D lacks; arm the watchdog (R-P02).

        `block_ids` are the blocks to receive: on a partial prefix hit only the uncached
        ones (R-T05). No params, no `do_remote_prefill`, or no blocks: nothing to do."""
        self._require("decode", "update_state_after_alloc")
        if not kv_transfer_params or not kv_transfer_params.get("do_remote_prefill"):
            return
        if not block_ids:
            return  # a full prefix hit on D: nothing to receive, nothing to register
        blocks = tuple(block_ids)
        if self.mode == "pull":
            source = pull_source(kv_transfer_params)
            ctx = DRequestCtx(
                request_id,
                blocks,
                ranks=self.world,
                heartbeat_engine=source.prefill.engine_id,
                heartbeat_id=source.request_id,
                source=source,
                since=now,
            )
        else:
            prefill = self._prefill_engine(kv_transfer_params)
            ctx = DRequestCtx(
                request_id,
                blocks,
                ranks=self.world,
                heartbeat_engine=prefill.engine_id,
                # C-01: P's own id when the leg names it (a stock vLLM P matches exactly);
                # else D's, which a kvhandoff P matches by base id.
                heartbeat_id=prefill_request_id(kv_transfer_params) or request_id,
                registration=self._registration(request_id, blocks, prefill),
                since=now,
            )
        self.bus.create(D_REQUEST, ctx, now)
        self._to_drain.append(request_id)

    def _prefill_engine(self, params: Mapping[str, Any]) -> PrefillCoordinates:
        """P's engine coordinates on a decode leg, parsed and checked once per distinct
        set of values (every leg from one P engine carries the same): a bounded memo."""
        try:
            key = tuple(map(params.get, COORDINATE_KEYS))
            known = self._engines_seen.get(key)
        except TypeError:  # an unhashable value: parse it to say what is wrong
            key, known = None, None
        if known is not None:
            return known
        prefill = replace(prefill_coordinates(params), request_id="")  # the engine's only
        if prefill.tp_size != self.config.tp_size:  # equal positive sizes always map
            check_tp_sizes(prefill.tp_size, self.config.tp_size, peer=prefill.engine_id)
        if key is not None:
            if len(self._engines_seen) >= _ENGINES_SEEN:
                self._engines_seen.clear()
            self._engines_seen[key] = prefill
        return prefill

    def _registration(
        self, request_id: str, blocks: tuple[int, ...], prefill: PrefillCoordinates
    ) -> PushRegistration:
        """The registration every rank sends, each with its own `decode_tp_rank`."""
        return PushRegistration(
            request_id=request_id,
            decode_engine_id=self.engine.engine_id,
            decode_host=self.engine.host,
            decode_port=self.engine.port,
            decode_tp_size=self.config.tp_size,
            decode_tp_rank=0,
            block_ids=blocks,
            remote_engine_id=prefill.engine_id,
            remote_host=prefill.host,
            remote_port=prefill.port,
            remote_tp_size=prefill.tp_size,
            remote_pp_size=prefill.pp_size,
        )

    def abort(self, request_id: str, now: float) -> None:
        """D: the engine's request-level abort path ends a request it waits for. Once no
        rank holds it (at once, if the watchdog already dropped it) it is reported
        `released`; a receive the ranks are still reporting (a pull READ in flight)
        reaches the engine as usual, and so does one already reported."""
        self.bus.advance(now)
        if self.bus.has_tag(D_REQUEST, request_id, "abortable"):
            self.bus.dispatch(D_REQUEST, request_id, Abort(), now)

    # -- P side ----------------------------------------------------------------------

    def request_finished(
        self,
        request_id: str,
        block_ids: Sequence[int],
        kv_transfer_params: Mapping[str, Any] | None,
        now: float,
        *,
        finished_normally: bool = True,
        wall: float | None = None,
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: hold the blocks for the push; True delays freeing them (R-P03).

        Only a request that finished normally (stopped or length-capped) and holds
        blocks is leased; an aborted or errored one is freed at once (vLLM 0.33). One that
        finished normally without blocks leases nothing but still hands D its decode-leg
        params, `(False, params)`, as vLLM 0.33's push connector does. In pull mode,
        `wall` (this engine's wall-clock time now) puts the earliest end of the lease on
        the params, so D can refuse a READ that may have outlived it (B-09)."""
        self._require("prefill", "request_finished")
        if not kv_transfer_params or not kv_transfer_params.get("do_remote_decode"):
            return False, None
        if not finished_normally:
            return False, None
        blocks = tuple(block_ids)
        if blocks:
            ctx = PRequestCtx(request_id, blocks, ranks=self.world, since=now)
            self.bus.create(P_REQUEST, ctx, now)
            self._to_drain.append(request_id)
        delay = bool(blocks)
        if self.mode == "pull":
            # The ranks' leases start at the next step: none ends before this.
            expires = None if wall is None or not blocks else wall + self.config.kv_lease_duration
            return delay, pull_params(self._here_pull, request_id, list(blocks), expires)
        return delay, push_decode_params(self._here_push, blocks, request_id)

    # -- every step --------------------------------------------------------------------

    def build_connector_meta(self, now: float) -> PushConnectorMeta:
        """Drain what this step hands to the ranks; expired watchdogs fire first (R-P10)."""
        bus = self.bus
        bus.advance(now)
        self.step += 1
        meta = PushConnectorMeta(step=self.step)
        d_kind, p_kind = (D_REQUEST, P_REQUEST)
        d_drained: list[Instance[DRequestCtx]] = []
        p_drained: list[Instance[PRequestCtx]] = []
        for request_id in self._to_drain:
            d = bus.get(d_kind, request_id)
            if d is not None and d.has("drainable"):
                d_drained.append(d)
                continue
            p = bus.get(p_kind, request_id)
            if p is not None and p.has("drainable"):
                p_drained.append(p)
        # One batch per kind: the step hands every drained request over at once.
        bus.dispatch_many(d_kind, [d.key for d in d_drained], _DRAINED, now)
        bus.dispatch_many(p_kind, [p.key for p in p_drained], _DRAINED, now)
        for d in d_drained:
            if d.ctx.registration is not None:
                meta.push_registrations[d.ctx.key] = d.ctx.registration
            elif d.ctx.source is not None:
                meta.pull_reads[d.ctx.key] = PullRead(d.ctx.source, d.ctx.block_ids)
        for p in p_drained:
            meta.push_finished_blocks[p.ctx.key] = p.ctx.block_ids
        self._to_drain.clear()
        if self.role == "decode":
            meta.ended = tuple(str(inst.key) for inst in bus.tagged(d_kind, "ending"))
            if now >= self.next_heartbeat:
                self.next_heartbeat = now + self.config.heartbeat_every
                meta.heartbeats = self._heartbeats()
        return meta

    def _heartbeats(self) -> dict[str, tuple[str, ...]]:
        """One batch per P engine: every request that keeps a lease there alive (R-P15)."""
        by_engine: dict[str, list[str]] = {}
        for inst in self.bus.tagged(D_REQUEST, "needs_heartbeat"):
            ctx = inst.ctx
            by_engine.setdefault(ctx.heartbeat_engine, []).append(ctx.heartbeat_id)
        return {engine: tuple(ids) for engine, ids in sorted(by_engine.items())}

    def update_connector_output(
        self, outputs: Iterable[PushWorkerOutput], now: float
    ) -> PushConnectorOutput:
        """Aggregate the ranks' outputs; a request is reported once every rank did (R-T02)."""
        self.bus.advance(now)
        for output in outputs:
            if not self._fresh(output):
                self.stale_reports += 1
                continue
            self._apply(output, now)
        result, self._output = self._output, PushConnectorOutput()
        return result

    def _fresh(self, output: PushWorkerOutput) -> bool:
        """The whole-report check: a rank of this engine, a step it has not reported yet
        and has been given."""
        if not 0 <= output.rank < self.world:
            log.warning("output from rank %d of an engine of %d ranks", output.rank, self.world)
            return False
        last = self._last_step.get(output.rank, -1)
        if not last < output.step <= self.step:
            return False
        self._last_step[output.rank] = output.step
        return True

    def _apply(self, output: PushWorkerOutput, now: float) -> None:
        rank = output.rank
        # A rank's part ends a request the ranks still hold, or counts as letting go of
        # one the scheduler is ending (the engine may end it before it hands over this).
        held = ("awaiting_ranks", "ending")
        self._deliver(D_REQUEST, output.finished_recving, held, RankReceived(rank), now)
        for request_id, reason in output.failed_recving.items():
            self._deliver(D_REQUEST, (request_id,), held, RankRecvFailed(rank, reason), now)
        self._deliver(D_REQUEST, output.posted, ("awaiting_ranks",), RankPosted(rank), now)
        self._deliver(D_REQUEST, output.ended, ("ending",), RankEnded(rank), now)
        self._deliver(P_REQUEST, output.finished_sending, ("awaiting_ranks",), RankSent(rank), now)
        for cause, count in output.failures.items():
            if cause in self.failures and count > 0:
                self.failures[cause] += count

    def _deliver(
        self,
        kind: Declaration[Any],
        request_ids: Iterable[str],
        tags: tuple[str, ...],
        event: Event,
        now: float,
    ) -> None:
        for tag in tags:
            kind.check_tag(tag)
        wanted = frozenset(tags)
        live = self.bus.machine(kind).index
        keys = []
        for request_id in request_ids:
            inst = live.get(request_id)
            if inst is not None and not wanted.isdisjoint(inst.node.tags):
                keys.append(request_id)
            else:
                self.stale_reports += 1  # ended meanwhile, or never this rank's to report
        if keys:
            self.bus.dispatch_many(kind, keys, event, now)

    def has_pending_push_work(self) -> bool:
        """True while any push state is in flight on this side (R-P13); a request the
        watchdog dropped waits for the engine's abort path, with nothing in flight."""
        bus = self.bus
        in_flight = bus.live(D_REQUEST) - len(bus.tagged(D_REQUEST, "given_up"))
        return in_flight > 0 or bus.live(P_REQUEST) > 0

    def stats(self) -> dict[str, int]:
        """Failures by cause across the ranks (B-14), and stale rank reports."""
        return {**self.failures, "stale_reports": self.stale_reports}

    # -- reports to the engine -----------------------------------------------------------

    def _on_failed_recving(self, _inst: Instance[object], effect: ReportFailedRecving) -> None:
        self._output.failed_recving[effect.request_id] = effect.reason
        self._output.invalid_block_ids.update(effect.block_ids)

    def _on_released(self, _inst: Instance[object], effect: ReportReleased) -> None:
        self._output.released[effect.request_id] = effect.reason
        if effect.failed:
            self._output.failed_released.add(effect.request_id)

    def _on_transferred(self, _inst: Instance[object], effect: ReportTransferred) -> None:
        """Reported to the engine (`finished_sending` on P, `finished_recving` on D) and
        timed at the bus's time: the `now` of the call whose rank reports ended it."""
        request_id = effect.request_id
        output = self._output
        (output.finished_sending if self.role == "prefill" else output.finished_recving).add(
            request_id
        )
        output.timings[request_id] = Timing(
            max(0.0, self.bus.now - effect.since), effect.num_blocks
        )

    def _require(self, role: Role, call: str) -> None:
        if self.role != role:
            raise LocalProtocolError(f"{call} is a {role}-side call; this scheduler is {self.role}")


__all__ = [
    "SCHEDULER_KINDS",
    "LocalEngine",
    "Mode",
    "PullSource",
    "PushConnectorMeta",
    "PushConnectorOutput",
    "PushScheduler",
    "PushWorkerOutput",
    "Role",
]
