"""vLLM 0.33's connector contract, pinned (C-05): an API change in vLLM fails loudly here
before any integration test misbehaves; and vLLM's real Scheduler runs on this CPU host."""

from __future__ import annotations

from pathlib import Path

import vllm_harness


def test_C_05_vllm_version_is_the_pinned_reference() -> None:
    import vllm

    assert vllm.__version__ == "0.33.0"


def test_C_05_kv_connector_base_abstract_methods_are_pinned() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    assert sorted(KVConnectorBase_V1.__abstractmethods__) == [
        "build_connector_meta",
        "get_num_new_matched_tokens",
        "save_kv_layer",
        "start_load_kv",
        "update_state_after_alloc",
        "wait_for_layer_load",
        "wait_for_save",
    ]


def test_C_05_ec_connector_base_abstract_methods_are_pinned() -> None:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase

    assert sorted(ECConnectorBase.__abstractmethods__) == [
        "build_connector_meta",
        "has_cache_item",
        "save_caches",
        "start_load_caches",
        "update_state_after_alloc",
    ]


def test_C_01_vllm_real_scheduler_runs_its_push_connector_on_cpu(tiny_model_dir: Path) -> None:
    """The reference side of every interop test: vLLM's own NixlPushConnector, built by
    vLLM's real Scheduler from a config-only model, on CPU."""
    config = vllm_harness.vllm_config(
        tiny_model_dir, kv_connector="NixlPushConnector", kv_role="kv_consumer"
    )
    sched = vllm_harness.scheduler(config)
    assert type(sched.connector).__name__ == "NixlPushConnector"
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 99  # one null block
