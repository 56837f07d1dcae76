"""S-01: `check_msgpack` skips runs of equal-width integers in C; its decisions must be
those of the plain walk that reads one object per loop turn (kept here as the reference):
the same messages accepted, the same refused with the same text, byte position included.
Messages are built with structure (integer lists of every width, nesting, maps), then
cut, corrupted or extended, and checked under small caps so every limit is met."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.msgpack_limits import check_msgpack

_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}
_FIXED |= {0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8, 0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1)}
_SIZED |= {0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0)}
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def reference_walk(data: bytes, *, max_depth: int, max_items: int) -> None:
    """One object per loop turn: the walk `check_msgpack` must agree with."""
    size, pos, items, stack = len(data), 0, 0, [1]

    def fail(problem: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"message refused: {problem} (at byte {pos})")

    while stack:
        if stack[-1] == 0:
            stack.pop()
            continue
        stack[-1] -= 1
        if pos >= size:
            raise fail("truncated msgpack")
        items += 1
        if items > max_items:
            raise fail(f"more than {max_items} objects")
        head = data[pos]
        pos += 1
        count, slots = 0, 1
        if head <= 0x7F or head >= 0xE0:
            continue
        if head <= 0x8F:
            count, slots = head & 0x0F, 2
        elif head <= 0x9F:
            count = head & 0x0F
        elif head <= 0xBF:
            pos += head & 0x1F
            if pos > size:
                raise fail("string runs past the end")
            continue
        elif head in _FIXED:
            pos += _FIXED[head]
            if pos > size:
                raise fail("truncated msgpack")
            continue
        elif head in _SIZED:
            width, extra = _SIZED[head]
            if pos + width > size:
                raise fail("truncated msgpack")
            length = int.from_bytes(data[pos : pos + width], "big")
            pos += width + extra + length
            if pos > size:
                raise fail(f"a {length}-byte payload runs past the end")
            continue
        elif head in _CONTAINERS:
            width, slots = _CONTAINERS[head]
            if pos + width > size:
                raise fail("truncated msgpack")
            count = int.from_bytes(data[pos : pos + width], "big")
            pos += width
        else:
            raise fail(f"reserved msgpack byte 0x{head:02x}")
        needed = count * slots
        if needed > size - pos:
            raise fail(f"a container announces {count} elements, more than the bytes left")
        if needed:
            if len(stack) > max_depth:
                raise fail(f"nested deeper than {max_depth}")
            stack.append(needed)
    if pos != size:
        raise fail(f"{size - pos} bytes after the message")


def _outcome(check: Any, data: bytes, max_depth: int, max_items: int) -> str | None:
    try:
        check(data, max_depth=max_depth, max_items=max_items)
    except RemoteProtocolError as exc:
        return str(exc)
    return None


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
@given(messages(), st.integers(1, 20), st.integers(1, 400))
def test_S_01_integer_runs_decide_as_the_plain_walk(data: bytes, depth: int, items: int) -> None:
    assert _outcome(check_msgpack, data, depth, items) == _outcome(
        reference_walk, data, depth, items
    )


@pytest.mark.parametrize("cap", [0, 1, 2, 5, 16, 17, 18, 40])
def test_S_01_the_object_cap_is_met_inside_an_integer_run(cap: int) -> None:
    """A list of 3-byte integers: the refusal names the first object over the cap."""
    data = msgspec.msgpack.encode([1000 + i for i in range(16)])
    assert _outcome(check_msgpack, data, 16, cap) == _outcome(reference_walk, data, 16, cap)
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
