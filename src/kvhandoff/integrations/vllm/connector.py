"""`KVHandoffConnector`: kvhandoff's push mode behind vLLM 0.33's `KVConnectorBase_V1`
(C-05, R-T01). Imports vLLM; reached through the package's lazy names only.

One instance per role, as vLLM builds them: on the SCHEDULER role it owns a `PushScheduler`
(one per engine), on the WORKER role it drives one `PushRank`. The two halves share no
object: the scheduler's per-step `PushConnectorMeta` rides in `KVHandoffConnectorMetadata`
and each rank's `PushWorkerOutput` in `KVHandoffWorkerMetadata`, both msgspec Structs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.push_rank import PushRank
from kvhandoff.integrations.vllm.params import kvhandoff_params, push_role
from kvhandoff.machines.push.d_request import D_REQUEST
from kvhandoff.machines.push.meta import PushConnectorMeta, PushWorkerOutput
from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.protocol.push_config import PushConfig

if TYPE_CHECKING:
    import torch

# A request whose blocks finished normally keeps them leased for the push (vLLM 0.33).
_FINISHED_NORMALLY = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


class KVHandoffConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> every worker, once a step: kvhandoff's msgspec payload, nothing live."""

    def __init__(self, push: PushConnectorMeta) -> None:
        self.push = push


class KVHandoffWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once a step: every rank's output, concatenated by vLLM."""

    def __init__(self, outputs: Sequence[PushWorkerOutput] = ()) -> None:
        self.outputs = tuple(outputs)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVHandoffWorkerMetadata:
        more = other.outputs if isinstance(other, KVHandoffWorkerMetadata) else ()
        return KVHandoffWorkerMetadata(self.outputs + more)


@dataclass
class KVHandoffConnectorStats(KVConnectorStats):
    """kvhandoff's failures by cause (B-14) over one interval: `data` maps each cause in
    `FAILURE_CAUSES`, `stale_reports` (kvhandoff ignored them) and `dropped_reports` (the
    connector kept them from vLLM) to a count; ranks' and scheduler's counts add up."""

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVHandoffConnectorStats:
        for name, count in other.data.items():
            self.data[name] = int(self.data.get(name, 0)) + int(count)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(count) for name, count in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _config(vllm_config: Any) -> PushConfig:
    parallel = vllm_config.parallel_config
    return PushConfig(
        tp_size=int(parallel.tensor_parallel_size), pp_size=int(parallel.pipeline_parallel_size)
    )


def _engine(vllm_config: Any) -> LocalEngine:
    transfer = vllm_config.kv_transfer_config
    extra = dict(transfer.kv_connector_extra_config or {})
    host = str(extra.get("side_channel_host", envs.VLLM_NIXL_SIDE_CHANNEL_HOST))
    port = int(extra.get("side_channel_port", envs.VLLM_NIXL_SIDE_CHANNEL_PORT))
    return LocalEngine(str(transfer.engine_id), host, port)


