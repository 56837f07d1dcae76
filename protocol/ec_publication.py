"""The `ec_transfer_params` a producer publishes per `mm_hash` (R-E06).

A servable encoding is published as
`{"metadata": {...}, "peer_host": str, "peer_port": int, "size_bytes": int}`: the
model's placeholder metadata (non-empty) and the connector's handle, published together.
An encoding the producer cannot serve (never stored, or since evicted) is published as
`{"metadata": {}}`: empty metadata and no address, so the orchestrator keeps the media
and the consumer encodes locally. Anything in between (one half without the other) is
malformed. The unservable form doubles as the eviction announcement of B-01: publishing
it for an `mm_hash` withdraws an earlier publication.

vLLM 0.33.0's producer adds `modality`, `item_indices` (the positions of the `mm_hash`
among the request's multimodal items) and, on a servable entry, `shape` (`[rows, width]`
of the encoder output, which its consumer needs to read the entry); kvhandoff publishes
and accepts them too (C-03). A vLLM model that declares no placeholder fields publishes
a servable entry with empty metadata: an entry that carries vLLM's `shape` beside a full
address is servable even so.

Part of the local tier: no nixl, zmq or msgspec (R-E02).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeGuard

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "ENTRY_KEYS",
    "MAX_HOST_CHARS",
    "MAX_METADATA_DEPTH",
    "MAX_METADATA_ITEMS",
    "MAX_MM_HASH_CHARS",
    "MAX_PARAMS_ENTRIES",
    "VLLM_KEYS",
    "PublishedEncoding",
    "build_ec_transfer_params",
    "parse_ec_transfer_params",
    "publish_entry",
    "unservable_entry",
]

_ADDRESS_KEYS: Final[tuple[str, ...]] = ("peer_host", "peer_port", "size_bytes")
VLLM_KEYS: Final[tuple[str, ...]] = ("modality", "item_indices", "shape")
"""vLLM 0.33.0's further keys of an entry (C-03)."""
ENTRY_KEYS: Final[tuple[str, ...]] = ("metadata", *_ADDRESS_KEYS, *VLLM_KEYS)
MAX_ITEM_INDICES: Final[int] = 4096
MAX_SHAPE_DIMS: Final[int] = 8
MAX_MM_HASH_CHARS: Final[int] = 256
MAX_HOST_CHARS: Final[int] = 255
MAX_METADATA_DEPTH: Final[int] = 32
"""Deepest nesting of lists and objects accepted inside `metadata`."""
MAX_METADATA_ITEMS: Final[int] = 4096
"""Most values (keys and items included) one entry's `metadata` may hold."""
MAX_PARAMS_ENTRIES: Final[int] = 1024
"""Most `mm_hash`es one request's `ec_transfer_params` may name (S-01, S-03)."""


@dataclass(frozen=True, slots=True)
class PublishedEncoding:
    """One servable encoding: where to send the `XferReq` and how big the encoding is."""

    metadata: Mapping[str, Any]
    """The model's placeholder fields for the modality (non-empty)."""
    peer_host: str
    """Host of the producer's ZMQ ROUTER."""
    peer_port: int
    """Port of the producer's ZMQ ROUTER."""
    size_bytes: int
    """Bytes of the encoding; the consumer reserves blocks for it."""
    modality: str = ""
    """vLLM's `modality` ('' when not said)."""
    item_indices: tuple[int, ...] = ()
    """vLLM's `item_indices`: where the `mm_hash` sits among the request's items."""
    shape: tuple[int, ...] = ()
    """vLLM's `shape`, `(rows, width)` of the encoder output (() when not said)."""

    def __post_init__(self) -> None:
        problem = _entry_problem(
            self.metadata, self.peer_host, self.peer_port, self.size_bytes, bool(self.shape)
        ) or _vllm_problem(self.modality, self.item_indices, self.shape)
        if problem is not None:
            raise LocalProtocolError(f"invalid published encoding: {problem}")

    def to_entry(self) -> dict[str, Any]:
        """The JSON-ready entry of this encoding."""
        entry: dict[str, Any] = {
            "metadata": dict(self.metadata),
            "peer_host": self.peer_host,
            "peer_port": self.peer_port,
            "size_bytes": self.size_bytes,
        }
        if self.modality:
            entry["modality"] = self.modality
        if self.item_indices:
            entry["item_indices"] = list(self.item_indices)
        if self.shape:
            entry["shape"] = list(self.shape)
        return entry


