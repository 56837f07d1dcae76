"""Wire vocabulary of push mode: notifs and the handshake.

Requirement ids: R-P08 (heartbeat and notif routing), B-06 (write-failed notif), R-P15
(handshake and compatibility).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from push_wire_strategies import (
    handshake_bytes,
    handshakes,
    ids,
    msgpack_values,
    sample_handshake,
    sample_registration,
    valid_hash,
)

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    HandshakePayload,
    check_compatible,
    compatibility_hash,
    decode_handshake,
    encode_handshake,
)
from kvhandoff.protocol.notifs import (
    MAX_FAILURE_REASON_CHARS,
    CompletionNotif,
    HeartbeatNotif,
    PushRegNotif,
    WriteFailedNotif,
    decode_completion_notif,
    decode_heartbeat,
    decode_write_failed,
    encode_heartbeat,
    encode_write_failed,
    parse_notif,
)
from kvhandoff.protocol.push_wire import (
    decode_push_reg,
    encode_push_reg,
)

PEER = "peer-under-test"

# --- R-P08: heartbeat and notif routing -------------------------------------------

hb_ids = st.text(alphabet=st.characters(exclude_characters=",", codec="utf-8"), min_size=1)


@given(st.lists(hb_ids, min_size=1, max_size=20))
def test_R_P08_heartbeat_round_trips(request_ids: list[str]) -> None:
    data = encode_heartbeat(request_ids)
    assert data.startswith(b"HB:")
    expected = HeartbeatNotif(request_ids=tuple(request_ids))
    assert decode_heartbeat(data, peer=PEER) == expected
    assert parse_notif(data, peer=PEER) == expected


def test_R_P08_heartbeat_wire_form() -> None:
    assert encode_heartbeat(["a", "b:1"]) == b"HB:a,b:1"


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"HB:", "empty request id"),
        (b"HB:a,", "empty request id"),
        (b"HB:,a", "empty request id"),
        (b"HB:,", "empty request id"),
        (b"HB:a,\xff", "not valid UTF-8"),
        (b"HB:a,b,c", "3 request ids, over the cap of 2"),
        (b"HX:a", "does not start with HB:"),
    ],
)
def test_R_P08_heartbeat_rejects_bad_bytes(data: bytes, expected: str) -> None:
    with pytest.raises(RemoteProtocolError, match=expected):
        decode_heartbeat(data, peer=PEER, max_ids=2)


@pytest.mark.parametrize("request_ids", [[], [""], ["a,b"], ["ok", ""]])
def test_R_P08_encode_heartbeat_rejects_bad_ids(request_ids: list[str]) -> None:
    with pytest.raises(LocalProtocolError, match="heartbeat"):
        encode_heartbeat(request_ids)


@pytest.mark.parametrize(
    ("data", "kind"),
    [
        (encode_push_reg(sample_registration()), PushRegNotif),
        (b"HB:r1,r2", HeartbeatNotif),
        (b"cmpl-1-0-abcdef12:2", CompletionNotif),
        (encode_write_failed("r1", "xfer post failed"), WriteFailedNotif),
    ],
)
def test_R_P08_parse_notif_classifies_each_kind(data: bytes, kind: type) -> None:
    assert type(parse_notif(data)) is kind


@pytest.mark.parametrize(
    "decoder",
    [parse_notif, decode_completion_notif, decode_heartbeat, decode_write_failed, decode_push_reg],
)
def test_R_P08_every_notif_decoder_has_a_size_cap(decoder: Callable[..., object]) -> None:
    with pytest.raises(RemoteProtocolError, match="exceeds the 8-byte cap"):
        decoder(b"HB:" + b"a" * 20, peer=PEER, max_bytes=8)


NOTIF_DECODERS: list[Callable[..., object]] = [
    parse_notif,
    decode_completion_notif,
    decode_heartbeat,
    decode_write_failed,
    decode_push_reg,
]


@settings(deadline=None)
@given(
    prefix=st.sampled_from([b"", b"HB:", b"PUSH_REG:", b"PUSH_FAIL:", b"x:"]),
    tail=st.binary(max_size=200),
)
def test_R_P08_notif_decoders_on_arbitrary_bytes_raise_only_remote_errors(
    prefix: bytes, tail: bytes
) -> None:
    for decoder in NOTIF_DECODERS:
        try:
            decoder(prefix + tail, peer=PEER)
        except RemoteProtocolError as exc:
            assert exc.peer == PEER


@settings(deadline=None)
@given(prefix=st.sampled_from([b"PUSH_REG:", b"PUSH_FAIL:"]), value=msgpack_values)
def test_R_P08_parse_notif_on_arbitrary_msgpack_raises_only_remote_errors(
    prefix: bytes, value: Any
) -> None:
    try:
        notif = parse_notif(prefix + msgspec.msgpack.encode(value), peer=PEER)
    except RemoteProtocolError as exc:
        assert exc.peer == PEER
    else:
        assert isinstance(notif, PushRegNotif | WriteFailedNotif)


# --- B-06: write-failed notif -----------------------------------------------------


@given(request_id=ids, reason=st.text(max_size=2 * MAX_FAILURE_REASON_CHARS))
def test_B_06_write_failed_notif_round_trips(request_id: str, reason: str) -> None:
    data = encode_write_failed(request_id, reason)
    assert data.startswith(b"PUSH_FAIL:")
    expected = WriteFailedNotif(request_id=request_id, reason=reason[:MAX_FAILURE_REASON_CHARS])
    assert decode_write_failed(data, peer=PEER) == expected
    assert parse_notif(data, peer=PEER) == expected


def test_B_06_write_failed_notif_is_a_msgpack_dict() -> None:
    body = encode_write_failed("req-D", "NIXL_ERR_BACKEND")[len(b"PUSH_FAIL:") :]
    assert msgspec.msgpack.decode(body) == {"request_id": "req-D", "reason": "NIXL_ERR_BACKEND"}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"request_id": "r"}, "reason"),
        ({"request_id": "", "reason": "x"}, "request_id"),
        ({"request_id": 1, "reason": "x"}, "request_id"),
        ({"request_id": "r", "reason": "x", "more": 1}, "unknown field"),
        ({"request_id": "r", "reason": "x" * (MAX_FAILURE_REASON_CHARS + 1)}, "reason"),
        (["r", "x"], "malformed PUSH_FAIL"),
    ],
)
def test_B_06_write_failed_notif_rejects_bad_payloads(raw: Any, expected: str) -> None:
    with pytest.raises(RemoteProtocolError, match=expected):
        decode_write_failed(b"PUSH_FAIL:" + msgspec.msgpack.encode(raw), peer=PEER)


def test_B_06_encode_write_failed_needs_a_request_id() -> None:
    with pytest.raises(LocalProtocolError, match="non-empty request id"):
        encode_write_failed("", "boom")


# --- R-P15: handshake and compatibility -------------------------------------------


@given(handshakes())
def test_R_P15_handshake_round_trips(payload: HandshakePayload) -> None:
    assert decode_handshake(encode_handshake(payload), peer=PEER) == payload


def test_R_P15_handshake_without_region_members_decodes_as_not_advertised() -> None:
    assert decode_handshake(handshake_bytes(region_members=[])).region_members == ()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (handshake_bytes(extras={"tp_rank": 2}), "tp_rank 2 is not below tp_size 2"),
        (handshake_bytes(region_num_blocks=[1]), "per-region lists disagree"),
        (handshake_bytes(kv_caches_base_addr=[1, 2, 3]), "per-region lists disagree"),
        (
            handshake_bytes(
                kv_caches_base_addr=[], block_lens=[], block_strides=[], region_num_blocks=[]
            ),
            "0 regions",
        ),
        (handshake_bytes(region_members=[["a"]]), "1 region_members entries for 2 regions"),
        (handshake_bytes(region_members=[["a"], []]), "region 1 advertises no members"),
        (handshake_bytes(region_members=[["a"], [""]]), "region_members"),
        (handshake_bytes(region_num_blocks=[0, 1]), "num_blocks"),
        (handshake_bytes(physical_blocks_per_logical_kv_block=0), "physical_blocks_per_logical"),
        (handshake_bytes(block_strides=[8192, 4096]), "block strides differ"),
        (handshake_bytes(ssm_sizes=[1, 2]), "SSM"),
        (handshake_bytes(dcp_size=2), "DCP 2"),
        (handshake_bytes(outer={"compatibility_hash": "ABC"}), "compatibility_hash"),
        (
            handshake_bytes(outer={"compatibility_hash": valid_hash() + "\n"}),
            "compatibility_hash",
        ),
        (handshake_bytes(agent_metadata=b""), "agent_metadata"),
        (handshake_bytes(agent_metadata="text"), "agent_metadata"),
        (handshake_bytes(outer={"agent_metadata_bytes": b"\xc1"}), "agent metadata refused"),
        (handshake_bytes(outer={"kvhandoff": None}), "needs the rank it was asked for"),
        (
            handshake_bytes(kv_caches_base_addr=[2**64 - 4096, 0]),
            "region 0 runs past the end of the 64-bit address space",
        ),
        (msgspec.msgpack.encode([1, 2]), "malformed handshake"),
        (b"\xc1", "handshake refused"),
        (b"\x91" * 4000, "nested deeper"),
    ],
)
def test_R_P15_decode_handshake_rejects_bad_payloads(data: bytes, expected: str) -> None:
    with pytest.raises(RemoteProtocolError, match=expected) as info:
        decode_handshake(data, peer=PEER)
    assert info.value.peer == PEER


def test_C_01_handshake_ignores_unknown_keys_like_vllm() -> None:
    """A newer peer's extra keys are skipped, in both maps (vLLM's decoder does the same)."""
    data = handshake_bytes(surprise=True, outer={"novel": {"x": [1]}}, extras={"later": 1})
    assert decode_handshake(data) == sample_handshake()


def test_C_01_stock_vllm_payload_takes_the_coordinates_the_request_named() -> None:
    """No `kvhandoff` key: a stock vLLM rank; its TP/PP come from the request (C-04: it
    advertises no extension)."""
    data = handshake_bytes(outer={"kvhandoff": None})
    payload = decode_handshake(data, slot=(2, 1, 1, 0))
    assert (payload.tp_size, payload.tp_rank, payload.pp_size, payload.pp_rank) == (2, 1, 1, 0)
    assert payload.protocol_version == 0 and not payload.from_kvhandoff
    assert payload.extensions == () and payload.agent_name == "" and payload.backend == ""
    with pytest.raises(RemoteProtocolError, match="asked for"):
        decode_handshake(handshake_bytes(), slot=(2, 1, 1, 0))  # says rank 0


def test_R_P15_handshake_version_mismatch_is_reported_before_other_fields() -> None:
    data = handshake_bytes(extras={"protocol_version": HANDSHAKE_PROTOCOL_VERSION + 1})
    expected = f"kvhandoff protocol version {HANDSHAKE_PROTOCOL_VERSION + 1}"
    with pytest.raises(RemoteProtocolError, match=expected):
        decode_handshake(data)


def test_R_P15_decode_handshake_caps_bytes_and_regions() -> None:
    data = encode_handshake(sample_handshake())
    with pytest.raises(RemoteProtocolError, match="exceeds the 16-byte cap"):
        decode_handshake(data, max_bytes=16)
    with pytest.raises(RemoteProtocolError, match=r"2 regions, expected 1\.\.1"):
        decode_handshake(data, max_regions=1)


@pytest.mark.parametrize(
    "payload",
    [
        sample_handshake(protocol_version=99),
        sample_handshake(tp_rank=5),
        sample_handshake(num_blocks=(1,)),
    ],
)
def test_R_P15_encode_handshake_refuses_invalid_payloads(payload: HandshakePayload) -> None:
    with pytest.raises(LocalProtocolError):
        encode_handshake(payload)


@settings(deadline=None)
@given(st.binary(max_size=300) | msgpack_values.map(msgspec.msgpack.encode))
def test_R_P15_decode_handshake_on_arbitrary_bytes_raises_only_remote_errors(data: bytes) -> None:
    try:
        payload = decode_handshake(data, peer=PEER)
    except RemoteProtocolError as exc:
        assert exc.peer == PEER
    else:
        assert payload.protocol_version == HANDSHAKE_PROTOCOL_VERSION


def test_R_P15_compatibility_hash_is_sha256_hex_and_deterministic() -> None:
    digest = compatibility_hash("0.1.0", "org/model", "bfloat16", 16, extra={"b": 1, "a": "x"})
    assert len(digest) == 64
    assert set(digest) <= set(string.hexdigits.lower())
    assert digest == compatibility_hash(
        "0.1.0", "org/model", "bfloat16", 16, extra={"a": "x", "b": 1}
    )


@given(
    st.tuples(st.text(max_size=6), st.text(max_size=6), st.text(max_size=6), st.integers(0, 64)),
    st.tuples(st.text(max_size=6), st.text(max_size=6), st.text(max_size=6), st.integers(0, 64)),
)
def test_R_P15_compatibility_hash_separates_different_inputs(
    left: tuple[str, str, str, int], right: tuple[str, str, str, int]
) -> None:
    """Property: no concatenation collisions, e.g. ("ab", "c") vs ("a", "bc")."""
    assert (compatibility_hash(*left) == compatibility_hash(*right)) == (left == right)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("backend", "GDS"),
        ("compatibility_hash", compatibility_hash("0.2.0", "model", "bfloat16", 16)),
        ("protocol_version", HANDSHAKE_PROTOCOL_VERSION + 1),
    ],
)
def test_R_P15_check_compatible_names_both_engines_and_the_field(field: str, value: Any) -> None:
    local = sample_handshake(engine_id="engine-P")
    remote = sample_handshake(engine_id="engine-D", **{field: value})
    with pytest.raises(RemoteProtocolError) as info:
        check_compatible(local, remote, peer=PEER)
    message = str(info.value)
    assert "'engine-P'" in message
    assert "'engine-D'" in message
    assert field in message


def test_R_P15_check_compatible_accepts_peers_that_differ_only_in_layout() -> None:
    local = sample_handshake(engine_id="engine-P", tp_size=1, tp_rank=0, num_blocks=(10, 10))
    remote = sample_handshake(engine_id="engine-D", physical_blocks_per_logical=4)
    assert check_compatible(local, remote) is None


def test_C_04_S_05_a_keyed_side_refuses_a_stock_peer_and_checks_no_backend() -> None:
    """A stock vLLM payload advertises no cluster key, so a side with one refuses it
    (S-05); a side without one accepts it on the hash alone: a stock peer names no NIXL
    backend or kvhandoff dialect version to compare (C-01)."""
    stock = decode_handshake(handshake_bytes(outer={"kvhandoff": None}), slot=(2, 0, 1, 0))
    check_compatible(sample_handshake(backend="LIBFABRIC"), stock, peer=PEER)
    keyed = sample_handshake(extensions=("push_fail", "auth"), auth_key_id="0123456789abcdef")
    with pytest.raises(RemoteProtocolError, match="auth_key_id differs"):
        check_compatible(keyed, stock, peer=PEER)
