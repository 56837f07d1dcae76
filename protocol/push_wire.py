"""The PUSH_REG notif: D registers its pre-allocated blocks with P (R-P02, C-01).

Wire form: ``b"PUSH_REG:" + msgpack(map)``, sent by D's writer with NIXL ``send_notif``:
vLLM 0.33.0's map, which a stock vLLM P reads as a plain dict. It carries D's own request
id, D's coordinates (so P can handshake back to D), the *logical* block ids D allocated as
``local_block_ids`` (one list per KV cache group: kvhandoff has one group), and P's
coordinates as D learned them from the decode leg's transfer params (``remote_*``), so P
can check the registration is meant for it.

``decode_tp_rank`` is kvhandoff's addition (a stock vLLM P ignores it): which D rank
registers. A stock vLLM D omits it, because its ranks all register the same blocks; such
a registration stands for every D rank the receiving P rank writes into. Unknown keys are
skipped, like vLLM does (after `check_msgpack` bounds the bytes, S-01); a map with none
decodes without that walk (`_PushRegClosed` says why that is safe).

Member routing (R-P14) needs nothing here: the layer names backing each region travel
once per peer in the side-channel handshake (``HandshakePayload.region_members``), not
once per request.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.msgpack_limits import check_msgpack

__all__ = [
    "DEFAULT_MAX_PUSH_REG_BLOCKS",
    "DEFAULT_MAX_PUSH_REG_BYTES",
    "MSGPACK_DECODE_ERRORS",
    "PUSH_REG_PREFIX",
    "NonEmptyStr",
    "NonNegativeInt",
    "Port",
    "PositiveInt",
    "PushRegistration",
    "decode_push_reg",
    "encode_push_reg",
]

PUSH_REG_PREFIX: Final = b"PUSH_REG:"
DEFAULT_MAX_PUSH_REG_BYTES: Final = 1 << 20
DEFAULT_MAX_PUSH_REG_BLOCKS: Final = 65536

NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]

MSGPACK_DECODE_ERRORS: Final = (
    msgspec.MsgspecError,
    ValueError,
    TypeError,
    OverflowError,
    RecursionError,
)
"""What a msgspec decoder may raise on hostile bytes; decoders turn these into
`RemoteProtocolError`."""


class PushRegistration(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One D request's registration, as carried by a PUSH_REG notif.

    ``block_ids`` are D's logical block ids; P expands them with D's
    ``physical_blocks_per_logical`` (see `kvhandoff.protocol.blocks`). An empty tuple is
    legal: D has nothing to receive but P still answers with a completion notif.
    """

    request_id: NonEmptyStr
    """D's own request id; P echoes it in the completion notif."""
    decode_engine_id: NonEmptyStr
    decode_host: NonEmptyStr
    decode_port: Port
    decode_tp_size: PositiveInt
    block_ids: tuple[NonNegativeInt, ...]
    """D's logical block ids: ``local_block_ids[0]`` on the wire."""
    remote_engine_id: NonEmptyStr
    """P's engine id, as given to D in the decode leg."""
    remote_host: NonEmptyStr
    remote_port: Port
    remote_tp_size: PositiveInt
    remote_pp_size: PositiveInt = 1
    """P's pipeline-parallel size (vLLM's ``remote_pp_size``): D waits for every stage."""
    decode_tp_rank: NonNegativeInt | None = None
    """The registering D rank; None from a stock vLLM D (every rank P writes into)."""


class _PushRegWire(msgspec.Struct, frozen=True, kw_only=True):
    """The wire map (vLLM 0.33's keys, plus ``decode_tp_rank``); unknown keys skipped."""

    request_id: NonEmptyStr
    decode_engine_id: NonEmptyStr
    decode_host: NonEmptyStr
    decode_port: Port
    decode_tp_size: PositiveInt
    local_block_ids: tuple[tuple[NonNegativeInt, ...], ...]
    remote_engine_id: NonEmptyStr
    remote_host: NonEmptyStr
    remote_port: Port
    remote_tp_size: PositiveInt
    remote_pp_size: PositiveInt = 1
    decode_tp_rank: NonNegativeInt | None = None


