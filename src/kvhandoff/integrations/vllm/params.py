"""vLLM's vocabulary to kvhandoff's, without importing vLLM (C-01).

vLLM's proxy and connector name P's tensor-parallel size `tp_size` (and `pp_size`);
kvhandoff's push scheduler reads `remote_tp_size` / `remote_pp_size`. vLLM's `kv_role`
picks the side of one engine."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvhandoff.machines.push.scheduler import Role

_ROLES: dict[str, Role] = {"kv_producer": "prefill", "kv_consumer": "decode"}


def push_role(kv_role: str | None) -> Role:
    """`kv_producer` is P, `kv_consumer` is D; one engine is one side in push mode."""
    role = _ROLES.get(kv_role or "")
    if role is None:
        raise ValueError(
            f"kvhandoff's push connector needs kv_role kv_producer or kv_consumer, not {kv_role!r}"
        )
    return role


def kvhandoff_params(params: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A request's kv_transfer_params as kvhandoff reads them (a copy; None stays None)."""
    if params is None:
        return None
    out = dict(params)
    if "remote_tp_size" not in out and "tp_size" in out:
        out["remote_tp_size"] = out["tp_size"]
    if "remote_pp_size" not in out and "pp_size" in out:
        out["remote_pp_size"] = out["pp_size"]
    return out
