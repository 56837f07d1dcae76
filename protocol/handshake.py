"""The side-channel handshake payload and the compatibility check (R-P15, R-P14, R-T01,
C-01, C-04).

Each worker rank describes itself with one `HandshakePayload`: its NIXL agent metadata,
its TP/PP coordinates, per registered region the block length, capacity (``num_blocks``),
base address and, for member routing, the layer names backing the region, and the
kvhandoff extensions it speaks (C-04: ``push_fail``, and ``auth`` with the id of the
cluster key when one is configured, S-05). Regions are listed once per physical
allocation.

On the wire a payload is vLLM 0.33.0's (`kvhandoff.protocol.nixl_wire`): a stock vLLM
peer reads what kvhandoff serves and kvhandoff reads what a stock vLLM rank serves; the
kvhandoff-only facts ride in an extra key a stock peer ignores. A side channel answers one
rank per request (``(pp_rank, tp_rank)``), so the client assembles an `EngineHandshake`
(every rank, in global rank order ``pp_rank * tp_size + tp_rank``) and checks it whole:
one engine id, one TP/PP shape, each rank exactly once. A kvhandoff payload of another
dialect version is refused before its fields are read.

Two compatibility hashes exist: `compatibility_hash` below (kvhandoff's own factors, for
kvhandoff-only deployments) and `kvhandoff.protocol.vllm_compat.VllmCompatFactors` (vLLM's
factors, required to talk to a stock vLLM peer). Both ends compare whichever they were
given, so both ends must be configured with the same kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final

import msgspec

from kvhandoff.protocol.compat_hash import compatibility_hash
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.member_routing import MemberLayout, RemoteRoute, route_remote_regions
from kvhandoff.protocol.msgpack_limits import check_msgpack
from kvhandoff.protocol.nixl_wire import AgentMetadataWire, HandshakeWire, KvhandoffExtras
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
    "Slot",
    "check_compatible",
    "compatibility_hash",
    "decode_engine_handshake",
    "decode_handshake",
    "encode_engine_handshake",
    "encode_handshake",
    "engine_bundle_parts",
]

HANDSHAKE_PROTOCOL_VERSION: Final = 3
"""kvhandoff's dialect on top of vLLM 0.33's wire (3: the vLLM form; 0 marks a stock peer)."""
DEFAULT_MAX_RANKS: Final = 1024
EXT_PUSH_FAIL: Final = "push_fail"
"""The peer understands ``PUSH_FAIL`` notifs (B-10); a stock vLLM D does not advertise it."""
EXT_AUTH: Final = "auth"
"""The peer seals its control notifs with the cluster key whose id it advertises (S-05)."""
EXT_CUDA_IPC: Final = "cuda_ipc"
"""The peer takes a D's CUDA IPC export notif and may WRITE through it on one host (issue
18); a D sends its export only to a P that advertises this, never to a stock vLLM P."""
DEFAULT_MAX_HANDSHAKE_BYTES: Final = 16 << 20
DEFAULT_MAX_REGIONS: Final = 65536
_ADDRESS_LIMIT: Final = 1 << 64

Address = Annotated[int, msgspec.Meta(ge=0)]
Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"\A[0-9a-f]{64}\Z")]


class HandshakePayload(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """What one worker rank tells a peer about itself; per-region tuples are index-aligned.

    This is kvhandoff's view of one rank; on the wire it travels in vLLM 0.33's form
    (`kvhandoff.protocol.nixl_wire`). A payload decoded from a stock vLLM rank has
    ``protocol_version`` 0, no agent name, backend or extensions, and the TP/PP
    coordinates the requester asked for."""

    protocol_version: int
    engine_id: NonEmptyStr
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
    compatibility_hash: Sha256Hex
    agent_name: str = ""
    """The NIXL agent's name; empty from a stock vLLM rank (NIXL names it on load)."""
    backend: str = ""
    """NIXL backend name, e.g. ``"UCX"``; empty from a stock vLLM rank."""
    region_members: tuple[tuple[NonEmptyStr, ...], ...] = ()
    """Layer names backing each region; empty when the worker does not advertise them."""
    pp_size: PositiveInt = 1
    pp_rank: NonNegativeInt = 0
    extensions: tuple[Annotated[str, msgspec.Meta(max_length=64)], ...] = ()
    """kvhandoff extensions this rank speaks (C-04)."""
    auth_key_id: Annotated[str, msgspec.Meta(max_length=64)] = ""
    """Id of the cluster key this rank seals with (S-05); empty without a key."""
    block_size: PositiveInt = 16
    """Tokens per logical block (vLLM compares it; kvhandoff does not)."""
    kv_cache_layout: Annotated[str, msgspec.Meta(max_length=64)] = "HND"
    attn_backend_name: Annotated[str, msgspec.Meta(max_length=64)] = ""
    device_id: NonNegativeInt = 0

    @property
    def rank(self) -> int:
        """The global rank, ``pp_rank * tp_size + tp_rank``."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def from_kvhandoff(self) -> bool:
        """True when the peer speaks kvhandoff's extras (not a stock vLLM rank)."""
        return self.protocol_version != 0


