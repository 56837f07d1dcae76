"""kvhandoff as a vLLM 0.33 KV connector (C-05, R-T01), loaded by vLLM itself:

    --kv-transfer-config '{"kv_connector": "KVHandoffConnector",
        "kv_connector_module_path": "kvhandoff.integrations.vllm", "kv_role": "kv_consumer"}'

This package imports without vLLM: the vLLM-facing classes live in `connector.py`, imported
on first access to one of their names (vLLM's loader does `getattr(module, name)`).
The encoder-cache connector is loaded the same way, from `ec_connector.py`:

    --ec-transfer-config '{"ec_connector": "KVHandoffECConnector",
        "ec_connector_module_path": "kvhandoff.integrations.vllm", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"ec_cpu_bytes": 1073741824, "ec_enable_nixl": true}}'
"""

from __future__ import annotations

from typing import Any

from kvhandoff.integrations.vllm.params import kvhandoff_params, push_role

__all__ = [
    "KVHandoffConnector",
    "KVHandoffConnectorMetadata",
    "KVHandoffConnectorStats",
    "KVHandoffECConnector",
    "KVHandoffECConnectorMetadata",
    "KVHandoffECWorkerMetadata",
    "KVHandoffHandshakeMetadata",
    "KVHandoffWorkerMetadata",
    "kvhandoff_params",
    "push_role",
]

_LAZY = ("KVHandoffConnector",)
_LAZY_RECORDS = (
    "KVHandoffConnectorMetadata",
    "KVHandoffConnectorStats",
    "KVHandoffHandshakeMetadata",
    "KVHandoffWorkerMetadata",
)
_LAZY_EC = (
    "KVHandoffECConnector",
    "KVHandoffECConnectorMetadata",
    "KVHandoffECWorkerMetadata",
)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvhandoff.integrations.vllm import connector

        return getattr(connector, name)
    if name in _LAZY_RECORDS:
        from kvhandoff.integrations.vllm import records

        return getattr(records, name)
    if name in _LAZY_EC:
        from kvhandoff.integrations.vllm import ec_connector

        return getattr(ec_connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
