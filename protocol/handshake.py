"""The side-channel handshake payload and the compatibility check (R-P15, R-P14, R-T01).

Each worker rank describes itself with one `HandshakePayload`: its NIXL agent name and
metadata, its TP/PP coordinates, per registered region the block length, capacity
(``num_blocks``), base address and, for member routing, the layer names backing the
region, and the kvhandoff extensions it speaks (C-04: ``push_fail``, and ``auth`` with
the id of the cluster key when one is configured, S-05). Regions are listed once per
physical allocation.

The engine's side channel (served by its scheduler side, which collects the ranks'
payloads) answers with one `EngineHandshake`: every rank of the engine, in global rank
order (``pp_rank * tp_size + tp_rank``), checked whole: one engine id, one TP/PP shape,
each rank exactly once. A payload whose ``protocol_version`` differs from ours is
refused before anything else is read, so a newer peer gets a clear version error rather
than an unknown-field one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Annotated, Any, Final

import msgspec

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.member_routing import MemberLayout, RemoteRoute, route_remote_regions
from kvhandoff.protocol.push_wire import (
    MSGPACK_DECODE_ERRORS,
    NonEmptyStr,
    NonNegativeInt,
    PositiveInt,
)

__all__ = [
    "DEFAULT_MAX_HANDSHAKE_BYTES",
    "DEFAULT_MAX_RANKS",
    "DEFAULT_MAX_REGIONS",
    "EXT_AUTH",
    "EXT_PUSH_FAIL",
    "HANDSHAKE_PROTOCOL_VERSION",
    "EngineHandshake",
    "HandshakePayload",
    "check_compatible",
    "compatibility_hash",
    "decode_engine_handshake",
    "decode_handshake",
    "encode_engine_handshake",
    "encode_handshake",
]

HANDSHAKE_PROTOCOL_VERSION: Final = 2
DEFAULT_MAX_RANKS: Final = 1024
EXT_PUSH_FAIL: Final = "push_fail"
"""The peer understands ``PUSH_FAIL`` notifs (B-10); a stock vLLM D does not advertise it."""
EXT_AUTH: Final = "auth"
"""The peer seals its control notifs with the cluster key whose id it advertises (S-05)."""
DEFAULT_MAX_HANDSHAKE_BYTES: Final = 16 << 20
DEFAULT_MAX_REGIONS: Final = 65536
_ADDRESS_LIMIT: Final = 1 << 64

Address = Annotated[int, msgspec.Meta(ge=0)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"\A[0-9a-f]{64}\Z")]


class HandshakePayload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What one worker tells a peer about itself; per-region tuples are index-aligned."""

    protocol_version: int
    engine_id: NonEmptyStr
    agent_name: NonEmptyStr
    agent_metadata: Annotated[bytes, msgspec.Meta(min_length=1)]
    """The NIXL agent metadata, loaded by the peer with ``add_remote_agent``."""
    tp_size: PositiveInt
    tp_rank: NonNegativeInt
    kv_block_lens: tuple[PositiveInt, ...]
    """Bytes of one physical block, per region (also the stride between blocks)."""
    num_blocks: tuple[PositiveInt, ...]
    """Physical blocks registered, per region: the region's capacity."""
    region_base_addrs: tuple[Address, ...]
    physical_blocks_per_logical: PositiveInt
    backend: NonEmptyStr
    """NIXL backend name, e.g. ``"UCX"``."""
    compatibility_hash: Sha256Hex
    region_members: tuple[tuple[NonEmptyStr, ...], ...] = ()
    """Layer names backing each region; empty when the worker does not advertise them."""
    pp_size: PositiveInt = 1
    pp_rank: NonNegativeInt = 0
    extensions: tuple[Annotated[str, msgspec.Meta(max_length=64)], ...] = ()
    """kvhandoff extensions this rank speaks (C-04)."""
    auth_key_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """Id of the cluster key this rank seals with (S-05); empty without a key."""

    @property
    def rank(self) -> int:
        """The global rank, ``pp_rank * tp_size + tp_rank``."""
        return self.pp_rank * self.tp_size + self.tp_rank