class EngineHandshake(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Every rank's payload of one engine, in global rank order (assembled by the client
    from one side-channel request per rank)."""

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


_ENCODER: Final = msgspec.msgpack.Encoder()
_WIRE: Final = msgspec.msgpack.Decoder(HandshakeWire)
_AGENT: Final = msgspec.msgpack.Decoder(AgentMetadataWire)
_BUNDLE: Final = msgspec.msgpack.Decoder(tuple[bytes, ...])
_PAYLOAD: Final = msgspec.msgpack.Decoder(HandshakePayload)
"""Re-validates a payload built from the wire against its field constraints."""


def _max_items(max_regions: int) -> int:
    """Objects a handshake of `max_regions` regions may hold (members count extra)."""
    return 64 * max_regions + 4096


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


def _to_wire(p: HandshakePayload) -> HandshakeWire:
    agent = AgentMetadataWire(
        engine_id=p.engine_id,
        agent_metadata=p.agent_metadata,
        kv_caches_base_addr=list(p.region_base_addrs),
        device_id=p.device_id,
        num_blocks=min(p.num_blocks),
        block_lens=list(p.kv_block_lens),
        block_strides=list(p.kv_block_lens),
        kv_cache_layout=p.kv_cache_layout,
        block_size=p.block_size,
        ssm_sizes=(0, 0),
        attn_backend_name=p.attn_backend_name,
        physical_blocks_per_logical_kv_block=p.physical_blocks_per_logical,
        region_num_blocks=list(p.num_blocks),
        region_members=[list(m) for m in p.region_members],
    )
    extras = KvhandoffExtras(
        protocol_version=p.protocol_version,
        agent_name=p.agent_name,
        tp_size=p.tp_size,
        tp_rank=p.tp_rank,
        pp_size=p.pp_size,
        pp_rank=p.pp_rank,
        backend=p.backend,
        extensions=p.extensions,
        auth_key_id=p.auth_key_id,
    )
    return HandshakeWire(
        compatibility_hash=p.compatibility_hash,
        agent_metadata_bytes=_ENCODER.encode(agent),
        kvhandoff=extras,
    )


def encode_handshake(payload: HandshakePayload) -> bytes:
    """Encode one rank's payload in vLLM 0.33's form with kvhandoff's extras (C-01, C-04),
    checked with the receiver's rules: a payload the peer would refuse raises
    `LocalProtocolError` here."""
    if payload.protocol_version != HANDSHAKE_PROTOCOL_VERSION:
        raise LocalProtocolError(
            f"handshake protocol_version {payload.protocol_version!r},"
            f" this build speaks {HANDSHAKE_PROTOCOL_VERSION}"
        )
    if not payload.agent_name or not payload.backend:
        raise LocalProtocolError(f"handshake of {payload.engine_id!r} lacks its agent or backend")
    problem = _problem(payload, DEFAULT_MAX_REGIONS)
    if problem is not None:
        raise LocalProtocolError(f"cannot encode handshake of {payload.engine_id!r}: {problem}")
    try:
        data = _ENCODER.encode(_to_wire(payload))
        decode_handshake(data)
    except (RemoteProtocolError, *MSGPACK_DECODE_ERRORS) as exc:
        raise LocalProtocolError(
            f"cannot encode handshake of {payload.engine_id!r}: {exc}"
        ) from exc
    return data


def _engine_problem(e: EngineHandshake, max_regions: int, max_ranks: int) -> str | None:
    """Return what is wrong with an engine's set of rank payloads, or None."""
    if not 1 <= len(e.ranks) <= max_ranks:
        return f"{len(e.ranks)} ranks, expected 1..{max_ranks}"
    first = e.ranks[0]
    if first.tp_size * first.pp_size != len(e.ranks):
        return f"{len(e.ranks)} ranks for tp_size {first.tp_size} x pp_size {first.pp_size}"
    shared = (
        "protocol_version",
        "tp_size",
        "pp_size",
        "backend",
        "compatibility_hash",
        "extensions",
        "auth_key_id",
    )
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
    """Every rank's encoded payload in one msgpack array, in rank order: the form an
    in-process holder of a whole engine passes around (a side channel given it serves
    each rank's element, `decode_engine_handshake` reads it back). Not a wire message."""
    if engine.protocol_version != HANDSHAKE_PROTOCOL_VERSION:
        raise LocalProtocolError(
            f"handshake protocol_version {engine.protocol_version!r},"
            f" this build speaks {HANDSHAKE_PROTOCOL_VERSION}"
        )
    problem = _engine_problem(engine, DEFAULT_MAX_REGIONS, DEFAULT_MAX_RANKS)
    if problem is not None:
        raise LocalProtocolError(f"cannot encode handshake of {engine.engine_id!r}: {problem}")
    return _ENCODER.encode(tuple(encode_handshake(p) for p in engine.ranks))


