"""Hypothesis strategies that build hostile encoder-cache input with structure (S-01).

Byte-level fuzzing rarely builds deep structure: a million random inputs never nested
4,000 arrays inside a well-formed `XferReq`. These strategies write msgpack by hand, so
they can make what no encoder would: a valid message with an extra field holding
thousands of nested arrays or maps, containers that announce billions of elements,
fields of the wrong msgpack type, truncations, and byte edits of valid messages. For
`ec_transfer_params` (a Python object from the request) they build deep and wide
objects and values of foreign types.

Used by `test_ec_hostile_bytes.py` (CI) and as seeds by `fuzz/decoders.py`.
"""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from kvhandoff.protocol.ec_grants import grant_ack, nack
from kvhandoff.protocol.ec_status import XferStatus
from kvhandoff.protocol.ec_wire import (
    XferDone,
    XferReq,
    encode_mem_descriptor,
    encode_xfer_ack,
    encode_xfer_done,
    encode_xfer_req,
)

__all__ = [
    "hostile_ec_message",
    "hostile_params",
    "nested",
    "valid_ec_messages",
]


def _req(**fields: Any) -> XferReq:
    base: dict[str, Any] = {
        "mm_hash": "mm-0",
        "compat_hash": "c" * 64,
        "session_id": "5e55",
        "transfer_id": "6f1c2a9e0d4b7385",
        "consumer_engine_id": "consumer",
        "consumer_agent_name": "consumer",
        "num_blocks": 2,
        "size_bytes": 16,
    }
    base.update(fields)
    return XferReq(**base)


def valid_ec_messages() -> list[bytes]:
    """One well-formed message of each kind (the seeds the mutations start from)."""
    req = _req()
    ok = grant_ack(
        req,
        producer_agent_name="producer",
        producer_agent_metadata=b"md",
        block_indices=[3, 4],
        block_size_bytes=8,
        size_bytes=16,
        region_base_addr=4096,
        lease_s=30.0,
    )
    done = XferDone(mm_hash="mm-0", transfer_id=req.transfer_id, ok=True)
    stock_req = XferReq("mm-0", "c" * 64, "5e55")  # vLLM 0.33's own form (C-03)
    stock_ok = grant_ack(
        stock_req,
        producer_agent_name="",
        producer_agent_metadata=b"md",
        block_indices=[3, 4],
        block_size_bytes=8,
        size_bytes=16,
        region_base_addr=4096,
        lease_s=30.0,
        mem_descriptor=encode_mem_descriptor(4096, 8, 8),
    )
    return [
        encode_xfer_req(req),
        encode_xfer_ack(ok),
        encode_xfer_ack(nack(req, XferStatus.NACK_NOT_READY)),
        encode_xfer_done(done),
        encode_xfer_req(stock_req),
        encode_xfer_ack(stock_ok),
        encode_xfer_ack(nack(stock_req, XferStatus.NACK_MISSING)),
    ]


def _map_header(count: int) -> bytes:
    if count < 16:
        return bytes([0x80 | count])
    if count < 2**16:
        return b"\xde" + count.to_bytes(2, "big")
    return b"\xdf" + count.to_bytes(4, "big")


def _array_header(count: int) -> bytes:
    if count < 16:
        return bytes([0x90 | count])
    if count < 2**16:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def nested(depth: int, kind: str = "array", leaf: bytes = b"\xc0") -> bytes:
    """`depth` containers, each holding the next: arrays, maps (key `k`) or both."""
    out = bytearray()
    for level in range(depth):
        use_map = kind == "map" or (kind == "mixed" and level % 2)
        out += b"\x81\xa1k" if use_map else b"\x91"
        # a map entry's value follows its key; an array's element follows the header
    out += leaf
    return bytes(out)


def _with_extra_field(message: bytes, key: bytes, value: bytes) -> bytes:
    """`message` (a msgpack map) with one more entry `key: value` at its end."""
    decoded = msgspec.msgpack.decode(message)
    assert isinstance(decoded, dict)
    body = b"".join(
        msgspec.msgpack.encode(k) + msgspec.msgpack.encode(v) for k, v in decoded.items()
    )
    return _map_header(len(decoded) + 1) + body + key + value


_WRONG_VALUES: tuple[bytes, ...] = (
    b"\xc0",  # nil
    b"\xc3",  # true
    b"\xcb" + b"\x7f\xf8" + b"\x00" * 6,  # NaN
    b"\xcf" + b"\xff" * 8,  # 2**64 - 1
    b"\xd3" + b"\x80" + b"\x00" * 7,  # -2**63
    b"\xa1x",
    b"\xc4\x01\x00",  # bin
    b"\xd4\x01\x00",  # fixext
    b"\x90",
    b"\x80",
    b"\xdd\xff\xff\xff\xff",  # array announcing 4 billion elements
    b"\xdf\xff\xff\xff\xff",  # map announcing 4 billion entries
    b"\xdb\xff\xff\xff\xff",  # str announcing 4 GiB
    b"\xc1",  # reserved
)

