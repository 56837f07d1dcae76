"""Status vocabulary and compatibility identity of the encoder-cache (EC) P2P tier.

This module is part of the local tier: it imports no nixl, zmq or msgspec (R-E02), so the
scheduler can classify statuses and compute its compatibility hash without the P2P stack.

- `XferStatus`: the status an `XferAck` carries (R-E08).
- `RETRYABLE_NACKS`: the one place that says which NACKs are retried; both ends consult it.
- `EC_CONNECTOR_VERSION`: the wire version of `XferReq`/`XferAck`/`XferDone` (R-E09).
- `compatibility_hash`: SHA-256 over (engine version, model, dtype, block_size_bytes) (R-E10).

The numbers, names and hash are vLLM 0.33.0's (C-03): `XferStatus` goes on the wire as the
same integers, `EC_CONNECTOR_VERSION` is vLLM's connector version, and `compatibility_hash`
gives vLLM's digest for the same four inputs, so a stock vLLM peer and kvhandoff agree.
"""

from __future__ import annotations

import hashlib
import json
from enum import IntEnum
from typing import Final

from kvhandoff.protocol.errors import LocalProtocolError

__all__ = [
    "DTYPE_SIZES",
    "EC_CONNECTOR_VERSION",
    "EXTENSIONS",
    "NACKS",
    "REGION_BASE",
    "RETRYABLE_NACKS",
    "XFER_DONE",
    "XferStatus",
    "canonical_dtype_name",
    "compatibility_hash",
    "is_retryable",
]

EC_CONNECTOR_VERSION: Final[int] = 2
"""Wire version of every EC control-plane message; a peer of another version is NACKed.
vLLM 0.33.0's connector version: both sides omit it from the wire at this value."""


XFER_DONE: Final[str] = "xfer_done"
"""Extension: the consumer ends a grant with `XferDone` (else the pin lease ends it)."""

REGION_BASE: Final[str] = "region_base"
"""Extension: the grant names the region by `region_base_addr` and `block_size_bytes`, so
the producer leaves out vLLM's per-block `mem_descriptor` for a consumer that lists it."""

EXTENSIONS: Final[tuple[str, ...]] = (
    XFER_DONE,
    REGION_BASE,
    "random_transfer_ids",
    "announced_evictions",
)
"""kvhandoff's extensions of the EC exchange, advertised in every `XferReq` and `XferAck`
(C-04): an extension is used with a peer only when that peer advertised it; a stock vLLM
peer advertises none and ignores the fields. Random transfer ids (S-02) and announced
evictions (B-01) need nothing from the peer; they are advertised so a peer can tell what
it talks to."""


class XferStatus(IntEnum):
    """The producer's answer to an `XferReq`, carried by `XferAck.status` as vLLM 0.33's
    integer (C-03); `str()` and formatting give the name (`"NACK_MISSING"`)."""

    OK = 0
    """Granted: the source blocks are pinned and may be READ."""
    NACK_MISSING = 1
    """The producer no longer holds the encoding (never stored, or evicted)."""
    NACK_INCOMPAT = 2
    """The request's compatibility hash differs from the producer's."""
    NACK_VERSION = 3
    """The request's connector version differs from the producer's."""
    NACK_INTERNAL = 4
    """The producer failed for a reason of its own."""
    NACK_NOT_READY = 5
    """The producer announced the encoding but its GPU->mmap save has not landed yet."""

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return format(self.name, spec)


NACKS: Final[frozenset[XferStatus]] = frozenset(s for s in XferStatus if s is not XferStatus.OK)
"""Every refusal status."""

RETRYABLE_NACKS: Final[frozenset[XferStatus]] = frozenset({XferStatus.NACK_NOT_READY})
"""The NACKs after which the consumer asks again next step, recording no failure (R-E08).

Every other NACK drops the in-flight entry and falls back to local encoding.
"""


def is_retryable(status: XferStatus) -> bool:
    """True when `status` is a NACK that the consumer retries (see `RETRYABLE_NACKS`)."""
    return status in RETRYABLE_NACKS


DTYPE_SIZES: Final[dict[str, int]] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "int8": 1,
    "uint8": 1,
}
"""Element size in bytes of each canonical dtype name an encoder output may have."""

_DTYPE_ALIASES: Final[dict[str, str]] = {
    "double": "float64",
    "float": "float32",
    "half": "float16",
}


def canonical_dtype_name(dtype: str) -> str:
    """The canonical name of a dtype: `torch.` prefix dropped, aliases resolved.

    `"torch.bfloat16"` -> `"bfloat16"`, `"half"` -> `"float16"`. Names outside
    `DTYPE_SIZES` and its aliases are returned without the prefix, unchanged otherwise.
    """
    if not isinstance(dtype, str) or not dtype:
        raise LocalProtocolError(f"dtype must be a non-empty str, got {dtype!r}")
    name = dtype.removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def compatibility_hash(engine_version: str, model: str, dtype: str, block_size_bytes: int) -> str:
    """SHA-256 hex digest identifying which peers may exchange encodings (R-E10).

    vLLM 0.33.0's digest (C-03): SHA-256 of the compact JSON array
    `[engine_version, model, dtype, block_size_bytes]` (JSON strings are quoted and
    escaped, so no two different tuples share an encoding), with `dtype` written as vLLM
    writes a torch dtype, `"torch.<name>"` of its canonical name
    (`canonical_dtype_name`): `"bfloat16"`, `"torch.bfloat16"` and the alias spellings
    agree, and equal vLLM's `str(torch.bfloat16)`.
    """
    if isinstance(block_size_bytes, bool) or not isinstance(block_size_bytes, int):
        raise LocalProtocolError(
            f"block_size_bytes must be an int, got {type(block_size_bytes).__name__}"
        )
    if not 0 < block_size_bytes < 2**64:
        raise LocalProtocolError(f"block_size_bytes must be in [1, 2**64), got {block_size_bytes}")
    for field, value in (("engine_version", engine_version), ("model", model)):
        if not isinstance(value, str):
            raise LocalProtocolError(f"{field} must be a str, got {type(value).__name__}")
    torch_dtype = "torch." + canonical_dtype_name(dtype)
    factors = json.dumps(
        [engine_version, model, torch_dtype, block_size_bytes], separators=(",", ":")
    )
    return hashlib.sha256(factors.encode("utf-8")).hexdigest()
