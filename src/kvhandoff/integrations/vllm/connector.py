"""`KVHandoffConnector`: kvhandoff's push mode behind vLLM 0.33's `KVConnectorBase_V1`
(C-05, R-T01). Imports vLLM; reached through the package's lazy names only.

One instance per role, as vLLM builds them: on the SCHEDULER role it owns a `PushScheduler`
(one per engine), on the WORKER role it drives one `PushRank`. The two halves share no
object: the scheduler's per-step `PushConnectorMeta` rides in `KVHandoffConnectorMetadata`
and each rank's `PushWorkerOutput` in `KVHandoffWorkerMetadata`, both msgspec Structs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.push_rank import PushRank
from kvhandoff.integrations.vllm.params import kvhandoff_params, push_role
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

    def build_connector_meta(self, scheduler_output: Any) -> KVHandoffConnectorMetadata:
        return KVHandoffConnectorMetadata(self._sched().build_connector_meta(self.clock()))

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: lease the blocks of a prefill leg that finished normally (R-P03); D: nothing."""
        sched = self._sched()
        if self.push_role != "prefill":
            return False, None
        normally = getattr(request.status, "name", "") in _FINISHED_NORMALLY
        return sched.request_finished(
            request.request_id,
            block_ids,
            kvhandoff_params(request.kv_transfer_params),
            self.clock(),
            finished_normally=normally,
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """Feed every rank's output to the scheduler's machines (R-T02)."""
        meta = connector_output.kv_connector_worker_meta
        outputs = meta.outputs if isinstance(meta, KVHandoffWorkerMetadata) else ()
        self._sched().update_connector_output(outputs, self.clock())

    def has_pending_push_work(self) -> bool:
        return self.scheduler is not None and self.scheduler.has_pending_push_work()

    def get_kv_connector_stats(self) -> None:
        return None

    # -- worker side --------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Keep the rank's KV tensors; the NIXL transport over them is attached as `rank`."""
        self.kv_caches = dict(kv_caches)

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
        """The rank's finished sends and receives this step; its whole output goes up in
        `build_connector_worker_meta` for the scheduler's machines."""
        if self.rank is None:
            return None, None
        output = self.rank.get_finished()
        self._outputs.append(output)
        return set(output.finished_sending) or None, set(output.finished_recving) or None

    def build_connector_worker_meta(self) -> KVHandoffWorkerMetadata | None:
        outputs, self._outputs = self._outputs, []
        return KVHandoffWorkerMetadata(outputs) if outputs else None