def _vllm_problem(modality: object, item_indices: object, shape: object) -> str | None:
    """Why vLLM's further keys are malformed, or None."""
    if not isinstance(modality, str) or len(modality) > 64:
        return f"modality must be a str of at most 64 chars, got {modality!r:.80}"
    if not isinstance(item_indices, list | tuple) or len(item_indices) > MAX_ITEM_INDICES:
        return f"item_indices must be a list of at most {MAX_ITEM_INDICES} ints"
    if not all(_is_int(i) and 0 <= i < 2**31 for i in item_indices):
        return "item_indices must be non-negative ints"
    if not isinstance(shape, list | tuple) or len(shape) > MAX_SHAPE_DIMS:
        return f"shape must be a list of at most {MAX_SHAPE_DIMS} ints"
    if not all(_is_int(d) and 0 <= d < 2**63 for d in shape):
        return "shape must be non-negative ints"
    return None


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _json_problem(root: object, depth: int) -> str | None:
    """Why `root` is not bounded JSON data, or None. Iterative: no recursion to exhaust."""
    stack: list[tuple[object, int]] = [(root, depth)]
    seen = 0
    while stack:
        value, level = stack.pop()
        seen += 1
        if seen > MAX_METADATA_ITEMS:
            return f"more than {MAX_METADATA_ITEMS} values"
        if level > MAX_METADATA_DEPTH:
            return f"nested deeper than {MAX_METADATA_DEPTH}"
        if value is None or isinstance(value, str | int | float):  # bool is an int
            continue
        if isinstance(value, list | tuple):
            if len(value) > MAX_METADATA_ITEMS:
                return f"a list of more than {MAX_METADATA_ITEMS} values"
            stack.extend((item, level + 1) for item in value)
            continue
        if isinstance(value, Mapping):
            if len(value) > MAX_METADATA_ITEMS:
                return f"an object of more than {MAX_METADATA_ITEMS} keys"
            for key, item in value.items():
                if not isinstance(key, str):
                    return f"non-string key {key!r:.80}"
                stack.append((item, level + 1))
            continue
        return f"value of type {type(value).__name__} is not JSON data"
    return None


def _entry_problem(
    metadata: object, host: object, port: object, size: object, vllm_form: bool = False
) -> str | None:
    if not isinstance(metadata, Mapping) or not (metadata or vllm_form):
        return "metadata of a servable entry must be a non-empty object"
    problem = _json_problem(metadata, 1)
    if problem is not None:
        return f"metadata: {problem}"
    if (
        not isinstance(host, str)
        or not host
        or len(host) > MAX_HOST_CHARS
        or any(c.isspace() for c in host)
    ):
        return f"peer_host must be a host name or address, got {host!r:.80}"
    if not _is_int(port) or not 0 < port <= 65535:
        return f"peer_port must be an int in 1..65535, got {port!r:.80}"
    if not _is_int(size) or size <= 0:
        return f"size_bytes must be a positive int, got {size!r:.80}"
    return None


def publish_entry(
    metadata: Mapping[str, Any],
    peer_host: str,
    peer_port: int,
    size_bytes: int,
    *,
    modality: str = "",
    item_indices: tuple[int, ...] = (),
    shape: tuple[int, ...] = (),
) -> dict[str, Any]:
    """The entry of a servable encoding; `LocalProtocolError` if any half is invalid."""
    encoding = PublishedEncoding(
        dict(metadata), peer_host, peer_port, size_bytes, modality, item_indices, shape
    )
    return encoding.to_entry()


def unservable_entry(*, modality: str = "", item_indices: tuple[int, ...] = ()) -> dict[str, Any]:
    """The entry of an encoding the producer cannot serve: `{"metadata": {}}` (with
    vLLM's `modality` and `item_indices` when given)."""
    entry: dict[str, Any] = {"metadata": {}}
    if modality:
        entry["modality"] = modality
    if item_indices:
        entry["item_indices"] = list(item_indices)
    return entry


