"""Wire vocabulary of push mode: request ids, PUSH_REG, notifs, blocks, handshake.

Requirement ids: R-P02 (PUSH_REG codec), R-P04 (base ids), R-P06 (expansion and the
completion notif), R-P08 (heartbeat and notif routing), R-P15 (handshake and
compatibility), B-06 (write-failed notif).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol.blocks import check_within_capacity, expand_to_physical
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
    MAX_TP_SIZE,
    RESERVED_PREFIXES,
    CompletionNotif,
    HeartbeatNotif,
    PushRegNotif,
    WriteFailedNotif,
    decode_completion_notif,
    decode_heartbeat,
    decode_write_failed,
    encode_completion_notif,
    encode_heartbeat,
    encode_write_failed,
    parse_notif,
)
from kvhandoff.protocol.push_wire import (
    PUSH_REG_PREFIX,
    PushRegistration,
    decode_push_reg,
    encode_push_reg,
)
from kvhandoff.protocol.request_ids import get_base_request_id

PEER = "peer-under-test"

# --- strategies -------------------------------------------------------------------

ids = st.text(min_size=1, max_size=40)
hex8 = st.text(alphabet="0123456789abcdef", min_size=8, max_size=8)
ports = st.integers(1, 65535)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=24), children, max_size=4)
    ),
    max_leaves=24,
)


@st.composite
def registrations(draw: st.DrawFn) -> PushRegistration:
    tp_size = draw(st.integers(1, 64))
    return PushRegistration(
        request_id=draw(ids),
        decode_engine_id=draw(ids),
        decode_host=draw(ids),
        decode_port=draw(ports),
        decode_tp_size=tp_size,
        decode_tp_rank=draw(st.integers(0, tp_size - 1)),
        block_ids=tuple(draw(st.lists(st.integers(0, 2**40), max_size=50))),
        remote_engine_id=draw(ids),
        remote_host=draw(ids),
        remote_port=draw(ports),
        remote_tp_size=draw(st.integers(1, 64)),
    )


def _valid_hash() -> str:
    return compatibility_hash("0.1.0", "model", "bfloat16", 16)


@st.composite
def handshakes(draw: st.DrawFn) -> HandshakePayload:
    n = draw(st.integers(1, 6))
    tp_size = draw(st.integers(1, 16))
    per_region = st.lists(st.integers(1, 1 << 20), min_size=n, max_size=n)
    members = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3).map(tuple)
    region_members = draw(st.just(()) | st.lists(members, min_size=n, max_size=n).map(tuple))
    return HandshakePayload(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION,
        engine_id=draw(ids),
        agent_name=draw(ids),
        agent_metadata=draw(st.binary(min_size=1, max_size=64)),
        tp_size=tp_size,
        tp_rank=draw(st.integers(0, tp_size - 1)),
        kv_block_lens=tuple(draw(per_region)),
        num_blocks=tuple(draw(per_region)),
        region_base_addrs=tuple(draw(st.lists(st.integers(0, 1 << 48), min_size=n, max_size=n))),
        physical_blocks_per_logical=draw(st.integers(1, 8)),
        backend=draw(st.sampled_from(["UCX", "GDS", "LIBFABRIC"])),
        compatibility_hash=draw(st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)),
        region_members=region_members,
    )


def _reg(**changes: Any) -> PushRegistration:
    base = PushRegistration(
        request_id="cmpl-abc-0-1234abcd",
        decode_engine_id="D",
        decode_host="10.0.0.2",
        decode_port=5600,
        decode_tp_size=2,
        decode_tp_rank=1,
        block_ids=(3, 7, 9),
        remote_engine_id="P",
        remote_host="10.0.0.1",
        remote_port=5601,
        remote_tp_size=1,
    )
    return msgspec.structs.replace(base, **changes)


def _handshake(**changes: Any) -> HandshakePayload:
    base = HandshakePayload(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION,
        engine_id="engine-D",
        agent_name="agent-D-0",
        agent_metadata=b"nixl-metadata",
        tp_size=2,
        tp_rank=0,
        kv_block_lens=(4096, 4096),
        num_blocks=(100, 80),
        region_base_addrs=(0x1000, 0x900000),
        physical_blocks_per_logical=2,
        backend="UCX",
        compatibility_hash=_valid_hash(),
        region_members=(("layers.0",), ("layers.1", "layers.2")),
    )
    return msgspec.structs.replace(base, **changes)


def _raw_reg_dict(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = msgspec.to_builtins(_reg())
    raw.update(changes)
    return raw


def _push_reg_bytes(raw: Any) -> bytes:
    return PUSH_REG_PREFIX + msgspec.msgpack.encode(raw)


# --- R-P04: request ids -----------------------------------------------------------


def test_R_P04_base_id_keeps_completion_index() -> None:
    uuid = "0f8e4c3a9b2d4e1f8a7b6c5d4e3f2a1b"
    first = get_base_request_id(f"cmpl-{uuid}-0-1a2b3c4d")
    second = get_base_request_id(f"cmpl-{uuid}-1-1a2b3c4d")
    assert first == f"cmpl-{uuid}-0"
    assert second == f"cmpl-{uuid}-1"
    assert first != second


@pytest.mark.parametrize(
    "request_id",
    [
        "cmpl-abc-0",  # no suffix
        "cmpl-abc-0-1A2B3C4D",  # upper-case hex is not the engine's suffix
        "cmpl-abc-0-1a2b3c4",  # seven digits
        "cmpl-abc-0-1a2b3c4d5",  # nine digits
        "cmpl-abc-0_1a2b3c4d",  # no dash
        "-1a2b3c4d",  # nothing before the suffix
        "cmpl-abc-0-1a2b3c4d\n",  # trailing newline
        "cmpl-abc-0-1a2b3c4g",  # not hex
        "",
    ],
)
def test_R_P04_base_id_leaves_other_ids_unchanged(request_id: str) -> None:
    assert get_base_request_id(request_id) == request_id


@given(base=st.text(min_size=1), p_suffix=hex8, d_suffix=hex8)
def test_R_P04_p_and_d_ids_normalise_to_the_same_base(
    base: str, p_suffix: str, d_suffix: str
) -> None:
    """Property: the legs differ only by their engine suffix, so their bases agree."""
    p_id, d_id = f"{base}-{p_suffix}", f"{base}-{d_suffix}"
    assert get_base_request_id(p_id) == get_base_request_id(d_id) == base


@given(st.text())
def test_R_P04_base_id_strips_nothing_or_exactly_one_suffix(request_id: str) -> None:
    base = get_base_request_id(request_id)
    assert request_id.startswith(base)
    assert len(request_id) - len(base) in (0, 9)


# --- R-P02: PUSH_REG codec --------------------------------------------------------


@given(registrations())
def test_R_P02_push_reg_round_trips(reg: PushRegistration) -> None:
    data = encode_push_reg(reg)
    assert data.startswith(PUSH_REG_PREFIX)
    assert decode_push_reg(data, peer=PEER) == reg
    assert parse_notif(data, peer=PEER) == PushRegNotif(reg)


def test_R_P02_push_reg_is_a_msgpack_dict_on_the_wire() -> None:
    body = encode_push_reg(_reg())[len(PUSH_REG_PREFIX) :]
    decoded = msgspec.msgpack.decode(body)
    assert isinstance(decoded, dict)
    assert decoded["request_id"] == "cmpl-abc-0-1234abcd"
    assert decoded["block_ids"] == [3, 7, 9]
    assert set(decoded) == set(PushRegistration.__struct_fields__)


def test_R_P02_push_reg_allows_no_blocks() -> None:
    reg = _reg(block_ids=())
    assert decode_push_reg(encode_push_reg(reg)).block_ids == ()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (_raw_reg_dict(block_ids=[1, -2]), r"block_ids"),
        (_raw_reg_dict(block_ids=[1, "2"]), r"block_ids"),
        (_raw_reg_dict(block_ids=[1.0]), r"block_ids"),
        (_raw_reg_dict(request_id=""), r"request_id"),
        (_raw_reg_dict(decode_engine_id=""), r"decode_engine_id"),
        (_raw_reg_dict(decode_port="5600"), r"decode_port"),
        (_raw_reg_dict(decode_port=0), r"decode_port"),
        (_raw_reg_dict(remote_port=65536), r"remote_port"),
        (_raw_reg_dict(decode_tp_size=True), r"decode_tp_size"),
        (_raw_reg_dict(remote_tp_size=0), r"remote_tp_size"),
        (_raw_reg_dict(decode_tp_rank=2), r"decode_tp_rank 2 is not below decode_tp_size 2"),
        (_raw_reg_dict(unexpected=1), r"unknown field `unexpected`"),
        ({k: v for k, v in _raw_reg_dict().items() if k != "remote_host"}, r"remote_host"),
        ([1, 2, 3], r"malformed PUSH_REG"),
    ],
)
def test_R_P02_decode_push_reg_rejects_bad_fields(raw: Any, expected: str) -> None:
    with pytest.raises(RemoteProtocolError, match=expected) as info:
        decode_push_reg(_push_reg_bytes(raw), peer=PEER)
    assert info.value.peer == PEER


def test_R_P02_decode_push_reg_caps_bytes_and_blocks() -> None:
    data = encode_push_reg(_reg(block_ids=tuple(range(100))))
    with pytest.raises(RemoteProtocolError, match="exceeds the 64-byte cap"):
        decode_push_reg(data, max_bytes=64)
    with pytest.raises(RemoteProtocolError, match="100 block ids exceed the cap of 99"):
        decode_push_reg(data, max_blocks=99)
    assert len(decode_push_reg(data, max_blocks=100).block_ids) == 100


def test_R_P02_decode_push_reg_needs_its_prefix() -> None:
    body = encode_push_reg(_reg())[len(PUSH_REG_PREFIX) :]
    with pytest.raises(RemoteProtocolError, match="PUSH_REG:"):
        decode_push_reg(b"PUSH_RE:" + body)


@pytest.mark.parametrize(
    "reg",
    [
        _reg(block_ids=(1, -1)),
        _reg(decode_tp_rank=2),
        _reg(request_id=""),
        _reg(decode_port=70000),
    ],
)
def test_R_P02_encode_push_reg_refuses_a_registration_the_peer_would_reject(
    reg: PushRegistration,
) -> None:
    with pytest.raises(LocalProtocolError, match="cannot encode PUSH_REG"):
        encode_push_reg(reg)


@settings(deadline=None)
@given(st.binary(max_size=300))
def test_R_P02_decode_push_reg_on_arbitrary_bytes_raises_only_remote_errors(tail: bytes) -> None:
    for data in (tail, PUSH_REG_PREFIX + tail):
        try:
            reg = decode_push_reg(data, peer=PEER)
        except RemoteProtocolError as exc:
            assert exc.peer == PEER
        else:
            assert decode_push_reg(encode_push_reg(reg)) == reg


@settings(deadline=None)
@given(
    field=st.sampled_from([*PushRegistration.__struct_fields__, "extra"]),
    value=msgpack_values,
    drop=st.booleans(),
)
def test_R_P02_decode_push_reg_on_mutated_maps_raises_only_remote_errors(
    field: str, value: Any, drop: bool
) -> None:
    raw = _raw_reg_dict()
    if drop:
        raw.pop(field, None)
    else:
        raw[field] = value
    try:
        reg = decode_push_reg(_push_reg_bytes(raw), peer=PEER)
    except RemoteProtocolError as exc:
        assert exc.peer == PEER
    else:
        body = encode_push_reg(reg)[len(PUSH_REG_PREFIX) :]
        assert msgspec.msgpack.decode(body) == msgspec.msgpack.decode(msgspec.msgpack.encode(raw))


# --- R-P06: block expansion and completion notif ----------------------------------


def test_R_P06_expand_to_physical_examples() -> None:
    assert expand_to_physical([0, 2], 2) == [0, 1, 4, 5]
    assert expand_to_physical([5, 1], 3) == [15, 16, 17, 3, 4, 5]
    assert expand_to_physical([4, 0, 9], 1) == [4, 0, 9]
    assert expand_to_physical([], 4) == []


@given(st.lists(st.integers(0, 10_000), max_size=40), st.integers(1, 16))
def test_R_P06_expansion_covers_exactly_each_logical_block(logical: list[int], r: int) -> None:
    physical = expand_to_physical(logical, r)
    assert len(physical) == r * len(logical)
    assert [p // r for p in physical] == [b for b in logical for _ in range(r)]
    assert [p % r for p in physical] == list(range(r)) * len(logical)


@pytest.mark.parametrize("ratio", [0, -1])
def test_R_P06_expansion_rejects_a_ratio_below_one(ratio: int) -> None:
    with pytest.raises(LocalProtocolError, match="physical_per_logical must be >= 1"):
        expand_to_physical([1], ratio)


def test_R_P06_expansion_rejects_negative_logical_ids() -> None:
    with pytest.raises(LocalProtocolError, match="logical block ids must be >= 0"):
        expand_to_physical([1, -3], 2)


def test_R_P06_capacity_check_names_request_and_capacity() -> None:
    physical = expand_to_physical([10, 49], 2)  # highest physical id: 99
    check_within_capacity("req-1", physical, 100, engine_id="D")
    with pytest.raises(RemoteProtocolError) as info:
        check_within_capacity("req-1", physical, 99, engine_id="D", peer=PEER)
    message = str(info.value)
    assert "'req-1'" in message
    assert "99 blocks" in message
    assert "'D'" in message
    assert info.value.peer == PEER


def test_R_P06_capacity_check_rejects_negative_physical_ids() -> None:
    with pytest.raises(RemoteProtocolError, match="negative physical block -1"):
        check_within_capacity("req-1", [0, -1], 10)


@given(st.lists(st.integers(0, 1000), max_size=20), st.integers(1, 4), st.integers(0, 5000))
def test_R_P06_capacity_check_fails_exactly_when_a_block_is_out_of_range(
    logical: list[int], r: int, capacity: int
) -> None:
    physical = expand_to_physical(logical, r)
    fits = all(p < capacity for p in physical)
    try:
        check_within_capacity("req", physical, capacity)
    except RemoteProtocolError:
        assert not fits
    else:
        assert fits


completion_ids = ids.filter(lambda rid: not (rid + ":").encode().startswith(RESERVED_PREFIXES))


@given(request_id=completion_ids, tp_size=st.integers(1, MAX_TP_SIZE))
def test_R_P06_completion_notif_round_trips(request_id: str, tp_size: int) -> None:
    data = encode_completion_notif(request_id, tp_size)
    assert data.endswith(f":{tp_size}".encode())
    expected = CompletionNotif(request_id=request_id, tp_size=tp_size)
    assert decode_completion_notif(data, peer=PEER) == expected
    assert parse_notif(data, peer=PEER) == expected


def test_R_P06_completion_notif_splits_on_the_last_colon() -> None:
    assert encode_completion_notif("a:b:c", 4) == b"a:b:c:4"
    assert decode_completion_notif(b"a:b:c:4") == CompletionNotif("a:b:c", 4)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"req:0", "not a positive integer"),
        (b"req:-1", "not a positive integer"),
        (b"req:01", "not a positive integer"),
        (b"req:+1", "not a positive integer"),
        (b"req: 1", "not a positive integer"),
        (b"req:abc", "not a positive integer"),
        (b"req:", "not a positive integer"),
        ("req:²".encode(), "not a positive integer"),
        ("req:١".encode(), "not a positive integer"),
        (b"req:1234567890", "not a positive integer"),
        (b"req", "has no ':'"),
        (b":4", "empty request id"),
        (b"HB:1", "reserved prefix"),
        (b"PUSH_FAIL:x:1", "reserved prefix"),
        (b"\xff\xfe:1", "not valid UTF-8"),
    ],
)
def test_R_P06_completion_notif_rejects_bad_bytes(data: bytes, expected: str) -> None:
    with pytest.raises(RemoteProtocolError, match=expected) as info:
        decode_completion_notif(data, peer=PEER)
    assert info.value.peer == PEER


@pytest.mark.parametrize(
    ("request_id", "tp_size", "expected"),
    [
        ("", 1, "non-empty request id"),
        ("HB:x", 1, "reserved prefix"),
        ("HB", 1, "reserved prefix"),
        ("PUSH_FAIL", 1, "reserved prefix"),
        ("PUSH_REG:x", 1, "reserved prefix"),
        ("PUSH_FAIL:x", 1, "reserved prefix"),
        ("req", 0, "tp_size"),
        ("req", True, "tp_size"),
        ("req", MAX_TP_SIZE + 1, "tp_size"),
    ],
)
def test_R_P06_encode_completion_notif_rejects_bad_arguments(
    request_id: str, tp_size: int, expected: str
) -> None:
    with pytest.raises(LocalProtocolError, match=expected):
        encode_completion_notif(request_id, tp_size)


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
        (encode_push_reg(_reg()), PushRegNotif),
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
    raw = msgspec.structs.asdict(_handshake())
    del raw["region_members"]
    assert decode_handshake(msgspec.msgpack.encode(raw)).region_members == ()


def _handshake_bytes(**changes: Any) -> bytes:
    raw: dict[str, Any] = msgspec.structs.asdict(_handshake())
    raw.update(changes)
    return msgspec.msgpack.encode(raw)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (_handshake_bytes(tp_rank=2), "tp_rank 2 is not below tp_size 2"),
        (_handshake_bytes(num_blocks=[1]), "per-region lists disagree"),
        (_handshake_bytes(region_base_addrs=[1, 2, 3]), "per-region lists disagree"),
        (_handshake_bytes(kv_block_lens=[], num_blocks=[], region_base_addrs=[]), "0 regions"),
        (_handshake_bytes(region_members=[["a"]]), "1 region_members entries for 2 regions"),
        (_handshake_bytes(region_members=[["a"], []]), "region 1 advertises no members"),
        (_handshake_bytes(region_members=[["a"], [""]]), "region_members"),
        (_handshake_bytes(num_blocks=[0, 1]), "num_blocks"),
        (_handshake_bytes(physical_blocks_per_logical=0), "physical_blocks_per_logical"),
        (_handshake_bytes(compatibility_hash="ABC"), "compatibility_hash"),
        (_handshake_bytes(compatibility_hash=_valid_hash() + "\n"), "compatibility_hash"),
        (_handshake_bytes(agent_metadata=b""), "agent_metadata"),
        (_handshake_bytes(agent_metadata="text"), "agent_metadata"),
        (_handshake_bytes(surprise=True), "unknown field `surprise`"),
        (
            _handshake_bytes(region_base_addrs=[2**64 - 4096, 0]),
            "region 0 runs past the end of the 64-bit address space",
        ),
        (msgspec.msgpack.encode([1, 2]), "malformed handshake"),
        (b"\xc1", "malformed handshake"),
    ],
)
def test_R_P15_decode_handshake_rejects_bad_payloads(data: bytes, expected: str) -> None:
    with pytest.raises(RemoteProtocolError, match=expected) as info:
        decode_handshake(data, peer=PEER)
    assert info.value.peer == PEER


def test_R_P15_handshake_version_mismatch_is_reported_before_unknown_fields() -> None:
    data = msgspec.msgpack.encode(
        {"protocol_version": HANDSHAKE_PROTOCOL_VERSION + 1, "engine_id": "new-P", "novel": 1}
    )
    with pytest.raises(RemoteProtocolError, match="engine 'new-P' speaks protocol version 2"):
        decode_handshake(data)


def test_R_P15_decode_handshake_caps_bytes_and_regions() -> None:
    data = encode_handshake(_handshake())
    with pytest.raises(RemoteProtocolError, match="exceeds the 16-byte cap"):
        decode_handshake(data, max_bytes=16)
    with pytest.raises(RemoteProtocolError, match=r"2 regions, expected 1\.\.1"):
        decode_handshake(data, max_regions=1)


@pytest.mark.parametrize(
    "payload",
    [_handshake(protocol_version=99), _handshake(tp_rank=5), _handshake(num_blocks=(1,))],
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
    local = _handshake(engine_id="engine-P")
    remote = _handshake(engine_id="engine-D", **{field: value})
    with pytest.raises(RemoteProtocolError) as info:
        check_compatible(local, remote, peer=PEER)
    message = str(info.value)
    assert "'engine-P'" in message
    assert "'engine-D'" in message
    assert field in message


def test_R_P15_check_compatible_accepts_peers_that_differ_only_in_layout() -> None:
    local = _handshake(engine_id="engine-P", tp_size=1, tp_rank=0, num_blocks=(10, 10))
    remote = _handshake(engine_id="engine-D", physical_blocks_per_logical=4)
    assert check_compatible(local, remote) is None
