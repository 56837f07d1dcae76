"""Control-plane messages of the encoder-cache P2P tier: `XferReq`, `XferAck`, `XferDone`.

They are msgspec structs carried as msgpack maps over the ZMQ side channel (R-E09):
the consumer's DEALER sends `XferReq` and `XferDone`, the producer's ROUTER answers
`XferAck`. This module imports msgspec, so only the P2P tier may import it (R-E02).

Envelope. Every EC message, in every connector version, is a msgpack map holding at least
`kind` (str: the message name), `version` (int), `transfer_id` (str) and `mm_hash` (str).
The decoders read that envelope leniently first, so a peer of another version can still
be answered: a foreign-version `XferReq` decodes to a placeholder request whose other
fields are empty, which `ec_grants.check_xfer_req` answers with `NACK_VERSION`; a
foreign-version
`XferAck` decodes to a `NACK_VERSION` ack. Everything else is decoded strictly (exact
types, no unknown fields, bounded sizes) and every failure raises `RemoteProtocolError`.

Exchange: the consumer picks a `transfer_id`, sends `XferReq`; the producer answers one
`XferAck`. On `OK` the producer has pinned `block_indices` for `lease_s` seconds (R-E12)
and the consumer READs them with NIXL (R-E11), then sends `XferDone` so the pin is
released without waiting for the lease. Producers should key grants by (socket identity,
transfer_id) so that one consumer cannot release another's pin.
"""

from __future__ import annotations

import math
from typing import Annotated, Final, TypeVar

import msgspec

from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, XferStatus
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.msgpack_limits import check_msgpack

__all__ = [
    "MAX_AGENT_METADATA_BYTES",
    "MAX_BLOCKS_PER_XFER",
    "MAX_DEPTH",
    "MAX_ID_CHARS",
    "MAX_XFER_ACK_BYTES",
    "MAX_XFER_DONE_BYTES",
    "MAX_XFER_REQ_BYTES",
    "XferAck",
    "XferDone",
    "XferReq",
    "decode_producer_message",
    "decode_xfer_ack",
    "decode_xfer_done",
    "decode_xfer_req",
    "encode_xfer_ack",
    "encode_xfer_done",
    "encode_xfer_req",
    "validate_grant",
]

MAX_ID_CHARS: Final[int] = 256
"""Longest transfer id, mm_hash, compatibility hash, engine id or agent name accepted."""
MAX_BLOCKS_PER_XFER: Final[int] = 1 << 18
"""Most blocks one transfer may name."""
MAX_AGENT_METADATA_BYTES: Final[int] = 1 << 20
"""Largest NIXL agent metadata an `XferAck` may carry."""
MAX_XFER_REQ_BYTES: Final[int] = 4 << 10
"""Largest encoded `XferReq` a decoder accepts."""
MAX_XFER_DONE_BYTES: Final[int] = 2 << 10
"""Largest encoded `XferDone` a decoder accepts."""
MAX_XFER_ACK_BYTES: Final[int] = 4 << 20
"""Largest encoded `XferAck` a decoder accepts."""
MAX_DEPTH: Final[int] = 8
"""Deepest nesting of arrays and maps an EC message may have (ours need 2)."""
MAX_OBJECTS_PER_REQUEST: Final[int] = 256
"""Most msgpack objects an `XferReq` or `XferDone` may hold (a map entry counts twice)."""
MAX_OBJECTS_PER_ACK: Final[int] = MAX_BLOCKS_PER_XFER + 256
"""Most msgpack objects an `XferAck` may hold: its block list and the rest."""
_MAX_U64: Final[int] = 2**64 - 1

_Id = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
_NonEmptyId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS)]
_Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCKS_PER_XFER)]
# msgpack integers stop at 2**64 - 1, so a non-negative int on the wire is a u64.
_U64 = Annotated[int, msgspec.Meta(ge=0)]
_BlockIndex = _U64
_BlockList = Annotated[list[_BlockIndex], msgspec.Meta(max_length=MAX_BLOCKS_PER_XFER)]
_AgentMetadata = Annotated[bytes, msgspec.Meta(max_length=MAX_AGENT_METADATA_BYTES)]
_Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
_Extensions = Annotated[
    tuple[Annotated[str, msgspec.Meta(max_length=64)], ...], msgspec.Meta(max_length=16)
]


class XferReq(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="XferReq"
):
    """Consumer -> producer: please grant READ access to the encoding `mm_hash`."""

    version: int
    """Connector version of the sender; `EC_CONNECTOR_VERSION` when built here."""
    transfer_id: _NonEmptyId
    """Chosen by the consumer, unique among its in-flight transfers; echoed by the ack."""
    mm_hash: _NonEmptyId
    """The encoding asked for."""
    compat_hash: _Id
    """The consumer's `compatibility_hash` (R-E10)."""
    consumer_engine_id: _Id
    """The consumer's `engine_id`."""
    consumer_agent_name: _Id
    """The consumer's NIXL agent name."""
    num_blocks: _Count
    """Blocks the consumer reserved as READ destination."""
    size_bytes: _U64
    """Bytes of the encoding, as published in `ec_transfer_params`."""
    extensions: _Extensions = ()
    """kvhandoff extensions the consumer speaks (C-04; `ec_status.EXTENSIONS`)."""


