"""The compatibility hash a stock vLLM 0.33 NIXL peer checks before any KV moves (C-01).

vLLM hashes a fixed set of factors (its version, its NIXL connector version, the model's
KV shape, the attention backend, the KV cache dtype, hybrid-KV-manager use, speculative
decoding that changes the transferred state, and the transfer mode) as a key-sorted JSON
object under SHA-256. A kvhandoff engine that wants to talk to a stock vLLM engine must
produce the same hex digest from the same inputs, so `VllmCompatFactors` holds exactly
those inputs, supplied by whatever knows the engine's configuration (the vLLM
integration: `VllmCompatFactors.from_vllm_config`; a test or a demo: the constructor).

Block size, KV cache layout and the TP/PP shapes are not hashed (vLLM checks them at
handshake time, from the agent metadata); the record carries the first two anyway, as
the layout half of the agent metadata kvhandoff serves (`block_size`,
`kv_cache_layout`), so one record describes everything a stock peer compares.

Pure: no I/O, no import of vLLM.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = [
    "NIXL_CONNECTOR_VERSION",
    "VLLM_VERSION",
    "TransferMode",
    "VllmCompatFactors",
]

VLLM_VERSION: Final = "0.33.0"
"""The vLLM release whose wire kvhandoff speaks."""
NIXL_CONNECTOR_VERSION: Final = 15
"""vLLM 0.33.0's NIXL connector version, one of the hashed factors."""

TransferMode = Literal["push", "pull"]


@dataclass(frozen=True, slots=True)
class VllmCompatFactors:
    """What vLLM 0.33 hashes, plus the two layout facts its handshake compares."""

    model: str
    """The model name or path exactly as the engine was given it."""
    dtype: str
    """The model dtype as vLLM prints it, e.g. ``"torch.bfloat16"``."""
    num_kv_heads: int
    """Total KV heads of the model (not per rank)."""
    head_size: int
    num_hidden_layers: int
    attn_backend_name: str
    """The attention backend's name, e.g. ``"FLASH_ATTN"`` or ``"CPU_ATTN"``."""
    cache_dtype: str = "auto"
    is_hma_enabled: bool = False
    """True unless the hybrid KV cache manager is disabled."""
    transfer_mode: TransferMode = "push"
    speculative: Mapping[str, Any] | None = None
    """vLLM's speculative factors (EAGLE/MTP); None without such a speculator."""
    vllm_version: str = VLLM_VERSION
    connector_version: int = NIXL_CONNECTOR_VERSION
    block_size: int = 16
    """Tokens per logical block (not hashed; compared at handshake)."""
    kv_cache_layout: str = "HND"
    """vLLM's KV cache layout name, e.g. ``"HND"`` or ``"LBHNC"`` (not hashed)."""

    def hashed(self) -> dict[str, Any]:
        """The factor map, keyed as vLLM keys it."""
        return {
            "vllm_version": self.vllm_version,
            "nixl_connector_version": self.connector_version,
            "model": self.model,
            "dtype": self.dtype,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "num_hidden_layers": self.num_hidden_layers,
            "attn_backend_name": self.attn_backend_name,
            "cache_dtype": self.cache_dtype,
            "is_hma_enabled": self.is_hma_enabled,
            "speculative_config": None if self.speculative is None else dict(self.speculative),
            "transfer_mode": self.transfer_mode,
        }

    def compatibility_hash(self) -> str:
        """SHA-256 hex over the key-sorted JSON of `hashed()`: what a stock peer sends."""
        text = json.dumps(self.hashed(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()

    @classmethod
    def from_vllm_config(
        cls, vllm_config: Any, attn_backend_name: str, transfer_mode: TransferMode = "push"
    ) -> VllmCompatFactors:
        """The factors of a vLLM ``VllmConfig`` (read by attribute, vLLM is not imported).

        Speculative decoding with a hidden-state speculator is refused: kvhandoff does not
        transfer its state, so it cannot claim compatibility with a peer that does."""
        spec = getattr(vllm_config, "speculative_config", None)
        if spec is not None and spec.use_eagle():
            raise ValueError("kvhandoff does not transfer EAGLE/MTP speculator state")
        model = vllm_config.model_config
        cache = vllm_config.cache_config
        scheduler = vllm_config.scheduler_config
        from_engine = getattr(cache, "kv_cache_layout", None)
        return cls(
            model=str(model.model),
            dtype=str(model.dtype),
            num_kv_heads=int(model.get_total_num_kv_heads()),
            head_size=int(model.get_head_size()),
            num_hidden_layers=int(model.get_total_num_hidden_layers()),
            attn_backend_name=attn_backend_name,
            cache_dtype=str(cache.cache_dtype),
            is_hma_enabled=not scheduler.disable_hybrid_kv_cache_manager,
            transfer_mode=transfer_mode,
            block_size=int(cache.block_size),
            kv_cache_layout=str(from_engine) if from_engine else "HND",
        )
