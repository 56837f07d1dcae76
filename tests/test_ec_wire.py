"""Control-plane messages of the encoder-cache P2P tier: codec round trips, version and
compatibility NACKs, grants, and strict decoding of untrusted bytes (R-E09..R-E11)."""

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
    NACKS,
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
    decode_producer_message,
    decode_xfer_ack,
    decode_xfer_done,
    decode_xfer_req,
    encode_xfer_ack,
    encode_xfer_done,
    encode_xfer_req,
)
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

HASH = compatibility_hash("0.1.0", "Qwen/Qwen3-VL-8B", "bfloat16", 8192)


def make_req(**overrides: Any) -> XferReq:
    fields: dict[str, Any] = {
        "version": EC_CONNECTOR_VERSION,
        "transfer_id": "xfer-1",
        "mm_hash": "mm-abc",
        "compat_hash": HASH,
        "consumer_engine_id": "engine-c",
        "consumer_agent_name": "agent-c",
        "num_blocks": 3,
        "size_bytes": 3 * 8192 - 100,
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
        "region_base_addr": 0x7F00_0000_0000,
        "lease_s": 30.0,
    }
    fields.update(overrides)
    return grant_ack(req, **fields)


def raw(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


# -- codec round trips -------------------------------------------------------------------

ids = st.text(min_size=1, max_size=40)

reqs = st.builds(
    XferReq,
    version=st.just(EC_CONNECTOR_VERSION),
    transfer_id=ids,
    mm_hash=ids,
    compat_hash=st.text(max_size=64),
    consumer_engine_id=st.text(max_size=40),
    consumer_agent_name=st.text(max_size=40),
    num_blocks=st.integers(1, MAX_BLOCKS_PER_XFER),
    size_bytes=st.integers(1, 2**64 - 1),
)


@st.composite
def grants(draw: st.DrawFn) -> XferAck:
    indices = draw(st.lists(st.integers(0, 2**20), min_size=1, max_size=64, unique=True))
    block = draw(st.integers(1, 2**20))
    n = len(indices)
    return XferAck(
        version=EC_CONNECTOR_VERSION,
        transfer_id=draw(ids),
        mm_hash=draw(ids),
        status=XferStatus.OK,
        producer_agent_name=draw(ids),
        producer_agent_metadata=draw(st.binary(min_size=1, max_size=256)),
        block_indices=indices,
        block_size_bytes=block,
        size_bytes=draw(st.integers((n - 1) * block + 1, n * block)),
        region_base_addr=draw(st.integers(0, 2**60)),
        lease_s=draw(st.floats(min_value=1e-3, max_value=1e6)),
    )


nack_acks = st.builds(
    XferAck,
    version=st.just(EC_CONNECTOR_VERSION),
    transfer_id=ids,
    mm_hash=ids,
    status=st.sampled_from(sorted(NACKS)),
    producer_agent_name=st.text(max_size=40),
)

dones = st.builds(
    XferDone, version=st.just(EC_CONNECTOR_VERSION), transfer_id=ids, mm_hash=ids, ok=st.booleans()
)


@given(reqs)
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


def test_R_E09_messages_are_msgpack_maps_tagged_by_kind() -> None:
    decoded = msgspec.msgpack.decode(encode_xfer_req(make_req()))
    assert decoded["kind"] == "XferReq"
    assert decoded["version"] == EC_CONNECTOR_VERSION
    assert decoded["transfer_id"] == "xfer-1"


# -- version and compatibility NACKs -----------------------------------------------------


def test_R_E09_foreign_version_request_is_nacked_version_before_compat() -> None:
    data = raw(kind="XferReq", version=2, transfer_id="t9", mm_hash="mm", future_field=[1, 2])
    req = decode_xfer_req(data, peer="c1")
    assert (req.version, req.transfer_id, req.mm_hash) == (2, "t9", "mm")
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


def test_R_E09_foreign_version_ack_reads_as_nack_version() -> None:
    data = raw(kind="XferAck", version=0, transfer_id="t1", mm_hash="mm", status="OK", x=b"?")
    ack = decode_xfer_ack(data)
    assert ack.status is XferStatus.NACK_VERSION
    assert (ack.transfer_id, ack.mm_hash, ack.block_indices) == ("t1", "mm", [])


def test_R_E09_foreign_version_done_is_rejected() -> None:
    data = raw(kind="XferDone", version=5, transfer_id="t1", mm_hash="mm", ok=True)
    with pytest.raises(RemoteProtocolError, match="version 5"):
        decode_xfer_done(data)
    with pytest.raises(RemoteProtocolError, match="version 5"):
        decode_producer_message(data)


# -- grants (R-E11) ----------------------------------------------------------------------


def test_R_E11_ok_ack_carries_producer_agent_metadata() -> None:
    ack = decode_xfer_ack(encode_xfer_ack(make_grant()))
    assert ack.status is XferStatus.OK
    assert ack.producer_agent_metadata == b"nixl-agent-md"
    assert ack.producer_agent_name == "agent-p"
    assert ack.block_indices == [7, 2, 9]
    assert ack.region_base_addr == 0x7F00_0000_0000
    assert ack.lease_s == 30.0


def test_R_E11_ok_ack_without_agent_metadata_is_rejected() -> None:
    with pytest.raises(LocalProtocolError, match="producer_agent_metadata"):
        make_grant(producer_agent_metadata=b"")
    forged = XferAck(
        version=EC_CONNECTOR_VERSION,
        transfer_id="t",
        mm_hash="m",
        status=XferStatus.OK,
        producer_agent_name="agent-p",
        block_indices=[1],
        block_size_bytes=16,
        size_bytes=16,
        lease_s=1.0,
    )
    with pytest.raises(RemoteProtocolError, match="producer_agent_metadata"):
        decode_xfer_ack(encode_xfer_ack(forged), peer="p1")


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"block_indices": []}, "no block_indices"),
        ({"block_indices": [1, 1, 2]}, "duplicate"),
        ({"block_indices": [1, -2, 3]}, "negative"),
        ({"size_bytes": 3 * 8192 + 1}, "does not fit"),
        ({"size_bytes": 2 * 8192}, "does not fit"),
        ({"block_size_bytes": 0}, "block_size_bytes"),
        ({"lease_s": 0.0}, "lease_s"),
        ({"lease_s": math.inf}, "lease_s"),
        ({"producer_agent_name": ""}, "producer_agent_name"),
        ({"region_base_addr": 2**64 - 8192}, "64-bit"),
    ],
)
def test_R_E11_incoherent_grants_are_refused_locally(override: dict[str, Any], match: str) -> None:
    with pytest.raises(LocalProtocolError, match=match):
        make_grant(**override)