def build_ec_transfer_params(
    encodings: Mapping[str, PublishedEncoding | None],
) -> dict[str, dict[str, Any]]:
    """`ec_transfer_params` from `mm_hash -> PublishedEncoding` (None: unservable)."""
    params: dict[str, dict[str, Any]] = {}
    for mm_hash, encoding in encodings.items():
        if not isinstance(mm_hash, str) or not 0 < len(mm_hash) <= MAX_MM_HASH_CHARS:
            raise LocalProtocolError(f"mm_hash must be a non-empty str, got {mm_hash!r:.80}")
        params[mm_hash] = unservable_entry() if encoding is None else encoding.to_entry()
    return params


def _parse_entry(mm_hash: str, entry: object, peer: str | None) -> PublishedEncoding | None:
    where = f"ec_transfer_params[{mm_hash!r}]"
    if not isinstance(entry, Mapping):
        raise RemoteProtocolError(
            f"{where} must be an object, got {type(entry).__name__}", peer=peer
        )
    unknown = sorted(repr(k) for k in entry if k not in ENTRY_KEYS)
    if unknown:
        raise RemoteProtocolError(
            f"{where} has unknown key(s) {', '.join(unknown)}; accepted: {', '.join(ENTRY_KEYS)}",
            peer=peer,
        )
    if "metadata" not in entry:
        raise RemoteProtocolError(f"{where} has no metadata", peer=peer)
    metadata = entry["metadata"]
    if not isinstance(metadata, Mapping):
        raise RemoteProtocolError(
            f"{where} metadata must be an object, got {type(metadata).__name__}", peer=peer
        )
    modality = entry.get("modality", "")
    item_indices = entry.get("item_indices", ())
    shape = entry.get("shape", ())
    problem = _vllm_problem(modality, item_indices, shape)
    if problem is not None:
        raise RemoteProtocolError(f"{where}: {problem}", peer=peer)
    present = [k for k in _ADDRESS_KEYS if k in entry]
    if not metadata and not (shape and len(present) == len(_ADDRESS_KEYS)):
        if present or shape:
            raise RemoteProtocolError(
                f"{where} is half-published: empty metadata with {', '.join(present)}", peer=peer
            )
        return None
    missing = [k for k in _ADDRESS_KEYS if k not in entry]
    if missing:
        raise RemoteProtocolError(
            f"{where} is half-published: metadata without {', '.join(missing)}", peer=peer
        )
    host, port, size = entry["peer_host"], entry["peer_port"], entry["size_bytes"]
    problem = _entry_problem(metadata, host, port, size, bool(shape))
    if problem is not None:
        raise RemoteProtocolError(f"{where}: {problem}", peer=peer)
    return PublishedEncoding(
        dict(metadata), host, port, size, modality, tuple(item_indices), tuple(shape)
    )


def parse_ec_transfer_params(
    obj: object, *, peer: str | None = None
) -> dict[str, PublishedEncoding | None]:
    """Validate received `ec_transfer_params`: `mm_hash -> PublishedEncoding`, or None
    where the producer published the encoding as unservable.

    `None` (no params) gives `{}`. Malformed input, including a half-published entry, and
    any failure while reading it (S-01), raises `RemoteProtocolError`.
    """
    try:
        return _parse_params(obj, peer)
    except RemoteProtocolError:
        raise
    except Exception as exc:  # a hostile object may fail in any way: still the peer's (S-01)
        raise RemoteProtocolError(
            f"unreadable ec_transfer_params: {exc!r:.200}", peer=peer
        ) from exc


def _parse_params(obj: object, peer: str | None) -> dict[str, PublishedEncoding | None]:
    if obj is None:
        return {}
    if not isinstance(obj, Mapping):
        raise RemoteProtocolError(
            f"ec_transfer_params must be an object, got {type(obj).__name__}", peer=peer
        )
    if len(obj) > MAX_PARAMS_ENTRIES:
        raise RemoteProtocolError(
            f"ec_transfer_params names {len(obj)} encodings, more than {MAX_PARAMS_ENTRIES}",
            peer=peer,
        )
    parsed: dict[str, PublishedEncoding | None] = {}
    for mm_hash, entry in obj.items():
        if not isinstance(mm_hash, str) or not 0 < len(mm_hash) <= MAX_MM_HASH_CHARS:
            raise RemoteProtocolError(
                f"ec_transfer_params key must be an mm_hash of 1..{MAX_MM_HASH_CHARS} chars, "
                f"got {mm_hash!r:.80}",
                peer=peer,
            )
        parsed[mm_hash] = _parse_entry(mm_hash, entry, peer)
    return parsed