class KVHandoffConnector(KVConnectorBase_V1):
    """kvhandoff push mode as a vLLM KV connector (see the module docstring)."""

    def __init__(
        self,
        vllm_config: Any,
        role: Any,
        kv_cache_config: Any = None,
        *,
        clock: Clock = real_clock,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.clock = clock
        self.push_role = push_role(vllm_config.kv_transfer_config.kv_role)
        self.config = _config(vllm_config)
        self.engine = _engine(vllm_config)
        self.scheduler: PushScheduler | None = None
        self.rank: PushRank | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}
        self._outputs: list[PushWorkerOutput] = []
        # Scheduler: the ids vLLM waits to hear about once (a second report would crash it).
        self._awaiting_recv: set[str] = set()
        self._leased: set[str] = set()
        self._ending: set[str] = set()  # vLLM ended them; kvhandoff's ranks are dropping them
        self._released: set[str] = set()  # vLLM ended them; no rank holds them any more
        self.dropped_reports = 0
        self._stats_seen: dict[str, int] = {}
        # Worker: the blocks of each receive this rank was given, and the failed ones' blocks.
        self._recv_blocks: dict[str, tuple[int, ...]] = {}
        self._load_errors: set[int] = set()
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = PushScheduler(
                self.push_role, self.engine, self.config, "push", now=clock()
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
        sched = self._sched()
        if self.push_role != "decode" or num_external_tokens <= 0:
            return
        params = kvhandoff_params(request.kv_transfer_params)
        if not params or not params.get("do_remote_prefill"):
            return
        block_ids: list[int] = list(blocks.get_unhashed_block_ids())
        sched.update_state_after_alloc(request.request_id, block_ids, params, self.clock())
        if block_ids:
            self._awaiting_recv.add(request.request_id)
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
        normally = getattr(request.status, "name", "") in _FINISHED_NORMALLY
        if self.push_role != "prefill":
            if not normally and request.request_id in self._awaiting_recv:
                self._end_receive(sched, request.request_id)
            return False, None
        delay, params = sched.request_finished(
            request.request_id,
            block_ids,
            kvhandoff_params(request.kv_transfer_params),
            self.clock(),
            finished_normally=normally,
        )
        if delay:
            self._leased.add(request.request_id)
        return delay, params

    def _end_receive(self, sched: PushScheduler, request_id: str) -> None:
        """vLLM ended a request it holds in WAITING_FOR_REMOTE_KVS and keeps its blocks
        until it sees the id in `finished_recving`. Abort it in kvhandoff: once every rank
        has dropped it (or at once if no rank still holds it: its watchdog already ended
        it) the connector tells vLLM, which frees the blocks. A receive the ranks are
        still reporting (a pull READ in flight) reaches vLLM the usual way."""
        sched.abort(request_id, self.clock())
        if sched.bus.has_tag(D_REQUEST, request_id, "ending"):
            self._ending.add(request_id)
        elif not sched.bus.has_tag(D_REQUEST, request_id, "awaiting_ranks"):
            self._released.add(request_id)

    def update_connector_output(self, connector_output: Any) -> None:
        """Feed every rank's output to the scheduler's machines (R-T02), and pass vLLM
        each finished id once: vLLM 0.33 reads `finished_recving` / `finished_sending`
        after this hook and asserts every id in them is a request it still holds, so a
        late or repeated report is dropped here (counted in `dropped_reports`)."""
        meta = connector_output.kv_connector_worker_meta
        outputs = meta.outputs if isinstance(meta, KVHandoffWorkerMetadata) else ()
        sched = self._sched()
        sched.update_connector_output(outputs, self.clock())
        let_go = {rid for rid in self._ending if not sched.bus.has_tag(D_REQUEST, rid, "ending")}
        self._ending -= let_go
        released, self._released = (self._released | let_go) & self._awaiting_recv, set()
        reported = set(connector_output.finished_recving or ())
        self._ending -= reported
        connector_output.finished_recving = self._once(reported, self._awaiting_recv) | released
        self._awaiting_recv -= released
        connector_output.finished_sending = self._once(
            set(connector_output.finished_sending or ()), self._leased
        )

    def _once(self, reported: set[str], owed: set[str]) -> set[str]:
        passed = reported & owed
        owed -= passed
        self.dropped_reports += len(reported) - len(passed)
        return passed

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def get_kv_connector_stats(self) -> KVHandoffConnectorStats | None:
        """Scheduler: the failures by cause the ranks reported since the last call (B-14),
        and the stale or late reports kvhandoff and this connector dropped."""
        if self.scheduler is None:
            return None
        totals = {**self.scheduler.stats(), "dropped_reports": self.dropped_reports}
        delta = {name: count - self._stats_seen.get(name, 0) for name, count in totals.items()}
        self._stats_seen = totals
        return KVHandoffConnectorStats(data=delta)

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVHandoffConnectorStats | None:
        return KVHandoffConnectorStats(data=dict(data or {}))

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the rank's KV tensors; the NIXL transport over them is attached as `rank`."""
        self.kv_caches = dict(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Hand this step's registrations, finished blocks and heartbeats to the rank."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVHandoffConnectorMetadata)
        push = meta.push
        for request_id, registration in push.push_registrations.items():
            self._recv_blocks[request_id] = tuple(registration.block_ids)
        for request_id, read in push.pull_reads.items():
            self._recv_blocks[request_id] = tuple(read.block_ids)
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
        for request_id in failed:
            self._load_errors.update(self._recv_blocks.get(request_id, ()))
        for request_id in failed | set(output.finished_recving) | set(output.ended):
            self._recv_blocks.pop(request_id, None)
        results.finished_sending = set(output.finished_sending)
        results.finished_recving = set(output.finished_recving) | failed
        results.failed_recving = failed
        return results

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVHandoffWorkerMetadata | None:
        outputs, self._outputs = self._outputs, []
        return KVHandoffWorkerMetadata(outputs) if outputs else None
