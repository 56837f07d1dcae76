"""Wire vocabulary of push mode: request ids, PUSH_REG and blocks.

Requirement ids: R-P02 (PUSH_REG codec), R-P04 (base ids), R-P06 (expansion and the
completion notif).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from push_wire_strategies import (
    hex8,
    ids,
    msgpack_values,
    push_reg_bytes,
    raw_reg_dict,
    registrations,
    sample_registration,
)

from kvhandoff.protocol import push_wire
from kvhandoff.protocol.blocks import check_within_capacity, expand_to_physical
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.notifs import (
    MAX_TP_SIZE,
    RESERVED_PREFIXES,
    CompletionNotif,
    PushRegNotif,
    decode_completion_notif,
    encode_completion_notif,
    parse_notif,
)
from kvhandoff.protocol.push_wire import (
    PUSH_REG_PREFIX,
    PushRegistration,
    decode_push_reg,
    encode_push_reg,
)
from kvhandoff.protocol.request_ids import _WITH_SUFFIX, get_base_request_id

PEER = "peer-under-test"

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


@given(
    st.one_of(
        st.text(),
        st.builds(
            lambda head, tail: f"{head}-{tail}",
            st.text(max_size=12),
            st.text(alphabet="0123456789abcdefABCDEFg\n\u0660x", min_size=7, max_size=9),
        ),
    )
)
def test_R_P04_base_id_follows_the_suffix_pattern(request_id: str) -> None:
    """The hand-written rule is the pattern's: `(.+)-<8 hex>` matched whole, ASCII hex."""
    match = _WITH_SUFFIX.fullmatch(request_id)
    assert get_base_request_id(request_id) == (match.group(1) if match else request_id)


def test_C_01_base_id_strips_hex_of_either_case_like_vllm() -> None:
    assert get_base_request_id("cmpl-abc-0-1A2B3C4D") == "cmpl-abc-0"
    assert get_base_request_id("cmpl-abc-0-1a2B3c4D") == "cmpl-abc-0"


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
    body = encode_push_reg(sample_registration())[len(PUSH_REG_PREFIX) :]
    decoded = msgspec.msgpack.decode(body)
    assert isinstance(decoded, dict)
    assert decoded["request_id"] == "cmpl-abc-0-1234abcd"
    assert decoded["local_block_ids"] == [[3, 7, 9]]  # one list per KV cache group (C-01)
    assert set(decoded) == VLLM_PUSH_REG_KEYS | {"decode_tp_rank"}


VLLM_PUSH_REG_KEYS = {
    "request_id",
    "decode_engine_id",
    "decode_host",
    "decode_port",
    "decode_tp_size",
    "local_block_ids",
    "remote_engine_id",
    "remote_host",
    "remote_port",
    "remote_tp_size",
    "remote_pp_size",
}
"""What vLLM 0.33's D scheduler puts in a registration (its P reads these)."""


def test_C_01_push_reg_of_a_stock_vllm_d_decodes_without_a_rank() -> None:
    raw = raw_reg_dict()
    del raw["decode_tp_rank"]
    reg = decode_push_reg(push_reg_bytes(raw), peer=PEER)
    assert reg.decode_tp_rank is None
    assert reg.block_ids == (3, 7, 9)


def test_C_01_push_reg_unknown_keys_are_skipped_like_vllm() -> None:
    reg = decode_push_reg(push_reg_bytes(raw_reg_dict(unexpected={"x": [1]})), peer=PEER)
    assert reg == sample_registration()