class EngineHandshake(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What an engine's side channel serves: every rank's payload, in global rank order."""

    protocol_version: int
    engine_id: NonEmptyStr
    ranks: tuple[HandshakePayload, ...]

    @property
    def tp_size(self) -> int:
        return self.ranks[0].tp_size

    @property
    def pp_size(self) -> int:
        return self.ranks[0].pp_size

    @property
    def extensions(self) -> frozenset[str]:
        return frozenset(self.ranks[0].extensions)


class _VersionProbe(msgspec.Struct):
    protocol_version: int
    engine_id: Any = None


_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(HandshakePayload)
_ENGINE_DECODER: Final = msgspec.msgpack.Decoder(EngineHandshake)
_PROBE: Final = msgspec.msgpack.Decoder(_VersionProbe)


def _problem(p: HandshakePayload, max_regions: int) -> str | None:
    """Return what is wrong across fields of a type-valid payload, or None."""
    if p.tp_rank >= p.tp_size:
        return f"tp_rank {p.tp_rank} is not below tp_size {p.tp_size}"
    if p.pp_rank >= p.pp_size:
        return f"pp_rank {p.pp_rank} is not below pp_size {p.pp_size}"
    if len(set(p.extensions)) != len(p.extensions) or len(p.extensions) > 16:
        return f"extensions {p.extensions[:16]!r} repeat or are too many"
    if (EXT_AUTH in p.extensions) != bool(p.auth_key_id):
        return "the auth extension and auth_key_id must come together"
    n = len(p.kv_block_lens)
    if not 1 <= n <= max_regions:
        return f"{n} regions, expected 1..{max_regions}"
    if len(p.num_blocks) != n or len(p.region_base_addrs) != n:
        return (
            f"per-region lists disagree: {n} kv_block_lens, {len(p.num_blocks)} num_blocks,"
            f" {len(p.region_base_addrs)} region_base_addrs"
        )
    if p.region_members and len(p.region_members) != n:
        return f"{len(p.region_members)} region_members entries for {n} regions"
    for i, members in enumerate(p.region_members):
        if not members:
            return f"region {i} advertises no members"
    for i, (base, block_len, blocks) in enumerate(
        zip(p.region_base_addrs, p.kv_block_lens, p.num_blocks, strict=True)
    ):
        if base + block_len * blocks > _ADDRESS_LIMIT:
            return f"region {i} runs past the end of the 64-bit address space"
    return None


def encode_handshake(payload: HandshakePayload) -> bytes:
    """Encode ``payload`` as msgpack, checked with the receiver's rules.

    A payload the peer would refuse raises `LocalProtocolError` here.
    """
    if payload.protocol_version != HANDSHAKE_PROTOCOL_VERSION:
        raise LocalProtocolError(
            f"handshake protocol_version {payload.protocol_version!r},"
            f" this build speaks {HANDSHAKE_PROTOCOL_VERSION}"
        )
    try:
        data = _ENCODER.encode(payload)
        _DECODER.decode(data)
    except MSGPACK_DECODE_ERRORS as exc:
        raise LocalProtocolError(
            f"cannot encode handshake of {payload.engine_id!r}: {exc}"
        ) from exc
    problem = _problem(payload, DEFAULT_MAX_REGIONS)
    if problem is not None:
        raise LocalProtocolError(f"cannot encode handshake of {payload.engine_id!r}: {problem}")
    return data


def _engine_problem(e: EngineHandshake, max_regions: int, max_ranks: int) -> str | None:
    """Return what is wrong with an engine's set of rank payloads, or None."""
    if not 1 <= len(e.ranks) <= max_ranks:
        return f"{len(e.ranks)} ranks, expected 1..{max_ranks}"
    first = e.ranks[0]
    if first.tp_size * first.pp_size != len(e.ranks):
        return f"{len(e.ranks)} ranks for tp_size {first.tp_size} x pp_size {first.pp_size}"
    shared = ("tp_size", "pp_size", "backend", "compatibility_hash", "extensions", "auth_key_id")
    for index, payload in enumerate(e.ranks):
        problem = _problem(payload, max_regions)
        if problem is not None:
            return f"rank {index}: {problem}"
        if payload.engine_id != e.engine_id:
            return f"rank {index} belongs to engine {payload.engine_id!r}"
        if payload.rank != index:
            return f"rank {index} says it is rank {payload.rank}"
        for name in shared:
            if getattr(payload, name) != getattr(first, name):
                return f"rank {index} differs from rank 0 in {name}"
    return None


def encode_engine_handshake(engine: EngineHandshake) -> bytes:
    """Encode what the engine's side channel serves, checked with the receiver's rules."""
    if engine.protocol_version != HANDSHAKE_PROTOCOL_VERSION:
        raise LocalProtocolError(
            f"handshake protocol_version {engine.protocol_version!r},"
            f" this build speaks {HANDSHAKE_PROTOCOL_VERSION}"
        )
    problem = _engine_problem(engine, DEFAULT_MAX_REGIONS, DEFAULT_MAX_RANKS)
    if problem is not None:
        raise LocalProtocolError(f"cannot encode handshake of {engine.engine_id!r}: {problem}")
    try:
        return _ENCODER.encode(engine)
    except MSGPACK_DECODE_ERRORS as exc:
        raise LocalProtocolError(f"cannot encode handshake of {engine.engine_id!r}: {exc}") from exc


def decode_engine_handshake(
    data: bytes,
    *,
    peer: str | None = None,
    max_bytes: int = DEFAULT_MAX_HANDSHAKE_BYTES,
    max_regions: int = DEFAULT_MAX_REGIONS,
    max_ranks: int = DEFAULT_MAX_RANKS,
) -> EngineHandshake:
    """Decode an engine's side-channel answer; any bad input raises `RemoteProtocolError`."""
    _check_version(data, peer, max_bytes)
    try:
        engine = _ENGINE_DECODER.decode(data)
    except MSGPACK_DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed handshake: {exc}", peer=peer) from exc
    problem = _engine_problem(engine, max_regions, max_ranks)
    if problem is not None:
        raise RemoteProtocolError(
            f"invalid handshake from engine {engine.engine_id!r}: {problem}", peer=peer
        )
    return engine


def _check_version(data: bytes, peer: str | None, max_bytes: int) -> None:
    if len(data) > max_bytes:
        raise RemoteProtocolError(
            f"handshake of {len(data)} bytes exceeds the {max_bytes}-byte cap", peer=peer
        )
    try:
        probe = _PROBE.decode(data)
    except MSGPACK_DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed handshake: {exc}", peer=peer) from exc
    if probe.protocol_version != HANDSHAKE_PROTOCOL_VERSION:
        engine = (
            f" from engine {probe.engine_id[:100]!r}" if isinstance(probe.engine_id, str) else ""
        )
        raise RemoteProtocolError(
            f"handshake{engine} speaks protocol version {probe.protocol_version},"
            f" this side speaks {HANDSHAKE_PROTOCOL_VERSION}",
            peer=peer,
        )


def decode_handshake(
    data: bytes,
    *,
    peer: str | None = None,
    max_bytes: int = DEFAULT_MAX_HANDSHAKE_BYTES,
    max_regions: int = DEFAULT_MAX_REGIONS,
) -> HandshakePayload:
    """Decode one rank's handshake payload; any bad input raises `RemoteProtocolError`."""
    _check_version(data, peer, max_bytes)
    try:
        payload = _DECODER.decode(data)
    except MSGPACK_DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed handshake: {exc}", peer=peer) from exc
    problem = _problem(payload, max_regions)
    if problem is not None:
        raise RemoteProtocolError(
            f"invalid handshake from engine {payload.engine_id!r}: {problem}", peer=peer
        )
    return payload


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


def check_compatible(
    local: HandshakePayload, remote: HandshakePayload, *, peer: str | None = None
) -> None:
    """Refuse a peer whose protocol version, backend, compatibility hash or cluster key
    differs (a side with a key talks only to peers sealing with the same key, S-05).

    Raises `RemoteProtocolError` naming both engines and the first mismatching field.
    """
    for field in ("protocol_version", "backend", "compatibility_hash", "auth_key_id"):
        mine, theirs = getattr(local, field), getattr(remote, field)
        if mine != theirs:
            raise RemoteProtocolError(
                f"engine {remote.engine_id!r} is incompatible with local engine"
                f" {local.engine_id!r}: {field} differs (local {mine!r}, remote {theirs!r})",
                peer=peer,
            )


def accept_peer(
    local: HandshakePayload, layout: MemberLayout, remote: HandshakePayload
) -> RemoteRoute:
    """The checks every transport runs on a fetched payload: compatibility first, then the
    member routing of its regions onto the local layout (R-P14, R-P15)."""
    check_compatible(local, remote, peer=remote.engine_id)
    return route_remote_regions(
        layout,
        remote.region_members,
        remote.kv_block_lens,
        remote.num_blocks,
        local_engine_id=local.engine_id,
        remote_engine_id=remote.engine_id,
        peer=remote.engine_id,
    )