def engine_bundle_parts(data: bytes, *, peer: str | None = None) -> tuple[bytes, ...]:
    """The per-rank payloads of an `encode_engine_handshake` bundle."""
    check_msgpack(
        data, max_depth=2, max_items=DEFAULT_MAX_RANKS + 1, what="handshake bundle", peer=peer
    )
    try:
        return _BUNDLE.decode(data)
    except MSGPACK_DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed handshake bundle: {exc}", peer=peer) from exc


def decode_engine_handshake(
    data: bytes | Sequence[bytes],
    *,
    peer: str | None = None,
    engine_id: str | None = None,
    tp_size: int | None = None,
    pp_size: int = 1,
    max_bytes: int = DEFAULT_MAX_HANDSHAKE_BYTES,
    max_regions: int = DEFAULT_MAX_REGIONS,
    max_ranks: int = DEFAULT_MAX_RANKS,
) -> EngineHandshake:
    """Assemble an engine from its ranks' payloads (global rank order), each fetched with
    one side-channel request (or from an `encode_engine_handshake` bundle), checked whole;
    any bad input raises `RemoteProtocolError`.

    A stock vLLM rank does not say its coordinates: pass the `tp_size` and `pp_size` the
    request named (a decode leg, a registration), and `engine_id` to check it."""
    parts = engine_bundle_parts(data, peer=peer) if isinstance(data, bytes) else tuple(data)
    if not 1 <= len(parts) <= max_ranks:
        raise RemoteProtocolError(f"{len(parts)} ranks, expected 1..{max_ranks}", peer=peer)
    ranks = []
    for index, part in enumerate(parts):
        # A rank is asked for by its coordinates when the shape is known; otherwise (a
        # bundle of kvhandoff payloads) each part says its own.
        slot = None if tp_size is None else (tp_size, index % tp_size, pp_size, index // tp_size)
        ranks.append(
            decode_handshake(
                part, peer=peer, max_bytes=max_bytes, max_regions=max_regions, slot=slot
            )
        )
    engine = EngineHandshake(
        protocol_version=ranks[0].protocol_version,
        engine_id=ranks[0].engine_id,
        ranks=tuple(ranks),
    )
    if engine_id is not None and engine.engine_id != engine_id:
        raise RemoteProtocolError(
            f"the side channel serves engine {engine.engine_id!r}, not {engine_id!r}", peer=peer
        )
    problem = _engine_problem(engine, max_regions, max_ranks)
    if problem is not None:
        raise RemoteProtocolError(
            f"invalid handshake from engine {engine.engine_id!r}: {problem}", peer=peer
        )
    return engine


Slot = tuple[int, int, int, int]
"""(tp_size, tp_rank, pp_size, pp_rank) a request named: a stock vLLM rank's coordinates."""


def _from_wire(
    wire: HandshakeWire, agent: AgentMetadataWire, slot: Slot | None
) -> HandshakePayload:
    regions = len(agent.kv_caches_base_addr)
    if agent.block_strides != agent.block_lens:
        raise ValueError("block strides differ from block lengths")
    if agent.ssm_sizes != (0, 0) or agent.packed_member_layouts or agent.ple_block_len:
        raise ValueError("SSM, packed-member or PLE state is not transferred by kvhandoff")
    if agent.dcp_size != 1 or agent.pcp_size != 1:
        raise ValueError(f"DCP {agent.dcp_size} / PCP {agent.pcp_size} are not supported")
    per_region = agent.region_num_blocks
    num_blocks = tuple(per_region) if per_region is not None else (agent.num_blocks,) * regions
    extras = wire.kvhandoff
    if extras is not None:
        coords = (extras.tp_size, extras.tp_rank, extras.pp_size, extras.pp_rank)
        if slot is not None and coords != slot:
            raise ValueError(f"rank says it is TP/PP {coords}, the request asked for {slot}")
    elif slot is None:
        raise ValueError("a payload without kvhandoff extras needs the rank it was asked for")
    else:
        coords = slot
    tp_size, tp_rank, pp_size, pp_rank = coords
    return HandshakePayload(
        protocol_version=extras.protocol_version if extras is not None else 0,
        engine_id=agent.engine_id,
        agent_name=extras.agent_name if extras is not None else "",
        agent_metadata=agent.agent_metadata,
        tp_size=tp_size,
        tp_rank=tp_rank,
        pp_size=pp_size,
        pp_rank=pp_rank,
        kv_block_lens=tuple(agent.block_lens),
        num_blocks=num_blocks,
        region_base_addrs=tuple(agent.kv_caches_base_addr),
        physical_blocks_per_logical=agent.physical_blocks_per_logical_kv_block,
        backend=extras.backend if extras is not None else "",
        compatibility_hash=wire.compatibility_hash,
        region_members=tuple(tuple(m) for m in agent.region_members),
        extensions=extras.extensions if extras is not None else (),
        auth_key_id=extras.auth_key_id if extras is not None else "",
        block_size=agent.block_size,
        kv_cache_layout=agent.kv_cache_layout,
        attn_backend_name=agent.attn_backend_name,
        device_id=agent.device_id,
    )


def decode_handshake(
    data: bytes,
    *,
    peer: str | None = None,
    max_bytes: int = DEFAULT_MAX_HANDSHAKE_BYTES,
    max_regions: int = DEFAULT_MAX_REGIONS,
    slot: Slot | None = None,
) -> HandshakePayload:
    """Decode one rank's payload (vLLM 0.33's form, C-01); any bad input raises
    `RemoteProtocolError`. `slot` is the (tp_size, tp_rank, pp_size, pp_rank) the request
    named: required for a stock vLLM rank, checked against a kvhandoff rank's own word."""
    if len(data) > max_bytes:
        raise RemoteProtocolError(
            f"handshake of {len(data)} bytes exceeds the {max_bytes}-byte cap", peer=peer
        )
    items = _max_items(max_regions)
    try:
        check_msgpack(data, max_items=items, what="handshake", peer=peer)
        wire = _WIRE.decode(data)
        if wire.kvhandoff is not None and wire.kvhandoff.protocol_version != (
            HANDSHAKE_PROTOCOL_VERSION
        ):
            raise RemoteProtocolError(
                f"handshake speaks kvhandoff protocol version"
                f" {wire.kvhandoff.protocol_version}, this side speaks"
                f" {HANDSHAKE_PROTOCOL_VERSION}",
                peer=peer,
            )
        check_msgpack(wire.agent_metadata_bytes, max_items=items, what="agent metadata", peer=peer)
        agent = _AGENT.decode(wire.agent_metadata_bytes)
        payload = _PAYLOAD.decode(_ENCODER.encode(_from_wire(wire, agent, slot)))
    except RemoteProtocolError:
        raise
    except MSGPACK_DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed handshake: {exc}", peer=peer) from exc
    problem = _problem(payload, max_regions)
    if problem is not None:
        raise RemoteProtocolError(
            f"invalid handshake from engine {payload.engine_id!r}: {problem}", peer=peer
        )
    return payload


def check_compatible(
    local: HandshakePayload, remote: HandshakePayload, *, peer: str | None = None
) -> None:
    """Refuse a peer whose compatibility hash or cluster key differs (a side with a key
    talks only to peers sealing with the same key, S-05), or, when the peer speaks
    kvhandoff's extras, whose dialect version or NIXL backend differs. A stock vLLM peer
    says neither (C-01).

    Raises `RemoteProtocolError` naming both engines and the first mismatching field.
    """
    fields = ["compatibility_hash", "auth_key_id"]
    if remote.from_kvhandoff:
        fields[:0] = ["protocol_version", "backend"]
    for field in fields:
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
