"""`KVHandoffConnector`: kvhandoff's push (or pull) mode behind vLLM 0.33's `KVConnectorBase_V1`
(C-05, R-T01). Imports vLLM; reached through the package's lazy names only.

One instance per role, as vLLM builds them: on the SCHEDULER role it owns a `PushScheduler`
(one per engine), on the WORKER role it drives one `PushRank`. The two halves share no
object: the scheduler's per-step `PushConnectorMeta` rides in `KVHandoffConnectorMetadata`
and each rank's `PushWorkerOutput` in `KVHandoffWorkerMetadata`, both msgspec Structs.

The connector keeps no request state of its own (issue 26): the scheduler role hands vLLM
exactly what `PushScheduler` aggregated (its `finished_sending`, and as `finished_recving`
every receive it reported received, failed or released, each once by its machine's final
state), and the worker role passes its rank's output through, the failed receives' blocks
as this step's load errors. The simulator and the model tests drive the same
`PushScheduler` and `PushRank`.
"""

from __future__ import annotations

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

from kvhandoff.adapters.clock import real_clock, wall_clock
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
from kvhandoff.machines.push.meta import PushWorkerOutput
from kvhandoff.machines.push.scheduler import LocalEngine, Mode, PushScheduler
from kvhandoff.machines.runtime.clock import Clock
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
        # Per-step hand-offs, not request state: the rank's outputs until vLLM takes the
        # worker metadata, and the load errors of the step's output until vLLM asks.
        self._outputs: list[PushWorkerOutput] = []
        self._load_errors: set[int] = set()
        # Running totals as of the last stats call, and this interval's finished transfers
        # as observations (counts, bytes, seconds: no request ids), until vLLM asks.
        self._stats_seen: dict[str, Any] = {}
        self._stats_fingerprint: tuple[int, ...] = ()
        self._observed: stats.StatsData = {}
        self._block_bytes = stats.block_bytes(kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = PushScheduler(
                self.push_role, self.engine, self.config, self.mode, now=clock()
            )

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
        # The scheduler only reads the params and takes vLLM's names as they are.
        sched.update_state_after_alloc(request.request_id, block_ids, raw, self.clock())
        if block_ids:
            # Asked once: a request vLLM reschedules (recompute after a failed load) is
            # computed locally, as vLLM's own connectors do.
            request.kv_transfer_params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: Any) -> KVHandoffConnectorMetadata:
        return KVHandoffConnectorMetadata(self._sched().build_connector_meta(self.clock()))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: lease the blocks of a prefill leg that finished normally (R-P03). D: a request
        vLLM ends (abort, error) while it waits for P's push takes kvhandoff's abort path:
        the ranks drop it and, once none holds it, it is reported in `finished_recving`,
        which frees the blocks vLLM kept for it (R-P10)."""
        sched = self._sched()
        normally = request.status in _FINISHED_NORMALLY
        if self.push_role != "prefill":
            if not normally:
                sched.abort(request.request_id, self.clock())
            return False, None
        return sched.request_finished(
            request.request_id,
            block_ids,
            request.kv_transfer_params,
            self.clock(),
            finished_normally=normally,
            wall=wall_clock() if self.mode == "pull" else None,  # pull's lease deadline
        )

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call when its hybrid KV cache manager is on: the one group's blocks."""
        if len(block_ids) != 1:
            raise ValueError(
                f"KVHandoffConnector transfers one KV cache group, got {len(block_ids)}"
            )
        return self.request_finished(request, block_ids[0])

    def update_connector_output(self, connector_output: Any) -> None:
        """Feed every rank's output to the scheduler's machines (R-T02) and hand vLLM what
        they aggregated, in place of vLLM's own count of the ranks' reports: vLLM 0.33
        asserts that every id it is told about is a request it still holds, and each id
        here is reported once, by its machine's final state (received, failed, released,
        or sent). A failed receive's load errors reached vLLM from the ranks in this same
        output (vLLM reads them first); a late or repeated report is stale in the
        scheduler and counted (`stale_reports`)."""
        meta = connector_output.kv_connector_worker_meta
        outputs = meta.outputs if isinstance(meta, KVHandoffWorkerMetadata) else ()
        result = self._sched().update_connector_output(outputs, self.clock())
        connector_output.finished_recving = (
            result.finished_recving | result.failed_recving.keys() | result.released.keys()
        )
        connector_output.finished_sending = result.finished_sending
        stats.merge(self._observed, stats.transfers(result, self._block_bytes))

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def get_kv_connector_stats(self) -> KVHandoffConnectorStats | None:
        """What moved since the last call (`stats.py`), None when nothing did. Scheduler:
        the failures by cause the ranks reported (B-14), the stale rank reports kvhandoff
        ignored, watchdog expiries, the interval's finished transfers by outcome with their
        bytes and times (as `PushScheduler`'s machines timed them). Worker: its rank's
        lease expiries and the notifs it refused, by cause (S-06). vLLM adds the two up
        for its stat loggers."""
        if self.scheduler is None:
            if self.rank is None:
                return None
            fingerprint = stats.rank_fingerprint(self.rank)
            if fingerprint == self._stats_fingerprint:
                return None  # no total moved since the last call
            self._stats_fingerprint = fingerprint
            data = stats.delta(stats.rank_totals(self.rank), self._stats_seen)
        else:
            fingerprint = stats.scheduler_fingerprint(self.scheduler, self.side_channel)
            if fingerprint == self._stats_fingerprint:
                data = self._observed  # no total moved: only what finished meanwhile
            else:
                self._stats_fingerprint = fingerprint
                totals = stats.scheduler_totals(self.scheduler, self.side_channel)
                data = stats.merge(stats.delta(totals, self._stats_seen), self._observed)
            self._observed = {}
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
            device=(first.device.index or 0) if first.is_cuda else 0,
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
        if self.rank is not None:
            self.rank.start_load_kv(meta.push)

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
        its blocks in this step's `get_block_ids_with_load_errors` (R-P12). A receive the
        scheduler ended (abort, watchdog) and the rank dropped is not reported here: the
        scheduler half tells vLLM once every rank let go of it (R-T02, R-P10)."""
        results = KVConnectorTransferResults()
        if self.rank is None:
            return results
        output = self.rank.get_finished()
        self._outputs.append(output)
        failed = set(output.failed_recving)
        self._load_errors = set(output.invalid_block_ids)
        results.finished_sending = set(output.finished_sending)
        results.finished_recving = set(output.finished_recving) | failed
        results.failed_recving = failed
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of the receives this step's output failed (vLLM asks right after
        `get_transfer_results`)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVHandoffWorkerMetadata | None:
        outputs, self._outputs = self._outputs, []
        return KVHandoffWorkerMetadata(outputs) if outputs else None
