"""The encoder-cache demo's "model": its requests and their encodings, the same on both
sides (derived from the seed), so each role can verify every byte it receives.

Both roles derive the same request list from `--seed`. Two requests play the protocol's
detours when there are at least two: request 0 (`late`) is published and then evicted by
the producer, request 1 (`slow`) is published before its save has landed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvhandoff.protocol.ec_status import compatibility_hash

__all__ = [
    "BLOCK_BYTES",
    "COMPAT",
    "DTYPE",
    "HIDDEN",
    "HOLD_MAX_S",
    "ECDemoRequest",
    "ec_demo_requests",
    "encoding",
    "matches",
    "region_blocks",
]

HIDDEN = 64
DTYPE = torch.bfloat16
DTYPE_NAME = "bfloat16"
BLOCK_BYTES = HIDDEN * 2
TOKEN_CHOICES = (8, 12, 16, 24, 32)
SPARE_BLOCKS = 16
HOLD_MAX_S = 3.0
COMPAT = compatibility_hash("kvhandoff-demo", "demo-encoder", DTYPE_NAME, BLOCK_BYTES)
"""Both demo roles run the same "model", so their compatibility hashes agree (R-E10)."""


@dataclass(frozen=True, slots=True)
class ECDemoRequest:
    client_id: str
    mm_hash: str
    tokens: int
    case: str = "normal"
    """`normal`, `late` (evicted before the orchestrator relays it), `slow` (its save
    lands only after a NACK_NOT_READY) or `filler` (unpublished; evicts the late one)."""

    @property
    def metadata(self) -> dict[str, Any]:
        """The placeholder fields a model would declare for an image of this size."""
        return {"modality": "image", "num_tokens": self.tokens}


def ec_demo_requests(count: int, seed: int) -> list[ECDemoRequest]:
    """The same list on both sides: a few KB per encoding, two detour cases."""
    picks = np.random.default_rng(seed).integers(0, len(TOKEN_CHOICES), max(count, 0))
    out = []
    for i in range(count):
        client = f"mm-{seed:04x}{i:05d}"
        digest = hashlib.blake2b(client.encode(), digest_size=8).hexdigest()
        case = ("late", "slow")[i] if count >= 2 and i < 2 else "normal"
        out.append(ECDemoRequest(client, f"img-{digest}", TOKEN_CHOICES[int(picks[i])], case))
    return out


def encoding(mm_hash: str, tokens: int) -> torch.Tensor:
    """The encoder output of `mm_hash`: `[tokens, HIDDEN]` bfloat16 of seeded bytes."""
    seed = int.from_bytes(hashlib.blake2b(mm_hash.encode(), digest_size=8).digest(), "little")
    raw = np.random.default_rng(seed).integers(0, 256, tokens * BLOCK_BYTES, dtype=np.uint8)
    return torch.from_numpy(raw).view(DTYPE).reshape(tokens, HIDDEN)


def matches(mm_hash: str, tensor: torch.Tensor) -> bool:
    """Every byte of `tensor` is the encoding of `mm_hash` (compared as bytes, so NaN
    patterns compare equal)."""
    expected = encoding(mm_hash, tensor.shape[0])
    return tensor.shape == expected.shape and torch.equal(
        tensor.contiguous().view(torch.uint8), expected.view(torch.uint8)
    )


def region_blocks(requests: list[ECDemoRequest], extra: Mapping[str, Any]) -> int:
    """Room for every encoding at once plus a little, so only the planned eviction
    happens; or what `ec_cpu_bytes` in the extra config asks for (a small tier evicts
    under pressure), at least room for the largest encoding."""
    if "ec_cpu_bytes" in extra:
        return max(int(extra["ec_cpu_bytes"]) // BLOCK_BYTES, max(TOKEN_CHOICES))
    return max(sum(r.tokens for r in requests) + SPARE_BLOCKS, 64)
