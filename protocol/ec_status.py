"""Status vocabulary and compatibility identity of the encoder-cache (EC) P2P tier.

This module is part of the local tier: it imports no nixl, zmq or msgspec (R-E02), so the
scheduler can classify statuses and compute its compatibility hash without the P2P stack.

- `XferStatus`: the status an `XferAck` carries (R-E08).
- `RETRYABLE_NACKS`: the one place that says which NACKs are retried; both ends consult it.
- `EC_CONNECTOR_VERSION`: the wire version of `XferReq`/`XferAck`/`XferDone` (R-E09).
- `compatibility_hash`: SHA-256 over (engine version, model, dtype, block_size_bytes) (R-E10).
"""

from __future__ import annotations

import hashlib
from enum import StrEnum
from typing import Final

from kvhandoff.protocol.errors import LocalProtocolError

__all__ = [
    "DTYPE_SIZES",
    "EC_CONNECTOR_VERSION",
    "EXTENSIONS",
    "NACKS",
    "RETRYABLE_NACKS",
    "XFER_DONE",
    "XferStatus",
    "canonical_dtype_name",
    "compatibility_hash",
    "is_retryable",
]

EC_CONNECTOR_VERSION: Final[int] = 1
"""Wire version of every EC control-plane message; a peer of another version is NACKed."""


XFER_DONE: Final[str] = "xfer_done"
"""Extension: the consumer ends a grant with `XferDone` (else the pin lease ends it)."""

EXTENSIONS: Final[tuple[str, ...]] = (XFER_DONE, "random_transfer_ids", "announced_evictions")
"""kvhandoff's extensions of the EC exchange, advertised in every `XferReq` and `XferAck`
(C-04): an extension is used with a peer only when that peer advertised it. Random
transfer ids (S-02) and announced evictions (B-01) need nothing from the peer; they are
advertised so a peer can tell what it talks to."""


class XferStatus(StrEnum):
    """The producer's answer to an `XferReq`, carried by `XferAck.status`."""

    OK = "OK"
    """Granted: the source blocks are pinned and may be READ."""
    NACK_MISSING = "NACK_MISSING"
    """The producer no longer holds the encoding (never stored, or evicted)."""
    NACK_NOT_READY = "NACK_NOT_READY"
    """The producer announced the encoding but its GPU->mmap save has not landed yet."""
    NACK_INCOMPAT = "NACK_INCOMPAT"
    """The request's compatibility hash differs from the producer's."""
    NACK_VERSION = "NACK_VERSION"
    """The request's connector version differs from the producer's."""
    NACK_INTERNAL = "NACK_INTERNAL"
    """The producer failed for a reason of its own."""


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


_HASH_DOMAIN: Final[bytes] = b"kvhandoff/ec-compat/v1\x00"


def _length_prefixed(field: str, value: str) -> bytes:
    if not isinstance(value, str):
        raise LocalProtocolError(f"{field} must be a str, got {type(value).__name__}")
    raw = value.encode("utf-8", "surrogatepass")
    return len(raw).to_bytes(8, "big") + raw


def compatibility_hash(engine_version: str, model: str, dtype: str, block_size_bytes: int) -> str:
    """SHA-256 hex digest identifying which peers may exchange encodings (R-E10).

    The fields are encoded unambiguously: a domain tag, then each string as an 8-byte
    big-endian length followed by its UTF-8 bytes, then `block_size_bytes` as an 8-byte
    big-endian integer; so no two different field tuples share an encoding. `dtype` is
    canonicalised first (`canonical_dtype_name`), so `"torch.float16"` and `"half"` agree.
    """
    if isinstance(block_size_bytes, bool) or not isinstance(block_size_bytes, int):
        raise LocalProtocolError(
            f"block_size_bytes must be an int, got {type(block_size_bytes).__name__}"
        )
    if not 0 < block_size_bytes < 2**64:
        raise LocalProtocolError(f"block_size_bytes must be in [1, 2**64), got {block_size_bytes}")
    digest = hashlib.sha256(_HASH_DOMAIN)
    digest.update(_length_prefixed("engine_version", engine_version))
    digest.update(_length_prefixed("model", model))
    digest.update(_length_prefixed("dtype", canonical_dtype_name(dtype)))
    digest.update(block_size_bytes.to_bytes(8, "big"))
    return digest.hexdigest()