def test_R_E08_nack_grants_no_blocks() -> None:
    with pytest.raises(LocalProtocolError, match="NACK status"):
        nack(make_req(), XferStatus.OK)
    forged = raw(
        kind="XferAck",
        version=EC_CONNECTOR_VERSION,
        transfer_id="t",
        mm_hash="m",
        status="NACK_MISSING",
        producer_agent_name="p",
        block_indices=[1],
    )
    with pytest.raises(RemoteProtocolError, match="grants blocks"):
        decode_xfer_ack(forged)


def test_R_E07_check_xfer_ack_matches_the_request() -> None:
    req = make_req()
    check_xfer_ack(make_grant(req), req, block_size_bytes=8192)
    check_xfer_ack(nack(req, XferStatus.NACK_NOT_READY), req)
    other = make_req(transfer_id="xfer-2")
    with pytest.raises(RemoteProtocolError, match="does not answer"):
        check_xfer_ack(make_grant(other), req, peer="p1")
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
        {"transfer_id": ""},
        {"mm_hash": 7},
        {"compat_hash": "x" * 1000},
        {"surprise": 1},
    ],
)
def test_R_E09_strict_request_decoding(overrides: dict[str, Any]) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_xfer_req(msgspec.msgpack.encode(_req_fields(**overrides)))


def test_R_E08_unknown_status_string_is_a_remote_error() -> None:
    data = raw(
        kind="XferAck",
        version=EC_CONNECTOR_VERSION,
        transfer_id="t",
        mm_hash="m",
        status="NACK_MAYBE",
        producer_agent_name="p",
    )
    with pytest.raises(RemoteProtocolError, match="NACK_MAYBE"):
        decode_xfer_ack(data, peer="producer-1")


def test_R_E09_oversized_message_is_refused_before_parsing() -> None:
    data = raw(kind="XferReq", version=1, transfer_id="t", mm_hash="m", pad="x" * 5000)
    assert len(data) > MAX_XFER_REQ_BYTES
    with pytest.raises(RemoteProtocolError, match=r"cap \(peer consumer-7\)"):
        decode_xfer_req(data, peer="consumer-7")


def test_R_E09_oversized_grants_are_refused_locally() -> None:
    with pytest.raises(LocalProtocolError, match="producer_agent_metadata over"):
        make_grant(producer_agent_metadata=b"m" * (MAX_AGENT_METADATA_BYTES + 1))
    with pytest.raises(LocalProtocolError, match="block_indices"):
        make_grant(block_indices=list(range(MAX_BLOCKS_PER_XFER + 1)))
    huge = XferAck(
        version=EC_CONNECTOR_VERSION,
        transfer_id="t",
        mm_hash="m",
        status=XferStatus.NACK_INTERNAL,
        producer_agent_name="p",
        producer_agent_metadata=b"m" * MAX_XFER_ACK_BYTES,
    )
    with pytest.raises(LocalProtocolError, match="cap"):
        encode_xfer_ack(huge)


def test_R_E09_wrong_kind_is_refused() -> None:
    ack_bytes = encode_xfer_ack(nack(make_req(), XferStatus.NACK_MISSING))
    with pytest.raises(RemoteProtocolError, match="expected an XferReq"):
        decode_xfer_req(ack_bytes)
    with pytest.raises(RemoteProtocolError, match="unexpected EC message kind 'XferAck'"):
        decode_producer_message(ack_bytes)
    with pytest.raises(RemoteProtocolError, match="expected an XferAck"):
        decode_xfer_ack(encode_xfer_req(make_req()))


DECODERS = (decode_xfer_req, decode_xfer_ack, decode_xfer_done, decode_producer_message)


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
        "kind",
        "version",
        "transfer_id",
        "mm_hash",
        "status",
        "compat_hash",
        "num_blocks",
        "size_bytes",
        "block_indices",
        "block_size_bytes",
        "producer_agent_metadata",
        "lease_s",
        "ok",
        "other",
    ]
)


@settings(max_examples=300)
@given(
    kind=st.sampled_from(["XferReq", "XferAck", "XferDone", "Nope"]),
    version=st.one_of(st.just(EC_CONNECTOR_VERSION), wire_values),
    fields=st.dictionaries(wire_keys, wire_values, max_size=8),
)
def test_R_E09_decoders_on_structured_junk_raise_only_remote_errors(
    kind: str, version: Any, fields: dict[str, Any]
) -> None:
    message = {"kind": kind, "version": version, "transfer_id": "t", "mm_hash": "m", **fields}
    data = msgspec.msgpack.encode(message)
    for decode in DECODERS:
        try:
            decoded = decode(data)
        except RemoteProtocolError:
            continue
        assert isinstance(decoded, XferReq | XferAck | XferDone)
