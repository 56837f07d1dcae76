"""Control-plane messages of the encoder-cache P2P tier: `XferReq`, `XferAck`, `XferDone`.

The wire is vLLM 0.33.0's CPU EC connector in P2P mode (C-03): msgpack maps tagged by
`"type"` (`"req"`, `"ack"`), with fields left out at their defaults, so vLLM's connector
version never goes on the wire; statuses are vLLM's integers; a grant names the source
blocks (`src_block_indices`), the producer's NIXL agent metadata (`agent_metadata`) and
its region as vLLM's per-block descriptor list (`mem_descriptor`). The consumer's NIXL
READ carries the notif `<session_id>:<mm_hash>`, which releases the grant on a stock
producer. This module imports msgspec, so only the P2P tier may import it (R-E02).

kvhandoff's additions (C-04) are optional fields a stock vLLM peer never sends and
ignores when it receives them: a random `transfer_id` per attempt (S-02), the sizes the
consumer reserved (`num_blocks`, `size_bytes`, checked against the grant, S-04), the
names of agent and engine, `region_base_addr` / `block_size_bytes` (with the
`region_base` extension the producer leaves the descriptor list out), `lease_s`, and
`extensions`, the list each side advertises. `XferDone` (`"type": "done"`) is sent only
to a producer whose ack listed `xfer_done`; with it the consumer's READ carries no notif,
so a grant is released exactly once, by the notif or by `XferDone`.

Decoding is strict (exact types, no unknown fields, bounded sizes, depth and object
counts checked before msgspec sees the bytes, S-01) and every failure raises
`RemoteProtocolError`. One leniency: an `XferReq` of another connector version decodes
to a placeholder request that `ec_grants.check_xfer_req` answers with `NACK_VERSION`.
A message of kvhandoff's earlier dialect (a `"kind"` tag) is refused by name.
"""

from __future__ import annotations

import math
from typing import Annotated, Final, TypeVar

import msgspec

from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, XferStatus
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.msgpack_limits import check_msgpack

__all__ = [
    "DEFAULT_LEASE_S",
    "MAX_AGENT_METADATA_BYTES",
    "MAX_BLOCKS_PER_XFER",
    "MAX_DEPTH",
    "MAX_ID_CHARS",
    "MAX_MEM_DESCRIPTOR_BYTES",
    "MAX_REGION_BLOCKS",
    "MAX_XFER_ACK_BYTES",
    "MAX_XFER_DONE_BYTES",
    "MAX_XFER_REQ_BYTES",
    "XferAck",
    "XferDone",
    "XferReq",
    "decode_mem_descriptor",
    "decode_producer_message",
    "decode_xfer_ack",
    "decode_xfer_done",
    "decode_xfer_req",
    "encode_mem_descriptor",
    "encode_xfer_ack",
    "encode_xfer_done",
    "encode_xfer_req",
    "read_notif",
    "validate_grant",
]

MAX_ID_CHARS: Final[int] = 256
"""Longest transfer id, session id, mm_hash, compatibility hash, engine id or agent name."""
MAX_BLOCKS_PER_XFER: Final[int] = 1 << 18
"""Most blocks one transfer may name."""
MAX_REGION_BLOCKS: Final[int] = 1 << 20
"""Most blocks a producer's region may announce in its `mem_descriptor`."""
MAX_AGENT_METADATA_BYTES: Final[int] = 1 << 20
"""Largest NIXL agent metadata an `XferAck` may carry."""
MAX_MEM_DESCRIPTOR_BYTES: Final[int] = 15 << 20
"""Largest `mem_descriptor` (vLLM's per-block list: about 14 bytes a block)."""
MAX_XFER_REQ_BYTES: Final[int] = 4 << 10
"""Largest encoded `XferReq` a decoder accepts."""
MAX_XFER_DONE_BYTES: Final[int] = 2 << 10
"""Largest encoded `XferDone` a decoder accepts."""
MAX_XFER_ACK_BYTES: Final[int] = 16 << 20
"""Largest encoded `XferAck` a decoder accepts (the control socket's message cap)."""
MAX_DEPTH: Final[int] = 8
"""Deepest nesting of arrays and maps an EC message may have (ours need 2)."""
MAX_OBJECTS_PER_REQUEST: Final[int] = 256
"""Most msgpack objects an `XferReq` or `XferDone` may hold (a map entry counts twice)."""
MAX_OBJECTS_PER_ACK: Final[int] = MAX_BLOCKS_PER_XFER + 256
"""Most msgpack objects an `XferAck` may hold: its block list and the rest."""
DEFAULT_LEASE_S: Final[float] = 30.0
"""The pin lease of a producer that does not announce one (vLLM 0.33's, R-E12)."""
_MAX_U64: Final[int] = 2**64 - 1

_Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
_NonEmptyId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS_PER_XFER)]
# msgpack integers stop at 2**64 - 1, so a non-negative int on the wire is a u64.
_U64 = Annotated[int, msgspec.Meta(ge=0)]
_BlockIndex = _U64
_BlockList = Annotated[list[_BlockIndex], msgspec.Meta(max_length=MAX_BLOCKS_PER_XFER)]
_AgentMetadata = Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)]
_MemDescriptor = Annotated[bytes, msgspec.Meta(max_length=MAX_MEM_DESCRIPTOR_BYTES)]
_Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
_Extensions = Annotated[
    tuple[Annotated[str, msgspec.Meta(max_length=64)], ...], msgspec.Meta(max_length=16)
]
_Version = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


class XferReq(
    msgspec.Struct,
    frozen=True,
    forbid_unknown_fields=True,
    omit_defaults=True,
    tag_field="type",
    tag="req",
):
    """Consumer -> producer: please grant READ access to the encoding `mm_hash`."""

    mm_hash: _NonEmptyId
    """The encoding asked for."""
    compat_hash: _Id = msgspec.field(name="compatibility_hash")
    """The consumer's `compatibility_hash` (R-E10)."""
    session_id: _Id = ""
    """The consumer's session: with `mm_hash` it names the grant and the READ's notif."""
    version: _Version = msgspec.field(default=EC_CONNECTOR_VERSION, name="connector_version")
    """Connector version of the sender; left off the wire at `EC_CONNECTOR_VERSION`."""
    # kvhandoff extensions (C-04): a stock vLLM consumer sends none of them.
    transfer_id: _Id = ""
    """128 random bits per attempt (S-02), echoed by a kvhandoff producer's ack."""
    consumer_engine_id: _Id = ""
    consumer_agent_name: _Id = ""
    num_blocks: _Count = 0
    """Blocks the consumer reserved as READ destination (0: not said)."""
    size_bytes: _U64 = 0
    """Bytes of the encoding, as published in `ec_transfer_params` (0: not said)."""
    extensions: _Extensions = ()
    """kvhandoff extensions the consumer speaks (`ec_status.EXTENSIONS`)."""