class XferAck(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="XferAck"
):
    """Producer -> consumer: the answer to one `XferReq`.

    On `OK` every field describes the grant. On a NACK only the first five fields mean
    anything and `block_indices` is empty.
    """

    version: int
    transfer_id: _NonEmptyId
    """The `XferReq.transfer_id` answered."""
    mm_hash: _NonEmptyId
    status: XferStatus
    producer_agent_name: _Id
    """Name of the producer's NIXL agent, to READ from."""
    producer_agent_metadata: _AgentMetadata = b""
    """The producer's NIXL agent metadata: loading it recovers a restarted producer
    without another handshake (R-E11)."""
    block_indices: _BlockList = msgspec.field(default_factory=list)
    """Source block indices in the producer's region, in encoding order."""
    block_size_bytes: _U64 = 0
    """Bytes per block in the producer's region."""
    size_bytes: _U64 = 0
    """Bytes of the encoding; the last block may be partly used."""
    region_base_addr: _U64 = 0
    """Address of block 0 in the producer's registered region."""
    lease_s: _Seconds = 0.0
    """Seconds the producer keeps the blocks pinned if no `XferDone` arrives (R-E12)."""
    extensions: _Extensions = ()
    """kvhandoff extensions the producer speaks (C-04): `XferDone` is sent to it only when
    it lists `xfer_done`."""


class XferDone(
    msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="kind", tag="XferDone"
):
    """Consumer -> producer: the READ of a grant finished (or was abandoned); unpin it."""

    version: int
    transfer_id: _NonEmptyId
    """The granted `XferReq.transfer_id`."""
    mm_hash: _NonEmptyId
    ok: bool
    """True when the READ completed; False when the consumer gave up on it."""


class _Envelope(msgspec.Struct):
    """The fields every EC message keeps in every version; unknown fields are ignored."""

    kind: Annotated[str, msgspec.Meta(max_length=32)]
    version: int
    transfer_id: _NonEmptyId
    mm_hash: _NonEmptyId


_ENCODER: Final = msgspec.msgpack.Encoder()
_ENVELOPE_DECODER: Final = msgspec.msgpack.Decoder(_Envelope)
_REQ_DECODER: Final = msgspec.msgpack.Decoder(XferReq)
_ACK_DECODER: Final = msgspec.msgpack.Decoder(XferAck)
_DONE_DECODER: Final = msgspec.msgpack.Decoder(XferDone)

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


# -- decoding ---------------------------------------------------------------------------


def _envelope(data: _Bytes, limit: int, peer: str | None) -> _Envelope:
    size = memoryview(data).nbytes
    if size > limit:
        raise RemoteProtocolError(
            f"EC message of {size} bytes exceeds the {limit}-byte cap", peer=peer
        )
    # Depth and object count first: nothing recursive may see what is not bounded (S-01).
    items = MAX_OBJECTS_PER_ACK if limit == MAX_XFER_ACK_BYTES else MAX_OBJECTS_PER_REQUEST
    check_msgpack(data, max_depth=MAX_DEPTH, max_items=items, what="EC message", peer=peer)
    try:
        return _ENVELOPE_DECODER.decode(data)
    except Exception as exc:  # every decode failure is the peer's, whatever its type (S-01)
        raise RemoteProtocolError(f"malformed EC message envelope: {exc}", peer=peer) from exc


def _strict(decoder: msgspec.msgpack.Decoder[_T], kind: str, data: _Bytes, peer: str | None) -> _T:
    try:
        return decoder.decode(data)
    except Exception as exc:  # every decode failure is the peer's, whatever its type (S-01)
        raise RemoteProtocolError(f"malformed {kind}: {exc}", peer=peer) from exc


def _expect_kind(env: _Envelope, kind: str, peer: str | None) -> None:
    if env.kind != kind:
        raise RemoteProtocolError(f"expected an {kind}, got kind {env.kind!r}", peer=peer)


def _req_from_envelope(env: _Envelope, data: _Bytes, peer: str | None) -> XferReq:
    if env.version != EC_CONNECTOR_VERSION:
        return XferReq(
            version=env.version,
            transfer_id=env.transfer_id,
            mm_hash=env.mm_hash,
            compat_hash="",
            consumer_engine_id="",
            consumer_agent_name="",
            num_blocks=0,
            size_bytes=0,
        )
    req = _strict(_REQ_DECODER, "XferReq", data, peer)
    if req.num_blocks == 0 or req.size_bytes == 0:
        raise RemoteProtocolError(
            f"XferReq {req.transfer_id!r} asks for {req.num_blocks} blocks of "
            f"{req.size_bytes} bytes; both must be positive",
            peer=peer,
        )
    return req