class _PushRegClosed(_PushRegWire, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The wire map with nothing else in it: the keys vLLM 0.33 sends (and
    ``decode_tp_rank``), one KV cache group, at most the default cap of block ids.

    Decoding into it needs no structure walk first (S-01): every field has a closed type,
    so msgspec never skips an unknown value (the only place it recurses without bound)
    and refuses a wrong type, an unknown key or an array over its announced cap at its
    header, before it builds anything; an array or string that announces more than the
    bytes left is refused as truncated; so what it builds is bounded by the notif's byte
    cap. A repeated key keeps its last value, as vLLM's own dict decode does. Any other
    message, legal or not, takes the checked path; `tests/test_push_wire.py` checks the
    two paths agree on generated maps (`test_S_01_*`)."""

    local_block_ids: tuple[
        Annotated[tuple[NonNegativeInt, ...], msgspec.Meta(max_length=DEFAULT_MAX_PUSH_REG_BLOCKS)]
    ]


def _to_wire(reg: PushRegistration) -> _PushRegWire:
    return _PushRegWire(
        request_id=reg.request_id,
        decode_engine_id=reg.decode_engine_id,
        decode_host=reg.decode_host,
        decode_port=reg.decode_port,
        decode_tp_size=reg.decode_tp_size,
        local_block_ids=(reg.block_ids,),
        remote_engine_id=reg.remote_engine_id,
        remote_host=reg.remote_host,
        remote_port=reg.remote_port,
        remote_tp_size=reg.remote_tp_size,
        remote_pp_size=reg.remote_pp_size,
        decode_tp_rank=reg.decode_tp_rank,
    )


def _from_wire(wire: _PushRegWire) -> PushRegistration:
    if len(wire.local_block_ids) != 1:
        raise ValueError(
            f"local_block_ids has {len(wire.local_block_ids)} KV cache groups; kvhandoff"
            " transfers exactly one"
        )
    return PushRegistration(
        request_id=wire.request_id,
        decode_engine_id=wire.decode_engine_id,
        decode_host=wire.decode_host,
        decode_port=wire.decode_port,
        decode_tp_size=wire.decode_tp_size,
        block_ids=wire.local_block_ids[0],
        remote_engine_id=wire.remote_engine_id,
        remote_host=wire.remote_host,
        remote_port=wire.remote_port,
        remote_tp_size=wire.remote_tp_size,
        remote_pp_size=wire.remote_pp_size,
        decode_tp_rank=wire.decode_tp_rank,
    )


MAX_PUSH_REG_OTHER: Final = 256
"""Objects other than integers a `PUSH_REG` may hold (S-01): its map, a dozen keys and
their string values, the block-id lists, with room for fields a newer vLLM may add. A
hostile one full of strings is refused after these, not after `max_items`."""

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(_PushRegWire)
_CLOSED: Final = msgspec.msgpack.Decoder(_PushRegClosed)


def _problem(reg: PushRegistration, max_blocks: int) -> str | None:
    """Return what is wrong across fields of a type-valid registration, or None."""
    if reg.decode_tp_rank is not None and reg.decode_tp_rank >= reg.decode_tp_size:
        return (
            f"decode_tp_rank {reg.decode_tp_rank} is not below decode_tp_size {reg.decode_tp_size}"
        )
    if len(reg.block_ids) > max_blocks:
        return f"{len(reg.block_ids)} block ids exceed the cap of {max_blocks}"
    return None


def encode_push_reg(reg: PushRegistration) -> bytes:
    """Encode ``reg`` as ``PUSH_REG:<msgpack>``.

    The bytes are checked with the same rules the receiver applies, so a bad local
    registration raises `LocalProtocolError` here instead of failing on the peer.
    """
    problem = _problem(reg, DEFAULT_MAX_PUSH_REG_BLOCKS)
    if problem is not None:
        raise LocalProtocolError(
            f"cannot encode PUSH_REG for request {reg.request_id!r}: {problem}"
        )
    try:
        payload = _ENCODER.encode(_to_wire(reg))
        _CLOSED.decode(payload)  # the receiver's own decoder
    except MSGPACK_DECODE_ERRORS as exc:
        raise LocalProtocolError(
            f"cannot encode PUSH_REG for request {reg.request_id!r}: {exc}"
        ) from exc
    return PUSH_REG_PREFIX + payload


def decode_push_reg(
    data: bytes,
    *,
    peer: str | None = None,
    max_bytes: int = DEFAULT_MAX_PUSH_REG_BYTES,
    max_blocks: int = DEFAULT_MAX_PUSH_REG_BLOCKS,
) -> PushRegistration:
    """Decode a PUSH_REG notif; any bad input raises `RemoteProtocolError`."""
    if len(data) > max_bytes:
        raise RemoteProtocolError(
            f"PUSH_REG notif of {len(data)} bytes exceeds the {max_bytes}-byte cap", peer=peer
        )
    if not data.startswith(PUSH_REG_PREFIX):
        raise RemoteProtocolError("notif does not start with PUSH_REG:", peer=peer)
    body = memoryview(data)[len(PUSH_REG_PREFIX) :]
    try:
        wire: _PushRegWire = _CLOSED.decode(body)  # the common form, safe unwalked
    except MSGPACK_DECODE_ERRORS:
        check_msgpack(  # anything else is walked first (S-01), then decoded leniently
            body,
            max_items=2 * max_blocks + 64,
            max_other=MAX_PUSH_REG_OTHER,
            what="PUSH_REG",
            peer=peer,
        )
        try:
            wire = _DECODER.decode(body)
        except MSGPACK_DECODE_ERRORS as exc:
            raise RemoteProtocolError(f"malformed PUSH_REG: {exc}", peer=peer) from exc
    try:
        reg = _from_wire(wire)
    except MSGPACK_DECODE_ERRORS as exc:
        raise RemoteProtocolError(f"malformed PUSH_REG: {exc}", peer=peer) from exc
    problem = _problem(reg, max_blocks)
    if problem is not None:
        raise RemoteProtocolError(
            f"invalid PUSH_REG for request {reg.request_id!r}: {problem}", peer=peer
        )
    return reg