class XferAck(
    msgspec.Struct,
    frozen=True,
    forbid_unknown_fields=True,
    omit_defaults=True,
    tag_field="type",
    tag="ack",
):
    """Producer -> consumer: the answer to one `XferReq`.

    On `OK` it describes the grant; a NACK grants no blocks. A stock vLLM producer sends
    the first six fields only (`session_id` on `OK` only); `decode_xfer_ack` derives
    `region_base_addr` and `block_size_bytes` from its `mem_descriptor`.
    """

    mm_hash: _NonEmptyId
    status: XferStatus
    session_id: _Id = ""
    """The `XferReq.session_id` answered (vLLM echoes it on `OK` only)."""
    block_indices: _BlockList = msgspec.field(default_factory=list, name="src_block_indices")
    """Source block indices in the producer's region, in encoding order."""
    producer_agent_metadata: _AgentMetadata = msgspec.field(default=b"", name="agent_metadata")
    """The producer's NIXL agent metadata: loading it recovers a restarted producer
    without another handshake (R-E11)."""
    mem_descriptor: _MemDescriptor = b""
    """vLLM's msgpack list of `(addr, size, device)` for every block of the region."""
    # kvhandoff extensions (C-04): a stock vLLM producer sends none of them.
    transfer_id: _Id = ""
    """The `XferReq.transfer_id` answered."""
    producer_agent_name: _Id = ""
    """Name of the producer's NIXL agent ('' from a stock producer: read from metadata)."""
    block_size_bytes: _U64 = 0
    """Bytes per block in the producer's region."""
    size_bytes: _U64 = 0
    """Bytes of the encoding; the last block may be partly used (0: not said)."""
    region_base_addr: _U64 = 0
    """Address of block 0 in the producer's registered region."""
    lease_s: _Seconds = 0.0
    """Seconds the producer keeps the blocks pinned without a release (0: vLLM's 30 s)."""
    extensions: _Extensions = ()
    """kvhandoff extensions the producer speaks: `XferDone` is sent to it only when it
    lists `xfer_done`."""


class XferDone(
    msgspec.Struct,
    frozen=True,
    forbid_unknown_fields=True,
    omit_defaults=True,
    tag_field="type",
    tag="done",
):
    """Consumer -> producer (kvhandoff extension): the READ of a grant finished, or was
    abandoned; unpin it. Sent only to producers that advertised `xfer_done`."""

    mm_hash: _NonEmptyId
    transfer_id: _NonEmptyId
    """The granted `XferReq.transfer_id`."""
    ok: bool = False
    """True when the READ completed; False when the consumer gave up on it."""
    session_id: _Id = ""
    version: _Version = msgspec.field(default=EC_CONNECTOR_VERSION, name="connector_version")


class _Envelope(msgspec.Struct):
    """What every message to the producer keeps in every version; the rest is ignored."""

    type: Annotated[str, msgspec.Meta(max_length=32)] = ""
    kind: Annotated[str, msgspec.Meta(max_length=32)] = ""
    mm_hash: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] = ""
    connector_version: _Version = EC_CONNECTOR_VERSION
    session_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] = ""
    transfer_id: Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)] = ""


_MemDescList = list[tuple[_U64, _U64, int]]

_ENCODER: Final = msgspec.msgpack.Encoder()
_ENVELOPE_DECODER: Final = msgspec.msgpack.Decoder(_Envelope)
_REQ_DECODER: Final = msgspec.msgpack.Decoder(XferReq)
_ACK_DECODER: Final = msgspec.msgpack.Decoder(XferAck)
_DONE_DECODER: Final = msgspec.msgpack.Decoder(XferDone)
_DESC_DECODER: Final = msgspec.msgpack.Decoder(_MemDescList)

_Bytes = bytes | bytearray | memoryview
_T = TypeVar("_T")


# -- encoding ---------------------------------------------------------------------------


def _encode(msg: XferReq | XferAck | XferDone, limit: int) -> bytes:
    try:
        data = _ENCODER.encode(msg)
    except (msgspec.EncodeError, TypeError, OverflowError) as exc:
        raise LocalProtocolError(f"cannot encode {type(msg).__name__}: {exc}") from exc
    if len(data) > limit:
        raise LocalProtocolError(
            f"encoded {type(msg).__name__} is {len(data)} bytes, over the {limit}-byte cap"
        )
    return data


def encode_xfer_req(req: XferReq) -> bytes:
    """msgpack bytes of `req`; `LocalProtocolError` if over `MAX_XFER_REQ_BYTES`."""
    return _encode(req, MAX_XFER_REQ_BYTES)


def encode_xfer_ack(ack: XferAck) -> bytes:
    """msgpack bytes of `ack`; `LocalProtocolError` if over `MAX_XFER_ACK_BYTES`."""
    return _encode(ack, MAX_XFER_ACK_BYTES)


