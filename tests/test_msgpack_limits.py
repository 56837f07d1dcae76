"""S-01: `check_msgpack` skips runs of equal-width integers in C; its decisions must be
those of the plain walk that reads one object per loop turn (`integer_runs=False`):
the same messages accepted, the same refused with the same text, byte position included.
Messages are built with structure (integer lists of every width, nesting, maps), then
cut, corrupted or extended, and checked under small caps so every limit is met."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.msgpack_limits import check_msgpack


def _outcome(
    data: bytes,
    max_depth: int,
    max_items: int,
    *,
    integer_runs: bool,
    max_other: int | None = None,
) -> str | None:
    try:
        check_msgpack(
            data,
            max_depth=max_depth,
            max_items=max_items,
            max_other=max_other,
            integer_runs=integer_runs,
        )
    except RemoteProtocolError as exc:
        return str(exc)
    return None


def _agree(data: bytes, max_depth: int, max_items: int, max_other: int | None = None) -> bool:
    """The integer runs decide as the one-object-a-turn walk does."""
    fast = _outcome(data, max_depth, max_items, integer_runs=True, max_other=max_other)
    return fast == _outcome(data, max_depth, max_items, integer_runs=False, max_other=max_other)


# Integers of every msgpack width, signed and unsigned, in runs (block-id-like lists).
ints = st.one_of(
    st.integers(0, 127),
    st.integers(-32, -1),
    st.integers(128, 255),
    st.integers(256, 65535),
    st.integers(65536, 2**32 - 1),
    st.integers(2**32, 2**64 - 1),
    st.integers(-128, -33),
    st.integers(-(2**15), -129),
    st.integers(-(2**31), -(2**15) - 1),
    st.integers(-(2**63), -(2**31) - 1),
)
runs = st.lists(st.tuples(ints, st.integers(1, 40)), max_size=6).map(
    lambda parts: [value for value, times in parts for _ in range(times)]
)
scalars = st.one_of(ints, st.none(), st.booleans(), st.text(max_size=40), st.binary(max_size=40))
values = st.recursive(
    st.one_of(scalars, runs),
    lambda children: st.one_of(
        st.lists(children, max_size=6),
        st.dictionaries(st.text(max_size=8), children, max_size=5),
    ),
    max_leaves=30,
)


@st.composite
def messages(draw: st.DrawFn) -> bytes:
    """A msgpack message, then maybe cut, corrupted at one byte, or extended."""
    data = msgspec.msgpack.encode(draw(values))
    damage = draw(st.sampled_from(["none", "cut", "byte", "extend"]))
    if damage == "cut" and data:
        data = data[: draw(st.integers(0, len(data) - 1))]
    elif damage == "byte" and data:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
    elif damage == "extend":
        data += draw(st.binary(min_size=1, max_size=8))
    return data


@settings(max_examples=600, deadline=None)
@given(messages(), st.integers(1, 20), st.integers(1, 400), st.none() | st.integers(0, 40))
def test_S_01_integer_runs_decide_as_the_plain_walk(
    data: bytes, depth: int, items: int, other: int | None
) -> None:
    assert _agree(data, depth, items, other)


def test_S_01_objects_other_than_integers_are_capped_apart_from_integers() -> None:
    """A list of 1,000 integers and 3 strings passes a cap of 4 others (the list and the
    strings); a fourth string is one too many, whatever the integer count."""
    data = msgspec.msgpack.encode([*range(1000), "a", "b", "c"])
    check_msgpack(data, max_items=2000, max_other=4)
    with pytest.raises(RemoteProtocolError, match="more than 4 objects other than integers"):
        check_msgpack(
            msgspec.msgpack.encode([*range(1000), "a", "b", "c", "d"]), max_items=2000, max_other=4
        )


@pytest.mark.parametrize("cap", [0, 1, 2, 5, 16, 17, 18, 40])
def test_S_01_the_object_cap_is_met_inside_an_integer_run(cap: int) -> None:
    """A list of 3-byte integers: the refusal names the first object over the cap."""
    data = msgspec.msgpack.encode([1000 + i for i in range(16)])
    assert _agree(data, 16, cap)
    if cap <= 16:
        with pytest.raises(RemoteProtocolError, match=rf"more than {cap} objects \(at byte"):
            check_msgpack(data, max_items=cap)
    else:
        check_msgpack(data, max_items=cap)


def test_S_01_an_integer_list_one_level_too_deep_is_refused() -> None:
    data = msgspec.msgpack.encode([[[list(range(300, 310))]]])
    check_msgpack(data, max_depth=4, max_items=100)
    with pytest.raises(RemoteProtocolError, match="nested deeper than 3"):
        check_msgpack(data, max_depth=3, max_items=100)


def test_S_01_a_push_reg_full_of_strings_is_refused_after_its_cap_of_others() -> None:
    """A hostile `PUSH_REG` of about 1 MiB of short strings is refused by the cap on
    objects other than integers, long before the object cap (the walk's cost is bounded
    by the cap, not by the message); a real registration passes."""
    from push_wire_strategies import sample_registration

    from kvhandoff.protocol.push_wire import (
        MAX_PUSH_REG_OTHER,
        PUSH_REG_PREFIX,
        decode_push_reg,
        encode_push_reg,
    )

    hostile = PUSH_REG_PREFIX + msgspec.msgpack.encode({"request_id": ["ab"] * 300_000})
    assert len(hostile) > 800_000
    with pytest.raises(RemoteProtocolError, match=f"more than {MAX_PUSH_REG_OTHER} objects other"):
        decode_push_reg(hostile)
    reg = sample_registration(block_ids=tuple(range(4096)))
    assert decode_push_reg(encode_push_reg(reg)).block_ids == reg.block_ids
