"""S-01: no peer input stops an encoder-cache process, whatever its structure.

Every decoder of peer bytes (`XferReq`, `XferAck`, `XferDone`, the producer's either-of
decoder, `ec_transfer_params`) raises only `RemoteProtocolError`, and the scheduler
halves count it and go on. The inputs are built with structure (`ec_hostile_strategies`):
deep nesting inside an otherwise valid message, containers announcing billions of
elements, fields of the wrong type, truncated and edited messages.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from ec_hostile_strategies import hostile_ec_message, hostile_params, nested, valid_ec_messages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.protocol.ec_publication import parse_ec_transfer_params
from kvhandoff.protocol.ec_wire import (
    MAX_XFER_ACK_BYTES,
    MAX_XFER_REQ_BYTES,
    decode_producer_message,
    decode_xfer_ack,
    decode_xfer_done,
    decode_xfer_req,
)
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.msgpack_limits import check_msgpack
from kvhandoff.sim.ec.plane import SimECPlane

DECODERS = (decode_xfer_req, decode_xfer_ack, decode_xfer_done, decode_producer_message)


def deep_request(size: int, kind: str = "array") -> bytes:
    """A well-formed `XferReq` plus an unknown field nested as deep as `size` bytes allow."""
    base = valid_ec_messages()[0]
    head = bytes([base[0] + 1]) + base[1:] + msgspec.msgpack.encode("zzz")
    per_level = 1 if kind == "array" else 3
    depth = (size - len(head) - 1) // per_level
    data = head + nested(depth, kind)
    assert len(data) <= size
    return data


def test_S_01_a_4KiB_xfer_req_nested_4000_deep_is_refused_before_decoding() -> None:
    data = deep_request(MAX_XFER_REQ_BYTES)
    assert data.count(b"\x91") >= 3800  # 4 KiB: the cap of an XferReq
    for decode in DECODERS:
        with pytest.raises(RemoteProtocolError, match=r"nested deeper|exceeds the"):
            decode(data, peer="hostile")


def test_S_01_the_producer_counts_a_deep_xfer_req_and_keeps_serving() -> None:
    sim = SimECPlane(0)
    producer = sim.producer.scheduler
    for kind in ("array", "map", "mixed"):
        with pytest.raises(RemoteProtocolError):
            producer.on_producer_message(b"hostile", deep_request(MAX_XFER_REQ_BYTES, kind), 0.0)
    assert producer.counters()["producer_remote_errors"] == 3
    producer.on_producer_message(b"honest", valid_ec_messages()[0], 0.0)  # still answers


def test_S_01_a_consumer_counts_a_deep_xfer_ack_of_megabytes() -> None:
    sim = SimECPlane(0)
    consumer = sim.consumer.scheduler
    base = valid_ec_messages()[1]
    data = bytes([base[0] + 1]) + base[1:] + b"\xa1z" + nested(MAX_XFER_ACK_BYTES - 400)
    with pytest.raises(RemoteProtocolError, match="nested deeper"):
        consumer.on_xfer_ack(data, 0.0, peer="producer.sim:5601")
    assert consumer.counters()["consumer_remote_errors"] == 1


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_ec_message())
def test_S_01_every_ec_decoder_raises_only_remote_errors_on_structured_junk(data: bytes) -> None:
    for decode in DECODERS:
        try:
            decode(data, peer="hostile")
        except RemoteProtocolError as exc:
            assert exc.peer == "hostile"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_params())
def test_S_01_ec_transfer_params_parser_raises_only_remote_errors(params: Any) -> None:
    with pytest.raises(RemoteProtocolError):
        parse_ec_transfer_params(params, peer="orchestrator")


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hostile_params())
def test_S_01_hostile_params_make_the_consumer_encode_locally(params: Any) -> None:
    scheduler = SimECPlane(0).consumer.scheduler
    req = ECRequestInfo("r", ("mm",), ec_transfer_params=params, mm_tokens=(2,))
    assert scheduler.ensure_cache_available(req, 0, 0.0)
    assert scheduler.counters()["bad_params"] == 1


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.text(max_size=8)),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=30,
)


@given(json_values)
def test_S_01_the_structure_check_accepts_what_msgspec_encodes(value: Any) -> None:
    check_msgpack(msgspec.msgpack.encode(value), max_depth=64, max_items=10_000)


@pytest.mark.parametrize("message", valid_ec_messages())
def test_S_01_truncations_and_trailing_bytes_are_refused(message: bytes) -> None:
    check_msgpack(message, max_items=100)
    for cut in range(len(message)):
        with pytest.raises(RemoteProtocolError):
            check_msgpack(message[:cut], max_items=100)
    with pytest.raises(RemoteProtocolError, match="after the message"):
        check_msgpack(message + b"\xc0", max_items=100)


def test_S_01_a_container_cannot_announce_more_than_the_bytes_left() -> None:
    with pytest.raises(RemoteProtocolError, match="announces"):
        check_msgpack(b"\xdd\xff\xff\xff\xff\xc0", max_items=100)
    with pytest.raises(RemoteProtocolError, match="more than 3 objects"):
        check_msgpack(b"\x94\x01\x02\x03\x04", max_items=3)
