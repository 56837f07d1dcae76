"""vLLM 0.33.0's NIXL handshake message, as kvhandoff reads and writes it (C-01, C-04).

A side channel answers one rank's request with a handshake payload: a map of
``compatibility_hash`` and ``agent_metadata_bytes``, where the latter is itself msgpack:
the rank's agent metadata map (engine id, NIXL agent metadata, per-region base addresses,
block lengths and strides, block counts, KV layout, block size in tokens, attention
backend, physical blocks per logical block, region members, ...). The receiver checks the
hash before it decodes the inner map, so a peer with another schema fails with a clear
hash mismatch rather than a decode error.

kvhandoff adds one key to the outer map, ``kvhandoff``: what a stock vLLM peer does not
send and ignores (its decoder skips unknown keys): the kvhandoff dialect version, the
agent name, the rank's TP/PP coordinates, the NIXL backend, and the extensions the rank
speaks (C-04). A payload without it comes from a stock vLLM rank.

Unknown keys are skipped here too (a newer vLLM may add fields), so every decoder first
runs `check_msgpack` on the bytes (S-01: nesting depth and object count are bounded before
msgspec, which recurses when it skips, sees them).
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.msgpack_limits import check_msgpack
from kvhandoff.protocol.push_wire import (
    MSGPACK_DECODE_ERRORS,
    NonEmptyStr,
    NonNegativeInt,
    PositiveInt,
)

__all__ = [
    "GET_META_MSG",
    "AgentMetadataWire",
    "HandshakeWire",
    "KvhandoffExtras",
    "decode_meta_request",
    "encode_meta_request",
]

Address = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
SHORT: Final = 64
GET_META_MSG: Final = b"get_meta_msg"
"""The verb of vLLM 0.33's side-channel request ``[verb, pp_rank, tp_rank]``."""
MAX_RANK: Final = 1 << 16
_REQUEST: Final = msgspec.msgpack.Decoder(tuple[bytes, int, int])


def encode_meta_request(pp_rank: int, tp_rank: int) -> bytes:
    """The side-channel request for one rank's handshake payload."""
    return msgspec.msgpack.encode((GET_META_MSG, pp_rank, tp_rank))


def decode_meta_request(data: bytes, *, peer: str | None = None) -> tuple[int, int]:
    """(pp_rank, tp_rank) of a side-channel request; anything else raises
    `RemoteProtocolError` (S-01: bounded before msgspec sees it)."""
    check_msgpack(data, max_depth=1, max_items=4, what="side-channel request", peer=peer)
    try:
        verb, pp_rank, tp_rank = _REQUEST.decode(data)
    except MSGPACK_DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed side-channel request: {exc}", peer=peer) from exc
    if verb != GET_META_MSG:
        raise RemoteProtocolError(f"unknown side-channel request {verb[:32]!r}", peer=peer)
    if not (0 <= pp_rank < MAX_RANK and 0 <= tp_rank < MAX_RANK):
        raise RemoteProtocolError(f"no rank pp {pp_rank} / tp {tp_rank}", peer=peer)
    return pp_rank, tp_rank


class AgentMetadataWire(msgspec.Struct, kw_only=True):
    """vLLM's per-rank agent metadata; every field is on the wire, as vLLM sends it."""

    engine_id: NonEmptyStr
    agent_metadata: Annotated[bytes, msgspec.Meta(min_length=1)]
    kv_caches_base_addr: list[Address]
    device_id: NonNegativeInt
    num_blocks: NonNegativeInt
    block_lens: list[PositiveInt]
    block_strides: list[PositiveInt]
    kv_cache_layout: Annotated[str, msgspec.Meta(max_length=SHORT)]
    block_size: PositiveInt
    ssm_sizes: tuple[int, int]
    attn_backend_name: Annotated[str, msgspec.Meta(max_length=SHORT)]
    physical_blocks_per_logical_kv_block: PositiveInt
    region_num_blocks: list[PositiveInt] | None = None
    region_group_ids: list[int] | None = None
    region_names: list[Name] | None = None
    region_mem_types: list[Name] | None = None
    dcp_size: PositiveInt = 1
    pcp_size: PositiveInt = 1
    ple_block_len: int | None = None
    region_members: list[list[Name]] = msgspec.field(default_factory=list)
    packed_member_layouts: dict[Name, tuple[int, int]] = msgspec.field(default_factory=dict)


class KvhandoffExtras(msgspec.Struct, kw_only=True):
    """What a kvhandoff rank adds to its payload (ignored by a stock vLLM peer)."""

    protocol_version: int
    agent_name: NonEmptyStr
    tp_size: PositiveInt
    tp_rank: NonNegativeInt
    pp_size: PositiveInt = 1
    pp_rank: NonNegativeInt = 0
    backend: Annotated[str, msgspec.Meta(max_length=SHORT)] = ""
    extensions: tuple[Annotated[str, msgspec.Meta(max_length=SHORT)], ...] = ()
    auth_key_id: Annotated[str, msgspec.Meta(max_length=SHORT)] = ""


class HandshakeWire(msgspec.Struct, kw_only=True):
    """The outer handshake map: vLLM's two keys, and kvhandoff's extras when present."""

    compatibility_hash: Annotated[str, msgspec.Meta(max_length=128)]
    agent_metadata_bytes: bytes
    kvhandoff: KvhandoffExtras | None = None