def encode_xfer_done(done: XferDone) -> bytes:
    """msgpack bytes of `done`; `LocalProtocolError` if over `MAX_XFER_DONE_BYTES`."""
    return _encode(done, MAX_XFER_DONE_BYTES)


def encode_mem_descriptor(base_addr: int, block_size_bytes: int, num_blocks: int) -> bytes:
    """vLLM's `mem_descriptor` of a region: `(base + i * block, block, 0)` for every block."""
    if not 0 < num_blocks <= MAX_REGION_BLOCKS or block_size_bytes <= 0 or base_addr < 0:
        raise LocalProtocolError(
            f"cannot describe {num_blocks} blocks of {block_size_bytes} bytes at {base_addr}"
        )
    descs = [(base_addr + i * block_size_bytes, block_size_bytes, 0) for i in range(num_blocks)]
    return _ENCODER.encode(descs)


def read_notif(session_id: str, mm_hash: str) -> bytes:
    """The notif a consumer's READ carries; it releases the grant on the producer."""
    return f"{session_id}:{mm_hash}".encode()


# -- decoding ---------------------------------------------------------------------------


def _bounded(data: _Bytes, limit: int, items: int, what: str, peer: str | None) -> None:
    size = memoryview(data).nbytes
    if size > limit:
        raise RemoteProtocolError(f"{what} of {size} bytes exceeds the {limit}-byte cap", peer=peer)
    # Depth and object count first: nothing recursive may see what is not bounded (S-01).
    check_msgpack(data, max_depth=MAX_DEPTH, max_items=items, what=what, peer=peer)


def _envelope(data: _Bytes, limit: int, peer: str | None) -> _Envelope:
    items = MAX_OBJECTS_PER_ACK if limit == MAX_XFER_ACK_BYTES else MAX_OBJECTS_PER_REQUEST
    _bounded(data, limit, items, "EC message", peer)
    try:
        env = _ENVELOPE_DECODER.decode(data)
    except Exception as exc:  # every decode failure is the peer's, whatever its type (S-01)
        raise RemoteProtocolError(f"malformed EC message envelope: {exc}", peer=peer) from exc
    if not env.type and env.kind:
        raise RemoteProtocolError(
            f"EC message of another dialect (kind {env.kind!r}, no 'type' tag)", peer=peer
        )
    return env


def _strict(decoder: msgspec.msgpack.Decoder[_T], kind: str, data: _Bytes, peer: str | None) -> _T:
    try:
        return decoder.decode(data)
    except Exception as exc:  # every decode failure is the peer's, whatever its type (S-01)
        raise RemoteProtocolError(f"malformed {kind}: {exc}", peer=peer) from exc


def _expect_type(env: _Envelope, tag: str, peer: str | None) -> None:
    if env.type != tag:
        raise RemoteProtocolError(f"expected an EC {tag!r}, got type {env.type!r}", peer=peer)


def _req_from_envelope(env: _Envelope, data: _Bytes, peer: str | None) -> XferReq:
    if env.connector_version != EC_CONNECTOR_VERSION:
        if not env.mm_hash:
            raise RemoteProtocolError("XferReq of a foreign version names no mm_hash", peer=peer)
        return XferReq(
            mm_hash=env.mm_hash,
            compat_hash="",
            session_id=env.session_id,
            version=env.connector_version,
            transfer_id=env.transfer_id,
        )
    req = _strict(_REQ_DECODER, "XferReq", data, peer)
    if (req.num_blocks == 0) != (req.size_bytes == 0):
        raise RemoteProtocolError(
            f"XferReq for {req.mm_hash!r} asks for {req.num_blocks} blocks of "
            f"{req.size_bytes} bytes; give both or neither",
            peer=peer,
        )
    return req