def decode_xfer_req(data: _Bytes, *, peer: str | None = None) -> XferReq:
    """Decode an `XferReq`; raises only `RemoteProtocolError`.

    A request of another connector version decodes to a placeholder that carries only its
    envelope (`version`, `transfer_id`, `mm_hash`; the rest empty or zero): answer it with
    `check_xfer_req`, which returns `NACK_VERSION` for it, and read nothing else from it.
    """
    env = _envelope(data, MAX_XFER_REQ_BYTES, peer)
    _expect_kind(env, "XferReq", peer)
    return _req_from_envelope(env, data, peer)


def _done_from_envelope(env: _Envelope, data: _Bytes, peer: str | None) -> XferDone:
    if env.version != EC_CONNECTOR_VERSION:
        raise RemoteProtocolError(
            f"XferDone of connector version {env.version}, expected {EC_CONNECTOR_VERSION}",
            peer=peer,
        )
    return _strict(_DONE_DECODER, "XferDone", data, peer)


def decode_xfer_done(data: _Bytes, *, peer: str | None = None) -> XferDone:
    """Decode an `XferDone`; raises only `RemoteProtocolError` (also on a foreign version)."""
    env = _envelope(data, MAX_XFER_DONE_BYTES, peer)
    _expect_kind(env, "XferDone", peer)
    return _done_from_envelope(env, data, peer)


def decode_producer_message(data: _Bytes, *, peer: str | None = None) -> XferReq | XferDone:
    """Decode whatever a consumer sent to the producer's ROUTER: `XferReq` or `XferDone`.

    Same rules as `decode_xfer_req` and `decode_xfer_done`; raises only `RemoteProtocolError`.
    """
    env = _envelope(data, max(MAX_XFER_REQ_BYTES, MAX_XFER_DONE_BYTES), peer)
    if env.kind == "XferReq":
        return _req_from_envelope(env, data, peer)
    if env.kind == "XferDone":
        if memoryview(data).nbytes > MAX_XFER_DONE_BYTES:
            raise RemoteProtocolError(
                f"XferDone exceeds the {MAX_XFER_DONE_BYTES}-byte cap", peer=peer
            )
        return _done_from_envelope(env, data, peer)
    raise RemoteProtocolError(f"unexpected EC message kind {env.kind!r} at producer", peer=peer)


def validate_grant(ack: XferAck, peer: str | None) -> None:
    """Raise `RemoteProtocolError` unless `ack` is coherent: an `OK` ack describes a
    grant (agent name and metadata, distinct blocks that hold `size_bytes`, a positive
    lease); a NACK grants no blocks."""
    where = f"XferAck {ack.transfer_id!r}"
    if ack.status is not XferStatus.OK:
        if ack.block_indices:
            raise RemoteProtocolError(f"{where} is {ack.status} but grants blocks", peer=peer)
        return
    n = len(ack.block_indices)
    problems: list[str] = []
    if not ack.producer_agent_name:
        problems.append("no producer_agent_name")
    if not ack.producer_agent_metadata:
        problems.append("no producer_agent_metadata")
    elif len(ack.producer_agent_metadata) > MAX_AGENT_METADATA_BYTES:
        problems.append(f"producer_agent_metadata over {MAX_AGENT_METADATA_BYTES} bytes")
    if n > MAX_BLOCKS_PER_XFER:
        problems.append(f"more than {MAX_BLOCKS_PER_XFER} block_indices")
    elif n == 0:
        problems.append("no block_indices")
    elif len(set(ack.block_indices)) != n:
        problems.append("duplicate block_indices")
    elif min(ack.block_indices) < 0:
        problems.append("negative block index")
    if ack.block_size_bytes <= 0:
        problems.append(f"block_size_bytes {ack.block_size_bytes} is not positive")
    elif n and not (n - 1) * ack.block_size_bytes < ack.size_bytes <= n * ack.block_size_bytes:
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


def decode_xfer_ack(data: _Bytes, *, peer: str | None = None) -> XferAck:
    """Decode an `XferAck`; raises only `RemoteProtocolError`.

    An ack of another connector version decodes to a `NACK_VERSION` ack for its
    `transfer_id` and `mm_hash` (its payload cannot be trusted). An `OK` ack must describe
    a coherent grant (agent name and metadata, distinct blocks that hold `size_bytes`, a
    positive lease); a NACK must grant no blocks.
    """
    env = _envelope(data, MAX_XFER_ACK_BYTES, peer)
    _expect_kind(env, "XferAck", peer)
    if env.version != EC_CONNECTOR_VERSION:
        return XferAck(
            version=env.version,
            transfer_id=env.transfer_id,
            mm_hash=env.mm_hash,
            status=XferStatus.NACK_VERSION,
            producer_agent_name="",
        )
    ack = _strict(_ACK_DECODER, "XferAck", data, peer)
    validate_grant(ack, peer)
    return ack
