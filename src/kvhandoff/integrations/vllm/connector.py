"""`KVHandoffConnector`: kvhandoff's push (or pull) mode behind vLLM 0.33's `KVConnectorBase_V1`
(C-05, R-T01). Imports vLLM; reached through the package's lazy names only.

One instance per role, as vLLM builds them: on the SCHEDULER role it owns a `PushScheduler`
(one per engine), on the WORKER role it drives one `PushRank`. The two halves share no
object: the scheduler's per-step `PushConnectorMeta` rides in `KVHandoffConnectorMetadata`
and each rank's `PushWorkerOutput` in `KVHandoffWorkerMetadata`, both msgspec Structs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import fields
from typing import TYPE_CHECKING, Any, cast

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.request import RequestStatus

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.push_rank import PushRank
from kvhandoff.integrations.vllm import stats
from kvhandoff.integrations.vllm.metrics import KVHandoffPromMetrics
from kvhandoff.integrations.vllm.nixl_rank import (
    RankAssembly,
    build_rank,
    kv_regions,
    serve_handshakes,
)
from kvhandoff.integrations.vllm.params import push_role
from kvhandoff.integrations.vllm.records import (
    KVHandoffConnectorMetadata,
    KVHandoffConnectorStats,
    KVHandoffHandshakeMetadata,
    KVHandoffWorkerMetadata,
)
from kvhandoff.machines.push.d_request import D_REQUEST
from kvhandoff.machines.push.meta import PushWorkerOutput
from kvhandoff.machines.push.scheduler import LocalEngine, Mode, PushScheduler
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.vllm.owed_report import (
    VLLM_OWED_REPORT,
    Direction,
    EngineEndedDropping,
    EngineEndedUnheld,
    OwedReportCtx,
    RanksDropped,
    Reported,
    TellEngine,
    Told,
)
from kvhandoff.machines.vllm.rank_receive import (
    VLLM_RANK_RECEIVE,
    LoadErrorsOwed,
    LoadErrorsTaken,
    RankReceiveCtx,
    ReceiveEnded,
    ReceiveFailed,
)
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.vllm_compat import VllmCompatFactors

if TYPE_CHECKING:
    import torch

    from kvhandoff.adapters.zmq.side_channel import SideChannelServer

# A request whose blocks finished normally keeps them leased for the push (vLLM 0.33).
_FINISHED_NORMALLY = frozenset(
    {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED}
)


def _config(vllm_config: Any) -> PushConfig:
    """kvhandoff's push settings: the TP/PP sizes vLLM runs with, and every `PushConfig`
    key (`kv_lease_duration`, `push_registration_timeout`, `handshake_timeout`,
    `nixl_backend`, `cluster_key`...) found in `kv_connector_extra_config`."""
    parallel = vllm_config.parallel_config
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    known = {f.name for f in fields(PushConfig)} - {"tp_size", "pp_size"}
    return PushConfig(
        tp_size=int(parallel.tensor_parallel_size),
        pp_size=int(parallel.pipeline_parallel_size),
        **{name: value for name, value in extra.items() if name in known},
    )


def _engine(vllm_config: Any) -> LocalEngine:
    transfer = vllm_config.kv_transfer_config
    extra = dict(transfer.kv_connector_extra_config or {})
    host = str(extra.get("side_channel_host", envs.VLLM_NIXL_SIDE_CHANNEL_HOST))
    port = int(extra.get("side_channel_port", envs.VLLM_NIXL_SIDE_CHANNEL_PORT))
    return LocalEngine(str(transfer.engine_id), host, port)


def transfer_mode(vllm_config: Any) -> Mode:
    """`kv_connector_extra_config["transfer_mode"]`: "push" (default, as vLLM's
    `NixlPushConnector`) or "pull" (as vLLM's `NixlConnector` READ path, B-09)."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    mode = extra.get("transfer_mode", "push")
    if mode == "push" or mode == "pull":
        return cast(Mode, mode)
    raise ValueError(f"kv_connector_extra_config transfer_mode must be push or pull: {mode!r}")


def compat_factors(vllm_config: Any) -> VllmCompatFactors:
    """What a peer engine hashes and compares before any KV moves, read from vLLM's config
    exactly as vLLM 0.33's own NIXL connector reads it (C-01), so a stock vLLM peer and a
    kvhandoff one agree; the attention backend is the one vLLM selected for this model."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends

    backend = get_current_attn_backends(vllm_config)[0].get_name()
    return VllmCompatFactors.from_vllm_config(vllm_config, str(backend), transfer_mode(vllm_config))


def _tp_rank(vllm_config: Any) -> int:
    """This worker's TP rank: vLLM's TP group when it is up, else its configured rank."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return int(parallel_state.get_tensor_model_parallel_rank())
    parallel = vllm_config.parallel_config
    return int(parallel.rank) % int(parallel.tensor_parallel_size)


class KVHandoffConnector(KVConnectorBase_V1, SupportsHMA):
    """kvhandoff push mode as a vLLM KV connector (see the module docstring).

    `SupportsHMA` as vLLM's own push connector is, so vLLM keeps its hybrid KV cache
    manager on and both engines hash the same factors (C-01); kvhandoff transfers one KV
    cache group, and a configuration with more is refused when the connector is built."""

    def __init__(
        self,
        vllm_config: Any,
        role: Any,
        kv_cache_config: Any = None,
        *,
        clock: Clock = real_clock,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        groups = getattr(kv_cache_config, "kv_cache_groups", None) or ()
        if len(groups) > 1:
            raise ValueError(
                f"KVHandoffConnector transfers one KV cache group; this model has {len(groups)}"
                " (a hybrid model): use vLLM's NixlConnector for it"
            )
        self.clock = clock
        self.push_role = push_role(vllm_config.kv_transfer_config.kv_role)
        self.config = _config(vllm_config)
        self.mode = transfer_mode(vllm_config)
        self.engine = _engine(vllm_config)
        self.scheduler: PushScheduler | None = None
        self.rank: PushRank | None = None
        self.assembly: RankAssembly | None = None  # the worker's NIXL rank, once registered
        self.side_channel: SideChannelServer | None = None  # the scheduler's, once served
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._outputs: list[PushWorkerOutput] = []
        self._stats_seen: dict[str, Any] = {}
        self.times = stats.RequestTimes(stats.block_bytes(kv_cache_config))
        # What this connector owes vLLM about each request is a machine on its own bus:
        # `vllm.owed_report` on the scheduler role, `vllm.rank_receive` on a worker role.
        self.owed = EventBus()
        if role == KVConnectorRole.SCHEDULER:
            self.owed.register(VLLM_OWED_REPORT)
            self.scheduler = PushScheduler(
                self.push_role, self.engine, self.config, self.mode, now=clock()
            )
            self.scheduler.bus.on_retire(self._on_push_retired)
        else:
            self.owed.register(VLLM_RANK_RECEIVE)

    # -- scheduler side --------------------------------------------------------------------

    def _sched(self) -> PushScheduler:
        if self.scheduler is None:
            raise RuntimeError("a scheduler-side call on a worker-role KVHandoffConnector")
        return self.scheduler

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """D: every prompt token P will push, loaded asynchronously; otherwise none."""
        params = request.kv_transfer_params
        if self.push_role != "decode" or not params or not params.get("do_remote_prefill"):
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """D: register the blocks it lacks for P's push (R-P02, R-T05). vLLM calls this again
        with 0 external tokens once the load is done: nothing to do then, nor on P."""
        if num_external_tokens <= 0 or self.push_role != "decode":
            return
        sched = self._sched()
        raw = request.kv_transfer_params
        if not raw or not raw.get("do_remote_prefill"):
            return
        block_ids: list[int] = list(blocks.get_unhashed_block_ids())
        now = self.clock()
        # The scheduler only reads the params and takes vLLM's names as they are.
        sched.update_state_after_alloc(request.request_id, block_ids, raw, now)
        if block_ids:
            self._owe(request.request_id, "recv", now)
            self.times.begin(request.request_id, len(block_ids), now)
            # Asked once: a request vLLM reschedules (recompute after a failed load) is
            # computed locally, as vLLM's own connectors do.
            request.kv_transfer_params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> KVHandoffConnectorMetadata:
        return KVHandoffConnectorMetadata(self._sched().build_connector_meta(self.clock()))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: lease the blocks of a prefill leg that finished normally (R-P03). D: a request
        vLLM ends (abort, error) while it waits for P's push is aborted in kvhandoff, so the
        ranks drop it (R-P10); vLLM keeps its blocks until the ranks report it."""
        sched = self._sched()
        normally = request.status in _FINISHED_NORMALLY
        if self.push_role != "prefill":
            if not normally and self.owed.has_tag(
                VLLM_OWED_REPORT, request.request_id, "engine_waiting"
            ):
                self._end_receive(sched, request.request_id)
            return False, None
        now = self.clock()
        delay, params = sched.request_finished(
            request.request_id,
            block_ids,
            request.kv_transfer_params,
            now,
            finished_normally=normally,
        )
        if delay:
            self._owe(request.request_id, "send", now)
            self.times.begin(request.request_id, len(block_ids), now)
        return delay, params

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call when its hybrid KV cache manager is on: the one group's blocks."""
        if len(block_ids) != 1:
            raise ValueError(
                f"KVHandoffConnector transfers one KV cache group, got {len(block_ids)}"
            )
        return self.request_finished(request, block_ids[0])

    def _owe(self, request_id: str, direction: Direction, now: float) -> None:
        """vLLM now waits to hear about `request_id` once."""
        self.owed.create(VLLM_OWED_REPORT, OwedReportCtx(request_id, direction), now)

    def _end_receive(self, sched: PushScheduler, request_id: str) -> None:
        """vLLM ended a request it holds in WAITING_FOR_REMOTE_KVS and keeps its blocks
        until it sees the id in `finished_recving`. Abort it in kvhandoff: once every rank
        has dropped it (or at once if no rank still holds it: its watchdog already ended
        it) the connector tells vLLM, which frees the blocks. A receive the ranks are
        still reporting (a pull READ in flight) reaches vLLM the usual way."""
        now = self.clock()
        sched.abort(request_id, now)
        if sched.bus.has_tag(D_REQUEST, request_id, "ending"):
            self.owed.dispatch(VLLM_OWED_REPORT, request_id, EngineEndedDropping(), now)
        elif not sched.bus.has_tag(D_REQUEST, request_id, "awaiting_ranks"):
            self.owed.dispatch(VLLM_OWED_REPORT, request_id, EngineEndedUnheld(), now)

    def _on_push_retired(self, inst: Instance[Any]) -> None:
        """A D request left kvhandoff's scheduler bus: if vLLM ended it, no rank holds it."""
        if inst.machine.decl is D_REQUEST and self.owed.has_tag(
            VLLM_OWED_REPORT, inst.key, "ending"
        ):
            self.owed.dispatch(VLLM_OWED_REPORT, inst.key, RanksDropped(), self._sched().bus.now)

    def update_connector_output(self, connector_output: Any) -> None:
        """Feed every rank's output to the scheduler's machines (R-T02), and pass vLLM
        each finished id once: vLLM 0.33 reads `finished_recving` / `finished_sending`
        after this hook and asserts every id in them is a request it still holds, so a
        late or repeated report is dropped here (counted in `dropped_reports`)."""
        meta = connector_output.kv_connector_worker_meta
        outputs = meta.outputs if isinstance(meta, KVHandoffWorkerMetadata) else ()
        now = self.clock()
        self._sched().update_connector_output(outputs, now)
        recving = self._once(connector_output.finished_recving, "recv", now)
        failed = set(connector_output.failed_recving or ()) & recving
        self.times.end(received=recving - failed, failed=failed, now=now)
        for _inst, effect in self.owed.drain_outbox():
            if isinstance(effect, TellEngine) and self.owed.has_tag(
                VLLM_OWED_REPORT, effect.request_id, "due"
            ):
                self.owed.dispatch(VLLM_OWED_REPORT, effect.request_id, Told(), now)
                recving.add(effect.request_id)
                self.times.end(forgotten=(effect.request_id,), now=now)
        connector_output.finished_recving = recving
        connector_output.finished_sending = self._once(
            connector_output.finished_sending, "send", now
        )
        self.times.end(sent=connector_output.finished_sending, now=now)

    def _once(self, reported: set[str] | None, direction: Direction, now: float) -> set[str]:
        """The reported ids vLLM still waits for, each now told; the machine refuses the
        rest (a second report, one after vLLM forgot the request), counted as dropped."""
        passed: set[str] = set()
        report = Reported(direction)
        for request_id in reported or ():
            try:
                self.owed.dispatch(VLLM_OWED_REPORT, request_id, report, now)
            except RemoteProtocolError:
                continue
            passed.add(request_id)
        return passed

    @property
    def dropped_reports(self) -> int:
        """Reports kept from vLLM: repeated, late, or of a request vLLM no longer holds."""
        if self.scheduler is None:
            return 0
        return self.owed.counters(VLLM_OWED_REPORT).rejected

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def get_kv_connector_stats(self) -> KVHandoffConnectorStats | None:
        """What moved since the last call (`stats.py`), None when nothing did. Scheduler:
        the failures by cause the ranks reported (B-14), the stale or late reports
        kvhandoff and this connector dropped, watchdog expiries, the interval's finished
        transfers with their bytes and times. Worker: its rank's lease expiries and the
        notifs it refused, by cause (S-06). vLLM adds the two up for its stat loggers."""
        if self.scheduler is None:
            totals = {} if self.rank is None else stats.rank_totals(self.rank)
            data = stats.delta(totals, self._stats_seen)
        else:
            totals = stats.scheduler_totals(self.scheduler, self.dropped_reports, self.side_channel)
            data = stats.merge(stats.delta(totals, self._stats_seen), self.times.take())
        return None if stats.is_empty(data) else KVHandoffConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVHandoffConnectorStats | None:
        return KVHandoffConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVHandoffPromMetrics:
        """kvhandoff's Prometheus metrics (`metrics.py`), registered once per process."""
        return KVHandoffPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build this rank over NIXL: one region per KV tensor (R-P15), its writer thread
        and handshake executor; `get_handshake_metadata` then carries its payload."""
        self.kv_caches = dict(kv_caches)
        if self.assembly is not None or not kv_caches:
            return
        num_blocks = int(self._kv_cache_config.num_blocks)
        first = next(iter(kv_caches.values()))
        self.assembly = build_rank(
            self.push_role,
            self.engine.engine_id,
            kv_regions(kv_caches, num_blocks),
            self.config,
            compat_factors(self._vllm_config),
            tp_rank=_tp_rank(self._vllm_config),
            mode=self.mode,
            mem="VRAM" if first.is_cuda else "DRAM",
            clock=self.clock,
        )
        self.rank = self.assembly.rank

    def get_handshake_metadata(self) -> KVHandoffHandshakeMetadata | None:
        if self.assembly is None:
            return None
        return KVHandoffHandshakeMetadata(
            self.assembly.handshake_payload(), self.assembly.rank.tp_rank
        )

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        """Scheduler: serve every rank's payload on this engine's side channel, where peer
        engines' ranks fetch it before a PUSH_REG or a WRITE (R-P05, R-P15)."""
        payloads = [
            meta.payload
            for _rank, meta in sorted(metadata.items())
            if isinstance(meta, KVHandoffHandshakeMetadata)
        ]
        if self.side_channel is not None:
            self.side_channel.close()
        self.side_channel = serve_handshakes(self.engine, payloads, self.config.tp_size)

    def shutdown(self) -> None:
        if self.assembly is not None:
            self.assembly.close()
            self.assembly = None
            self.rank = None
        if self.side_channel is not None:
            self.side_channel.close()
            self.side_channel = None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Hand this step's registrations, finished blocks and heartbeats to the rank."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVHandoffConnectorMetadata)
        push = meta.push
        now = self.clock()
        for request_id, registration in push.push_registrations.items():
            self._receive(request_id, registration.block_ids, now)
        for request_id, read in push.pull_reads.items():
            self._receive(request_id, read.block_ids, now)
        if self.rank is not None:
            self.rank.start_load_kv(meta.push)

    def _receive(self, request_id: str, block_ids: Sequence[int], now: float) -> None:
        if self.owed.get(VLLM_RANK_RECEIVE, request_id) is None:
            ctx = RankReceiveCtx(request_id, tuple(block_ids))
            self.owed.create(VLLM_RANK_RECEIVE, ctx, now)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # push mode: P writes whole requests; D never loads per layer

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return None  # P's writer thread pushes finished blocks; nothing per layer

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """The rank's finished sends and receives this step; its whole output goes up in
        `build_connector_worker_meta` for the scheduler's machines.

        A receive the rank failed is finished too (vLLM then ends or recomputes the
        request, per its `kv_load_failure_policy`) and failed: its id in `failed_recving`,
        its blocks in `get_block_ids_with_load_errors` (R-P12). A receive the scheduler
        ended (abort, watchdog) and the rank dropped is not reported here: the scheduler
        half tells vLLM once every rank dropped it (R-T02); a watchdog-ended request keeps
        waiting until vLLM's abort path ends it (R-P10)."""
        results = KVConnectorTransferResults()
        if self.rank is None:
            return results
        output = self.rank.get_finished()
        self._outputs.append(output)
        failed = set(output.failed_recving)
        now = self.clock()
        self._end_receives(failed, ReceiveFailed(), now)
        self._end_receives(failed | set(output.finished_recving), ReceiveEnded(), now)
        self._end_receives(output.ended, ReceiveEnded(), now)
        results.finished_sending = set(output.finished_sending)
        results.finished_recving = set(output.finished_recving) | failed
        results.failed_recving = failed
        return results

    def _end_receives(
        self, request_ids: Iterable[str], event: ReceiveEnded | ReceiveFailed, now: float
    ) -> None:
        for request_id in request_ids:
            if self.owed.has_tag(VLLM_RANK_RECEIVE, request_id, "receiving"):
                self.owed.dispatch(VLLM_RANK_RECEIVE, request_id, event, now)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of every receive that failed since the last call, each once."""
        errors: set[int] = set()
        now = self.clock()
        for _inst, effect in self.owed.drain_outbox():
            if isinstance(effect, LoadErrorsOwed):
                errors.update(effect.block_ids)
                self.owed.dispatch(VLLM_RANK_RECEIVE, effect.request_id, LoadErrorsTaken(), now)
        return errors

    def build_connector_worker_meta(self) -> KVHandoffWorkerMetadata | None:
        outputs, self._outputs = self._outputs, []
        return KVHandoffWorkerMetadata(outputs) if outputs else None