def decode_xfer_req(data: _Bytes, *, peer: str | None = None) -> XferReq:
    """Decode an `XferReq`; raises only `RemoteProtocolError`.

    A request of another connector version decodes to a placeholder that carries only
    `mm_hash`, `session_id`, `transfer_id` and its version: answer it with
    `check_xfer_req`, which returns `NACK_VERSION` for it, and read nothing else from it.
    """
    env = _envelope(data, MAX_XFER_REQ_BYTES, peer)
    _expect_type(env, "req", peer)
    return _req_from_envelope(env, data, peer)


def _done_from_envelope(env: _Envelope, data: _Bytes, peer: str | None) -> XferDone:
    if env.connector_version != EC_CONNECTOR_VERSION:
        raise RemoteProtocolError(
            f"XferDone of connector version {env.connector_version}, "
            f"expected {EC_CONNECTOR_VERSION}",
            peer=peer,
        )
    return _strict(_DONE_DECODER, "XferDone", data, peer)


def decode_xfer_done(data: _Bytes, *, peer: str | None = None) -> XferDone:
    """Decode an `XferDone`; raises only `RemoteProtocolError` (also on a foreign version)."""
    env = _envelope(data, MAX_XFER_DONE_BYTES, peer)
    _expect_type(env, "done", peer)
    return _done_from_envelope(env, data, peer)


def decode_producer_message(data: _Bytes, *, peer: str | None = None) -> XferReq | XferDone:
    """Decode whatever a consumer sent to the producer's ROUTER: `XferReq` or `XferDone`.

    Same rules as `decode_xfer_req` and `decode_xfer_done`; raises only `RemoteProtocolError`.
    """
    env = _envelope(data, max(MAX_XFER_REQ_BYTES, MAX_XFER_DONE_BYTES), peer)
    if env.type == "req":
        return _req_from_envelope(env, data, peer)
    if env.type == "done":
        if memoryview(data).nbytes > MAX_XFER_DONE_BYTES:
            raise RemoteProtocolError(
                f"XferDone exceeds the {MAX_XFER_DONE_BYTES}-byte cap", peer=peer
            )
        return _done_from_envelope(env, data, peer)
    raise RemoteProtocolError(f"unexpected EC message type {env.type!r} at producer", peer=peer)


def decode_mem_descriptor(data: _Bytes, *, peer: str | None = None) -> tuple[int, int, int]:
    """`(base_addr, block_size_bytes, num_blocks)` of vLLM's `mem_descriptor`, which must
    describe equal, contiguous blocks (as vLLM builds it); `RemoteProtocolError` otherwise."""
    _bounded(data, MAX_MEM_DESCRIPTOR_BYTES, 4 * MAX_REGION_BLOCKS + 1, "mem_descriptor", peer)
    descs = _strict(_DESC_DECODER, "mem_descriptor", data, peer)
    if not descs:
        raise RemoteProtocolError("mem_descriptor describes no block", peer=peer)
    base, size, _ = descs[0]
    if size <= 0:
        raise RemoteProtocolError("mem_descriptor has an empty block", peer=peer)
    for i, (addr, length, _) in enumerate(descs):
        if length != size or addr != base + i * size:
            raise RemoteProtocolError(
                f"mem_descriptor block {i} is ({addr}, {length}); expected contiguous blocks "
                f"of {size} bytes from {base}",
                peer=peer,
            )
    if base + len(descs) * size > _MAX_U64 + 1:
        raise RemoteProtocolError("mem_descriptor extends past the 64-bit space", peer=peer)
    return base, size, len(descs)


