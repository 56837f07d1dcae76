"""kvhandoff's own compatibility hash, for deployments of kvhandoff engines only (R-P15).

A stock vLLM peer compares vLLM's hash instead
(`kvhandoff.protocol.vllm_compat.VllmCompatFactors`); both ends must be given the same kind.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import msgspec

__all__ = ["compatibility_hash"]


def compatibility_hash(
    engine_version: str,
    model: str,
    dtype: str,
    kv_block_len: int,
    *,
    extra: Mapping[str, str | int] | None = None,
) -> str:
    """SHA-256 hex over what both ends must agree on before any KV moves.

    ``kv_block_len`` is whatever block size both sides must share (TP-independent);
    ``extra`` holds further settings, hashed in key order. The fields are msgpack-encoded
    as one list, so no choice of strings can make two different inputs collide by
    concatenation.
    """
    canonical = [
        "kvhandoff-compat-v1",
        engine_version,
        model,
        dtype,
        kv_block_len,
        sorted((extra or {}).items()),
    ]
    return hashlib.sha256(msgspec.msgpack.encode(canonical)).hexdigest()