_FIELDS: tuple[str, ...] = (
    "type",
    "kind",
    "connector_version",
    "session_id",
    "compatibility_hash",
    "src_block_indices",
    "agent_metadata",
    "mem_descriptor",
    "transfer_id",
    "mm_hash",
    "status",
    "compat_hash",
    "consumer_engine_id",
    "consumer_agent_name",
    "num_blocks",
    "size_bytes",
    "block_indices",
    "block_size_bytes",
    "producer_agent_name",
    "producer_agent_metadata",
    "region_base_addr",
    "lease_s",
    "ok",
    "extensions",
    "unknown",
)


@st.composite
def _deep_extra_field(draw: st.DrawFn) -> bytes:
    base = draw(st.sampled_from(valid_ec_messages()))
    depth = draw(st.integers(9, 6000))
    kind = draw(st.sampled_from(["array", "map", "mixed"]))
    key = msgspec.msgpack.encode(draw(st.sampled_from(["zzz", "mm_hash", "block_indices"])))
    value = nested(depth, kind)
    if draw(st.booleans()):
        value = value[: draw(st.integers(0, len(value)))]  # truncated
    return _with_extra_field(base, key, value)


@st.composite
def _huge_container(draw: st.DrawFn) -> bytes:
    base = draw(st.sampled_from(valid_ec_messages()))
    count = draw(st.sampled_from([2**16 - 1, 2**16, 2**31, 2**32 - 1]))
    header = draw(st.sampled_from([_map_header, _array_header]))
    if draw(st.booleans()):  # the whole message claims the entries
        return header(count) + base[1:]
    key = msgspec.msgpack.encode(draw(st.sampled_from(_FIELDS)))
    return _with_extra_field(base, key, header(count) + b"\xc0" * draw(st.integers(0, 8)))


@st.composite
def _wrong_type(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["req", "ack", "done", "XferReq", "Nope", ""]))
    tag = draw(st.sampled_from(["type", "kind"]))
    fields = draw(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=10, unique=True))
    body = bytearray(_map_header(len(fields) + 1))
    body += msgspec.msgpack.encode(tag) + msgspec.msgpack.encode(kind)
    for name in fields:
        body += msgspec.msgpack.encode(name)
        body += draw(st.sampled_from((*_WRONG_VALUES, nested(draw(st.integers(1, 40))))))
    return bytes(body)


@st.composite
def _mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(valid_ec_messages())))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "splice"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.sampled_from([b"\x91" * 64, b"\xdf\xff\xff\xff\xff", b"\xc1"]))
        elif op == "delete" and at < len(data):
            del data[at : at + draw(st.integers(1, 8))]
        elif op == "splice":
            data[at:] = draw(st.sampled_from(_WRONG_VALUES))
    return bytes(data)


def hostile_ec_message() -> st.SearchStrategy[bytes]:
    """Bytes a hostile peer sends instead of an `XferReq`, `XferAck` or `XferDone`."""
    return st.one_of(_deep_extra_field(), _huge_container(), _wrong_type(), _mutated())


def _deep_object(depth: int, use_map: bool) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = {"k": value} if use_map else [value]
    return value


_foreign = st.sampled_from([object(), b"bytes", 1.5, float("nan"), {1, 2}, complex(1, 2)])


@st.composite
def hostile_params(draw: st.DrawFn) -> Any:
    """`ec_transfer_params` an orchestrator or producer could hand a consumer."""
    entry: dict[str, Any] = {
        "metadata": {"grid": [1, 2, 2]},
        "peer_host": "p",
        "peer_port": 5601,
        "size_bytes": 16,
    }
    shape = draw(st.sampled_from(["deep", "wide", "many", "foreign", "field"]))
    if shape == "deep":
        entry["metadata"] = {"x": _deep_object(draw(st.integers(33, 5000)), draw(st.booleans()))}
    elif shape == "wide":
        size = draw(st.integers(4097, 20000))
        entry["metadata"] = (
            {"x": list(range(size))} if draw(st.booleans()) else {str(i): i for i in range(size)}
        )
    elif shape == "many":
        return {f"mm{i}": dict(entry) for i in range(draw(st.integers(1025, 5000)))}
    elif shape == "foreign":
        return draw(st.one_of(_foreign, st.just([entry]), st.just({"mm": draw(_foreign)})))
    else:
        entry[draw(st.sampled_from(list(entry)))] = draw(_foreign)
    return {"mm": entry}