def validate_grant(ack: XferAck, peer: str | None) -> None:
    """Raise `RemoteProtocolError` unless `ack` is coherent: an `OK` ack describes a
    grant (agent metadata, distinct blocks inside the region, blocks that hold
    `size_bytes` when it is said, a positive lease); a NACK grants no blocks."""
    where = f"XferAck for {ack.mm_hash!r}"
    if ack.status is not XferStatus.OK:
        if ack.block_indices:
            raise RemoteProtocolError(f"{where} is {ack.status} but grants blocks", peer=peer)
        return
    n = len(ack.block_indices)
    problems: list[str] = []
    if not ack.producer_agent_metadata:
        problems.append("no agent_metadata")
    elif len(ack.producer_agent_metadata) > MAX_AGENT_METADATA_BYTES:
        problems.append(f"agent_metadata over {MAX_AGENT_METADATA_BYTES} bytes")
    if n > MAX_BLOCKS_PER_XFER:
        problems.append(f"more than {MAX_BLOCKS_PER_XFER} src_block_indices")
    elif n == 0:
        problems.append("no src_block_indices")
    elif len(set(ack.block_indices)) != n:
        problems.append("duplicate src_block_indices")
    if ack.block_size_bytes <= 0:
        problems.append(f"block_size_bytes {ack.block_size_bytes} is not positive")
    elif (
        n
        and ack.size_bytes
        and not ((n - 1) * ack.block_size_bytes < ack.size_bytes <= n * ack.block_size_bytes)
    ):
        problems.append(
            f"size_bytes {ack.size_bytes} does not fit {n} blocks of {ack.block_size_bytes}"
        )
    elif n and ack.region_base_addr + (max(ack.block_indices) + 1) * ack.block_size_bytes > (
        _MAX_U64 + 1
    ):
        problems.append("blocks extend past the 64-bit address space")
    if not 0 <= ack.region_base_addr <= _MAX_U64:
        problems.append(f"region_base_addr {ack.region_base_addr} is not a 64-bit address")
    if not (math.isfinite(ack.lease_s) and ack.lease_s > 0):
        problems.append(f"lease_s {ack.lease_s} is not a positive finite number")
    if problems:
        raise RemoteProtocolError(f"{where} grant is malformed: {', '.join(problems)}", peer=peer)


def _region_of(ack: XferAck, peer: str | None) -> XferAck:
    """`ack` with `region_base_addr`, `block_size_bytes` and `lease_s` filled in from
    vLLM's fields when the producer did not send kvhandoff's (a stock producer)."""
    updates: dict[str, object] = {}
    if ack.lease_s == 0.0:
        updates["lease_s"] = DEFAULT_LEASE_S
    if ack.mem_descriptor:
        base, size, count = decode_mem_descriptor(ack.mem_descriptor, peer=peer)
        said = (ack.region_base_addr, ack.block_size_bytes)
        if ack.block_size_bytes and said != (base, size):
            raise RemoteProtocolError(
                f"XferAck for {ack.mm_hash!r} says region {said}, its mem_descriptor "
                f"{(base, size)}",
                peer=peer,
            )
        if ack.block_indices and max(ack.block_indices) >= count:
            raise RemoteProtocolError(
                f"XferAck for {ack.mm_hash!r} grants block {max(ack.block_indices)} of a "
                f"{count}-block region",
                peer=peer,
            )
        updates.update(region_base_addr=base, block_size_bytes=size)
    elif not ack.block_size_bytes:
        raise RemoteProtocolError(
            f"XferAck for {ack.mm_hash!r} names no region (no mem_descriptor, no "
            "region_base_addr / block_size_bytes)",
            peer=peer,
        )
    return msgspec.structs.replace(ack, **updates) if updates else ack


def decode_xfer_ack(data: _Bytes, *, peer: str | None = None) -> XferAck:
    """Decode an `XferAck`; raises only `RemoteProtocolError`.

    An `OK` ack must describe a coherent grant (`validate_grant`); a stock vLLM
    producer's region comes from its `mem_descriptor` (equal contiguous blocks), its
    lease is vLLM's 30 s. A NACK must grant no blocks.
    """
    env = _envelope(data, MAX_XFER_ACK_BYTES, peer)
    _expect_type(env, "ack", peer)
    ack = _strict(_ACK_DECODER, "XferAck", data, peer)
    if ack.status is XferStatus.OK:
        ack = _region_of(ack, peer)
    validate_grant(ack, peer)
    return ack
