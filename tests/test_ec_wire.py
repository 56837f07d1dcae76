"""Control-plane messages of the encoder-cache P2P tier on vLLM 0.33.0's wire (C-03):
codec round trips, version and compatibility NACKs, grants, kvhandoff's optional fields
(C-04), and strict decoding of untrusted bytes (R-E09..R-E11, S-01)."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol.ec_grants import check_xfer_ack, check_xfer_req, grant_ack, nack
from kvhandoff.protocol.ec_status import (
    EC_CONNECTOR_VERSION,
    EXTENSIONS,
    NACKS,
    REGION_BASE,
    XferStatus,
    compatibility_hash,
)
from kvhandoff.protocol.ec_wire import (
    MAX_AGENT_METADATA_BYTES,
    MAX_BLOCKS_PER_XFER,
    MAX_XFER_ACK_BYTES,
    MAX_XFER_REQ_BYTES,
    XferAck,
    XferDone,
    XferReq,
    decode_mem_descriptor,
    decode_producer_message,
    decode_xfer_ack,
    decode_xfer_done,
    decode_xfer_req,
    encode_mem_descriptor,
    encode_xfer_ack,
    encode_xfer_done,
    encode_xfer_req,
)
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

HASH = compatibility_hash("0.1.0", "Qwen/Qwen3-VL-8B", "bfloat16", 8192)
BASE = 0x7F00_0000_0000


def make_req(**overrides: Any) -> XferReq:
    fields: dict[str, Any] = {
        "mm_hash": "mm-abc",
        "compat_hash": HASH,
        "session_id": "session-c",
        "transfer_id": "xfer-1",
        "consumer_engine_id": "engine-c",
        "consumer_agent_name": "agent-c",
        "num_blocks": 3,
        "size_bytes": 3 * 8192 - 100,
        "extensions": EXTENSIONS,
    }
    fields.update(overrides)
    return XferReq(**fields)


def make_grant(req: XferReq | None = None, **overrides: Any) -> XferAck:
    req = req or make_req()
    fields: dict[str, Any] = {
        "producer_agent_name": "agent-p",
        "producer_agent_metadata": b"nixl-agent-md",
        "block_indices": [7, 2, 9],
        "block_size_bytes": 8192,
        "size_bytes": req.size_bytes,
        "region_base_addr": BASE,
        "lease_s": 30.0,
        "mem_descriptor": encode_mem_descriptor(BASE, 8192, 16),
    }
    fields.update(overrides)
    return grant_ack(req, **fields)


def raw(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


# -- codec round trips -------------------------------------------------------------------

ids = st.text(min_size=1, max_size=40)

reqs = st.builds(
    XferReq,
    mm_hash=ids,
    compat_hash=st.text(max_size=64),
    session_id=st.text(max_size=40),
    transfer_id=ids,
    consumer_engine_id=st.text(max_size=40),
    consumer_agent_name=st.text(max_size=40),
    num_blocks=st.integers(1, MAX_BLOCKS_PER_XFER),
    size_bytes=st.integers(1, 2**64 - 1),
)
stock_reqs = st.builds(XferReq, mm_hash=ids, compat_hash=st.text(max_size=64), session_id=ids)


@st.composite
def grants(draw: st.DrawFn) -> XferAck:
    indices = draw(st.lists(st.integers(0, 2**20), min_size=1, max_size=64, unique=True))
    block = draw(st.integers(1, 2**20))
    n = len(indices)
    return XferAck(
        mm_hash=draw(ids),
        status=XferStatus.OK,
        session_id=draw(st.text(max_size=40)),
        block_indices=indices,
        producer_agent_metadata=draw(st.binary(min_size=1, max_size=256)),
        transfer_id=draw(ids),
        producer_agent_name=draw(ids),
        block_size_bytes=block,
        size_bytes=draw(st.integers((n - 1) * block + 1, n * block)),
        region_base_addr=draw(st.integers(0, 2**60)),
        lease_s=draw(st.floats(min_value=1e-3, max_value=1e6)),
    )


nack_acks = st.builds(
    XferAck,
    mm_hash=ids,
    status=st.sampled_from(sorted(NACKS)),
    transfer_id=st.text(max_size=40),
)

dones = st.builds(XferDone, mm_hash=ids, transfer_id=ids, ok=st.booleans())


@given(st.one_of(reqs, stock_reqs))
def test_R_E09_xfer_req_round_trips(req: XferReq) -> None:
    data = encode_xfer_req(req)
    assert decode_xfer_req(data) == req
    assert decode_producer_message(data) == req


@given(st.one_of(grants(), nack_acks))
def test_R_E09_xfer_ack_round_trips(ack: XferAck) -> None:
    assert decode_xfer_ack(encode_xfer_ack(ack)) == ack


@given(dones)
def test_R_E09_xfer_done_round_trips(done: XferDone) -> None:
    data = encode_xfer_done(done)
    assert decode_xfer_done(data) == done
    assert decode_producer_message(data) == done


def test_C_03_messages_are_vllm_maps_tagged_by_type_without_defaults() -> None:
    stock = msgspec.msgpack.decode(encode_xfer_req(XferReq("mm", HASH, "s1")))
    # vLLM 0.33 leaves fields at their defaults off, its connector version included.
    assert stock == {"type": "req", "mm_hash": "mm", "compatibility_hash": HASH, "session_id": "s1"}
    ours = msgspec.msgpack.decode(encode_xfer_req(make_req()))
    assert ours["type"] == "req" and "connector_version" not in ours
    assert ours["transfer_id"] == "xfer-1" and ours["extensions"] == list(EXTENSIONS)
    answer = msgspec.msgpack.decode(
        encode_xfer_ack(nack(XferReq("mm", HASH, "s1"), XferStatus.NACK_MISSING))
    )
    assert answer == {"type": "ack", "mm_hash": "mm", "status": 1}
    granted = msgspec.msgpack.decode(encode_xfer_ack(make_grant()))
    assert granted["type"] == "ack" and granted["status"] == 0
    assert granted["src_block_indices"] == [7, 2, 9]
    assert granted["agent_metadata"] == b"nixl-agent-md"
    assert granted["session_id"] == "session-c"
    # A consumer that advertised `region_base` gets no per-block descriptor list (C-04).
    assert "mem_descriptor" not in granted
    stock_grant = msgspec.msgpack.decode(encode_xfer_ack(make_grant(XferReq("mm-abc", HASH, "s"))))
    assert decode_mem_descriptor(stock_grant["mem_descriptor"]) == (BASE, 8192, 16)


def test_C_03_stock_grant_region_comes_from_its_mem_descriptor() -> None:
    data = raw(
        type="ack",
        mm_hash="mm",
        status=0,
        session_id="s",
        src_block_indices=[3, 1],
        agent_metadata=b"md",
        mem_descriptor=encode_mem_descriptor(4096, 64, 8),
    )
    ack = decode_xfer_ack(data)
    assert (ack.region_base_addr, ack.block_size_bytes, ack.lease_s) == (4096, 64, 30.0)
    assert (ack.transfer_id, ack.producer_agent_name, ack.size_bytes) == ("", "", 0)
    past_end = raw(
        type="ack",
        mm_hash="mm",
        status=0,
        src_block_indices=[8],
        agent_metadata=b"md",
        mem_descriptor=encode_mem_descriptor(4096, 64, 8),
    )
    with pytest.raises(RemoteProtocolError, match="8-block region"):
        decode_xfer_ack(past_end)
    gappy = msgspec.msgpack.encode([(4096, 64, 0), (4096 + 128, 64, 0)])
    with pytest.raises(RemoteProtocolError, match="contiguous"):
        decode_mem_descriptor(gappy)
    with pytest.raises(RemoteProtocolError, match="names no region"):
        decode_xfer_ack(
            raw(type="ack", mm_hash="m", status=0, src_block_indices=[1], agent_metadata=b"x")
        )


# -- version and compatibility NACKs -----------------------------------------------------


def test_R_E09_foreign_version_request_is_nacked_version_before_compat() -> None:
    data = raw(type="req", connector_version=3, mm_hash="mm", session_id="s", future=[1, 2])
    req = decode_xfer_req(data, peer="c1")
    assert (req.version, req.session_id, req.mm_hash) == (3, "s", "mm")
    # Its compat hash is empty (a mismatch too), but the version is answered first.
    assert check_xfer_req(req, expected_hash=HASH) is XferStatus.NACK_VERSION
    answer = nack(req, XferStatus.NACK_VERSION, producer_agent_name="agent-p")
    assert decode_xfer_ack(encode_xfer_ack(answer)).status is XferStatus.NACK_VERSION


def test_R_E09_version_checked_before_compat_on_a_local_request() -> None:
    req = make_req(version=EC_CONNECTOR_VERSION + 1, compat_hash="other")
    assert check_xfer_req(req, expected_hash=HASH) is XferStatus.NACK_VERSION


def test_R_E10_different_compat_hash_is_nacked_incompat() -> None:
    req = decode_xfer_req(encode_xfer_req(make_req(compat_hash="f" * 64)))
    assert check_xfer_req(req, expected_hash=HASH) is XferStatus.NACK_INCOMPAT
    assert check_xfer_req(make_req(), expected_hash=HASH) is None


def test_C_03_request_without_session_or_transfer_id_is_nacked_internal() -> None:
    req = decode_xfer_req(raw(type="req", mm_hash="mm", compatibility_hash=HASH))
    assert check_xfer_req(req, expected_hash=HASH) is XferStatus.NACK_INTERNAL
    assert check_xfer_req(XferReq("mm", HASH, "s"), expected_hash=HASH) is None


def test_R_E09_foreign_version_done_is_rejected() -> None:
    data = raw(type="done", connector_version=5, transfer_id="t1", mm_hash="mm", ok=True)
    with pytest.raises(RemoteProtocolError, match="version 5"):
        decode_xfer_done(data)
    with pytest.raises(RemoteProtocolError, match="version 5"):
        decode_producer_message(data)


def test_C_03_the_earlier_kind_dialect_is_refused_by_name() -> None:
    data = raw(kind="XferReq", version=1, transfer_id="t", mm_hash="m")
    for decode in (decode_xfer_req, decode_producer_message, decode_xfer_ack):
        with pytest.raises(RemoteProtocolError, match="another dialect"):
            decode(data)


# -- grants (R-E11) ----------------------------------------------------------------------


def test_R_E11_ok_ack_carries_producer_agent_metadata() -> None:
    ack = decode_xfer_ack(encode_xfer_ack(make_grant()))
    assert ack.status is XferStatus.OK
    assert ack.producer_agent_metadata == b"nixl-agent-md"
    assert ack.producer_agent_name == "agent-p"
    assert ack.block_indices == [7, 2, 9]
    assert ack.region_base_addr == BASE
    assert ack.lease_s == 30.0
    assert REGION_BASE in ack.extensions


def test_R_E11_ok_ack_without_agent_metadata_is_rejected() -> None:
    with pytest.raises(LocalProtocolError, match="agent_metadata"):
        make_grant(producer_agent_metadata=b"")
    forged = XferAck(
        mm_hash="m",
        status=XferStatus.OK,
        block_indices=[1],
        transfer_id="t",
        block_size_bytes=16,
        size_bytes=16,
        lease_s=1.0,
    )
    with pytest.raises(RemoteProtocolError, match="agent_metadata"):
        decode_xfer_ack(encode_xfer_ack(forged), peer="p1")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"block_indices": []}, "no src_block_indices"),
        ({"block_indices": [1, 1, 2]}, "duplicate"),
        ({"size_bytes": 3 * 8192 + 1}, "does not fit"),
        ({"size_bytes": 2 * 8192}, "does not fit"),
        ({"block_size_bytes": 0}, "block_size_bytes"),
        ({"lease_s": 0.0}, "lease_s"),
        ({"lease_s": math.inf}, "lease_s"),
        ({"region_base_addr": 2**64 - 8192}, "64-bit"),
    ],
)
def test_R_E11_incoherent_grants_are_refused_locally(override: dict[str, Any], match: str) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        make_grant(**override)


def test_R_E08_nack_grants_no_blocks() -> None:
    with pytest.raises(LocalProtocolError, match="NACK status"):
        nack(make_req(), XferStatus.OK)
    forged = raw(type="ack", mm_hash="m", status=1, src_block_indices=[1])
    with pytest.raises(RemoteProtocolError, match="grants blocks"):
        decode_xfer_ack(forged)


def test_R_E07_check_xfer_ack_matches_the_request() -> None:
    req = make_req()
    check_xfer_ack(make_grant(req), req, block_size_bytes=8192)
    check_xfer_ack(nack(req, XferStatus.NACK_NOT_READY), req)
    other = make_req(transfer_id="xfer-2")
    with pytest.raises(RemoteProtocolError, match="does not answer"):
        check_xfer_ack(make_grant(other), req, peer="p1")
    with pytest.raises(RemoteProtocolError, match="does not answer"):
        check_xfer_ack(make_grant(make_req(session_id="someone")), req, peer="p1")
    short = make_req(num_blocks=2, size_bytes=2 * 8192)
    with pytest.raises(RemoteProtocolError, match="requested 3"):
        check_xfer_ack(make_grant(req), make_req(num_blocks=3, size_bytes=short.size_bytes))
    with pytest.raises(RemoteProtocolError, match="local layout uses 4096"):
        check_xfer_ack(make_grant(req), req, block_size_bytes=4096)


# -- strict decoding ---------------------------------------------------------------------


def _req_fields(**overrides: Any) -> dict[str, Any]:
    fields = msgspec.msgpack.decode(encode_xfer_req(make_req()))
    assert isinstance(fields, dict)
    fields.update(overrides)
    return fields


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_blocks": True},
        {"num_blocks": 3.0},
        {"num_blocks": 0},
        {"num_blocks": MAX_BLOCKS_PER_XFER + 1},
        {"size_bytes": -1},
        {"size_bytes": 0},
        {"mm_hash": ""},
        {"mm_hash": 7},
        {"compatibility_hash": "x" * 1000},
        {"surprise": 1},
    ],
)
def test_R_E09_strict_request_decoding(overrides: dict[str, Any]) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_xfer_req(msgspec.msgpack.encode(_req_fields(**overrides)))


def test_R_E08_unknown_status_is_a_remote_error() -> None:
    for status in (6, -1, "NACK_MISSING"):
        data = raw(type="ack", mm_hash="m", status=status)
        with pytest.raises(RemoteProtocolError, match="status"):
            decode_xfer_ack(data, peer="producer-1")


def test_R_E09_oversized_message_is_refused_before_parsing() -> None:
    data = raw(type="req", mm_hash="m", session_id="s", pad="x" * 5000)
    assert len(data) > MAX_XFER_REQ_BYTES
    with pytest.raises(RemoteProtocolError, match=r"cap \(peer consumer-7\)"):
        decode_xfer_req(data, peer="consumer-7")


def test_R_E09_oversized_grants_are_refused_locally() -> None:
    with pytest.raises(LocalProtocolError, match="agent_metadata"):
        make_grant(producer_agent_metadata=b"m" * (MAX_AGENT_METADATA_BYTES + 1))
    with pytest.raises(LocalProtocolError, match="src_block_indices"):
        make_grant(block_indices=list(range(MAX_BLOCKS_PER_XFER + 1)))
    huge = XferAck(
        mm_hash="m",
        status=XferStatus.NACK_INTERNAL,
        producer_agent_metadata=b"m" * MAX_XFER_ACK_BYTES,
    )
    with pytest.raises(LocalProtocolError, match="cap"):
        encode_xfer_ack(huge)


def test_R_E09_wrong_type_is_refused() -> None:
    ack_bytes = encode_xfer_ack(nack(make_req(), XferStatus.NACK_MISSING))
    with pytest.raises(RemoteProtocolError, match="expected an EC 'req'"):
        decode_xfer_req(ack_bytes)
    with pytest.raises(RemoteProtocolError, match="unexpected EC message type 'ack'"):
        decode_producer_message(ack_bytes)
    with pytest.raises(RemoteProtocolError, match="expected an EC 'ack'"):
        decode_xfer_ack(encode_xfer_req(make_req()))


DECODERS = (
    decode_xfer_req,
    decode_xfer_ack,
    decode_xfer_done,
    decode_producer_message,
    decode_mem_descriptor,
)


@settings(max_examples=300)
@given(st.binary(max_size=512))
def test_R_E09_decoders_on_arbitrary_bytes_raise_only_remote_errors(data: bytes) -> None:
    for decode in DECODERS:
        try:
            decode(data, peer="fuzz")
        except RemoteProtocolError as exc:
            assert exc.peer == "fuzz"


wire_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**64 - 1),
        st.floats(),
        st.text(max_size=20),
        st.binary(max_size=20),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=12,
)
wire_keys = st.sampled_from(
    [
        "type",
        "kind",
        "connector_version",
        "session_id",
        "transfer_id",
        "mm_hash",
        "status",
        "compatibility_hash",
        "num_blocks",
        "size_bytes",
        "src_block_indices",
        "block_size_bytes",
        "agent_metadata",
        "mem_descriptor",
        "lease_s",
        "ok",
        "other",
    ]
)


@settings(max_examples=300)
@given(
    kind=st.sampled_from(["req", "ack", "done", "Nope"]),
    version=st.one_of(st.just(EC_CONNECTOR_VERSION), wire_values),
    fields=st.dictionaries(wire_keys, wire_values, max_size=8),
)
def test_R_E09_decoders_on_structured_junk_raise_only_remote_errors(
    kind: str, version: Any, fields: dict[str, Any]
) -> None:
    message = {"type": kind, "connector_version": version, "mm_hash": "m", **fields}
    data = msgspec.msgpack.encode(message)
    for decode in DECODERS:
        try:
            decoded = decode(data)
        except RemoteProtocolError:
            continue
        assert isinstance(decoded, XferReq | XferAck | XferDone | tuple)
