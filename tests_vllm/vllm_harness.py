"""Building vLLM 0.33's real engine parts on CPU for the tier's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BLOCK_SIZE = 32  # vLLM's CPU attention backend rejects 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def vllm_config(
    model_dir: Path,
    *,
    kv_connector: str,
    kv_role: str,
    kv_connector_module_path: str | None = None,
    extra_config: dict[str, Any] | None = None,
    kv_load_failure_policy: str = "fail",
) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0)
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(
        block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, enable_prefix_caching=True
    )
    cache.kv_cache_layout = "LBHNC"  # set explicitly: the CPU worker supports this one
    transfer = KVTransferConfig(
        kv_connector=kv_connector,
        kv_connector_module_path=kv_connector_module_path,
        kv_role=kv_role,
        kv_buffer_device="cpu",
        kv_connector_extra_config=extra_config or {},
        kv_load_failure_policy=kv_load_failure_policy,
    )
    return VllmConfig(
        scheduler_config=scheduler,
        model_config=model,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(num_blocks: int = 100) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
    )


def scheduler(config: Any, num_blocks: int = 100) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


class StubRank:
    """A rank whose outputs the test scripts: the worker-role connector's own logic (block
    bookkeeping, failed receives) runs for real; no transport is needed to show it."""

    def __init__(self) -> None:
        self.metas: list[Any] = []
        self.outputs: list[Any] = []

    def start_load_kv(self, meta: Any) -> None:
        self.metas.append(meta)

    def get_finished(self) -> Any:
        return self.outputs.pop(0)


def worker_step(worker: Any, rank: StubRank, scheduler_output: Any, report: Any) -> Any:
    """vLLM's worker lifecycle for one step (the model-runner mixin's order): bind the
    metadata, start_load_kv, then the transfer results, load errors and worker metadata."""
    from vllm.v1.outputs import KVConnectorOutput

    worker.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    worker.start_load_kv(None)
    rank.outputs.append(report)
    results = worker.get_transfer_results(scheduler_output.finished_req_ids)
    output = KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        failed_recving=results.failed_recving,
        invalid_block_ids=worker.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=worker.build_connector_worker_meta(),
    )
    worker.clear_connector_metadata()
    return output


def one_token(output: Any, request_ids: list[str], kv_output: Any = None) -> Any:
    """A step's model-runner output: one sampled token per scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=request_ids,
        req_id_to_index={rid: i for i, rid in enumerate(request_ids)},
        sampled_token_ids=[[7] for _ in request_ids],
        kv_connector_output=kv_output,
    )