def test_R_P02_push_reg_allows_no_blocks() -> None:
    reg = sample_registration(block_ids=())
    assert decode_push_reg(encode_push_reg(reg)).block_ids == ()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (raw_reg_dict(local_block_ids=[[1, -2]]), r"local_block_ids"),
        (raw_reg_dict(local_block_ids=[[1, "2"]]), r"local_block_ids"),
        (raw_reg_dict(local_block_ids=[[1.0]]), r"local_block_ids"),
        (raw_reg_dict(local_block_ids=[1, 2]), r"local_block_ids"),
        (raw_reg_dict(local_block_ids=[[1], [2]]), r"2 KV cache groups"),
        (raw_reg_dict(local_block_ids=[]), r"0 KV cache groups"),
        (b"\x91" * 100, r"nested deeper"),
        (raw_reg_dict(request_id=""), r"request_id"),
        (raw_reg_dict(decode_engine_id=""), r"decode_engine_id"),
        (raw_reg_dict(decode_port="5600"), r"decode_port"),
        (raw_reg_dict(decode_port=0), r"decode_port"),
        (raw_reg_dict(remote_port=65536), r"remote_port"),
        (raw_reg_dict(decode_tp_size=True), r"decode_tp_size"),
        (raw_reg_dict(remote_tp_size=0), r"remote_tp_size"),
        (raw_reg_dict(decode_tp_rank=2), r"decode_tp_rank 2 is not below decode_tp_size 2"),
        ({k: v for k, v in raw_reg_dict().items() if k != "remote_host"}, r"remote_host"),
        ([1, 2, 3], r"malformed PUSH_REG"),
    ],
)
def test_R_P02_decode_push_reg_rejects_bad_fields(raw: Any, expected: str) -> None:
    data = PUSH_REG_PREFIX + raw if isinstance(raw, bytes) else push_reg_bytes(raw)
    with pytest.raises(RemoteProtocolError, match=expected) as info:
        decode_push_reg(data, peer=PEER)
    assert info.value.peer == PEER


def test_R_P02_decode_push_reg_caps_bytes_and_blocks() -> None:
    data = encode_push_reg(sample_registration(block_ids=tuple(range(100))))
    with pytest.raises(RemoteProtocolError, match="exceeds the 64-byte cap"):
        decode_push_reg(data, max_bytes=64)
    with pytest.raises(RemoteProtocolError, match="100 block ids exceed the cap of 99"):
        decode_push_reg(data, max_blocks=99)
    assert len(decode_push_reg(data, max_blocks=100).block_ids) == 100


def test_R_P02_decode_push_reg_needs_its_prefix() -> None:
    body = encode_push_reg(sample_registration())[len(PUSH_REG_PREFIX) :]
    with pytest.raises(RemoteProtocolError, match="PUSH_REG:"):
        decode_push_reg(b"PUSH_RE:" + body)


