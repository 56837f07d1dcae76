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
