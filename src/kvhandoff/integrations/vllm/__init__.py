"""kvhandoff as a vLLM 0.33 KV connector (C-05, R-T01), loaded by vLLM itself:

    --kv-transfer-config '{"kv_connector": "KVHandoffConnector",
        "kv_connector_module_path": "kvhandoff.integrations.vllm", "kv_role": "kv_consumer"}'

This package imports without vLLM: the vLLM-facing classes live in `connector.py`, imported
on first access to one of their names (vLLM's loader does `getattr(module, name)`).
"""

from __future__ import annotations

from typing import Any

from kvhandoff.integrations.vllm.params import kvhandoff_params, push_role

__all__ = [
    "KVHandoffConnector",
    "KVHandoffConnectorMetadata",
    "KVHandoffConnectorStats",
    "KVHandoffHandshakeMetadata",
    "KVHandoffWorkerMetadata",
    "kvhandoff_params",
    "push_role",
]

_LAZY = (
    "KVHandoffConnector",
    "KVHandoffConnectorMetadata",
    "KVHandoffConnectorStats",
    "KVHandoffHandshakeMetadata",
    "KVHandoffWorkerMetadata",
)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvhandoff.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