@pytest.mark.parametrize(
    "reg",
    [
        sample_registration(block_ids=(1, -1)),
        sample_registration(decode_tp_rank=2),
        sample_registration(request_id=""),
        sample_registration(decode_port=70000),
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
    field=st.sampled_from([*VLLM_PUSH_REG_KEYS, "decode_tp_rank", "extra"]),
    value=msgpack_values,
    drop=st.booleans(),
)
def test_R_P02_decode_push_reg_on_mutated_maps_raises_only_remote_errors(
    field: str, value: Any, drop: bool
) -> None:
    raw = raw_reg_dict()
    if drop:
        raw.pop(field, None)
    else:
        raw[field] = value
    try:
        reg = decode_push_reg(push_reg_bytes(raw), peer=PEER)
    except RemoteProtocolError as exc:
        assert exc.peer == PEER
    else:
        body = encode_push_reg(reg)[len(PUSH_REG_PREFIX) :]
        sent = msgspec.msgpack.decode(msgspec.msgpack.encode(raw))
        sent.pop("extra", None)  # unknown keys are skipped
        # optional fields come back with their default
        defaults = {"remote_pp_size": 1, "decode_tp_rank": None}
        assert msgspec.msgpack.decode(body) == {**defaults, **sent}


# --- S-01: a PUSH_REG of the closed form decodes without the structure walk --------

_DEEP = b"\x91" * 50_000 + b"\x00"
"""50,000 arrays deep: a recursive skip of it would exhaust the C stack."""


class _RefusesAll:
    """Stands in for the closed-form decoder: every message takes the walked path."""

    def decode(self, body: object) -> object:
        raise msgspec.ValidationError("forced onto the walked path")


def _outcome(data: bytes, *, walked_only: bool) -> PushRegistration | type[Exception]:
    patch = mock.patch.object(push_wire, "_CLOSED", _RefusesAll()) if walked_only else nullcontext()
    with patch:
        try:
            return decode_push_reg(data, peer=PEER)
        except RemoteProtocolError as exc:
            assert exc.peer == PEER
            return RemoteProtocolError


def _mapped(raw: dict[str, Any], field: str, value: Any) -> bytes:
    """The map's bytes with `field`'s value replaced by raw msgpack `value` bytes."""
    marker = 0x7B  # a fixint no sample field holds: replaced below by `value`
    body = msgspec.msgpack.encode({**raw, field: marker})
    at = body.rindex(bytes((marker,)))
    return PUSH_REG_PREFIX + body[:at] + value + body[at + 1 :]


def test_S_01_push_reg_of_known_keys_decodes_without_the_walk() -> None:
    """vLLM 0.33's map and kvhandoff's (with `decode_tp_rank`) never reach
    `check_msgpack`; a map with a key of neither does."""
    walked: list[str] = []
    stock = raw_reg_dict()
    del stock["decode_tp_rank"]

    def record(body: object, **limits: object) -> None:
        walked.append(str(limits["what"]))

    with mock.patch.object(push_wire, "check_msgpack", record):
        assert decode_push_reg(encode_push_reg(sample_registration())) == sample_registration()
        assert decode_push_reg(push_reg_bytes(stock)).decode_tp_rank is None
        assert walked == []
        decode_push_reg(push_reg_bytes(raw_reg_dict(unexpected=[1])))
    assert walked == ["PUSH_REG"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("local_block_ids", _DEEP),  # nested past the schema's own depth
        ("local_block_ids", b"\x91" + _DEEP),
        ("local_block_ids", b"\x91\xdd\xff\xff\xff\xff"),  # 2**32 - 1 ids announced
        ("local_block_ids", b"\x91\xdd\x00\x01\x00\x01" + b"\x01" * 0x10001),  # over the cap
        ("local_block_ids", b"\x92\x90\x90"),  # two KV cache groups
        ("request_id", b"\xdb\xff\xff\xff\xff"),  # a 4 GiB string announced
        ("decode_port", _DEEP),
        ("decode_tp_rank", b"\xc3"),
    ],
)
def test_S_01_push_reg_known_keys_with_hostile_values_are_refused_on_both_paths(
    field: str, value: bytes
) -> None:
    data = _mapped(raw_reg_dict(), field, value)
    assert _outcome(data, walked_only=False) is RemoteProtocolError
    assert _outcome(data, walked_only=True) is RemoteProtocolError


@settings(deadline=None, max_examples=300)
@given(
    edits=st.dictionaries(
        st.sampled_from([*VLLM_PUSH_REG_KEYS, "decode_tp_rank", "extra"]),
        msgpack_values | st.lists(st.lists(st.integers(-2, 2**33), max_size=6), max_size=3),
        max_size=4,
    ),
    dropped=st.sets(st.sampled_from([*VLLM_PUSH_REG_KEYS, "decode_tp_rank"]), max_size=2),
)
def test_S_01_push_reg_closed_decode_agrees_with_the_walked_decode(
    edits: dict[str, Any], dropped: set[str]
) -> None:
    """Whatever a peer puts in the map, skipping the walk changes no outcome."""
    raw = {k: v for k, v in raw_reg_dict(**edits).items() if k not in dropped}
    data = push_reg_bytes(raw)
    assert _outcome(data, walked_only=False) == _outcome(data, walked_only=True)


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
