"""Structural limits of untrusted msgpack, checked before any decoder sees it (S-01).

A decoder that recurses (msgspec skipping an unknown field, the stdlib, any tree walk)
can be killed by a few kilobytes of nested arrays: `b"\\x91" * 4000` is 4,000 arrays
deep. `check_msgpack` walks one msgpack object iteratively, with an explicit stack, and
refuses it before anything recursive touches it when:

- it nests deeper than `max_depth` arrays and maps;
- it holds more than `max_items` objects in all (a map entry counts twice);
- it holds more than `max_other` objects that are not integers, when given (strings,
  maps, arrays, ...: a message that is mostly integers, like a `PUSH_REG`, then costs
  the walk a bounded number of Python loop turns, whatever a peer puts in it);
- a string, binary, extension, array or map announces more than the bytes that are left
  (so a header cannot make a decoder allocate for elements that are not there);
- it is truncated, uses the reserved byte `0xc1`, or has bytes after the object.

Pure Python, no msgspec: the local tier may import it (R-E02). It reads each header
once, so its cost is linear in the number of objects, not in the bytes of strings. The
elements of an array that are integers of one width (a PUSH_REG's block ids) are skipped
a run at a time in C (a fixint run by one `re` match, a run of wider integers by
stripping its type byte from every `width`-th byte) instead of one Python loop turn each:
the same objects are counted, the same limits apply at the same byte, and
`tests/test_msgpack_limits.py` checks the result against the one-object-at-a-time walk
(`integer_runs=False`) on generated messages. Every failure is a `RemoteProtocolError`
naming `what` and `peer`.
"""

from __future__ import annotations

import re
from typing import Final

from kvhandoff.protocol.errors import RemoteProtocolError

__all__ = ["DEFAULT_MAX_DEPTH", "check_msgpack"]

DEFAULT_MAX_DEPTH: Final[int] = 16
"""Deepest nesting any control message of ours needs, with room to spare."""

_Bytes = bytes | bytearray | memoryview

# Lengths of the fixed-size types, by first byte (0 for the ones decoded below).
_FIXED: Final[dict[int, int]] = {
    0xC0: 0,  # nil
    0xC2: 0,  # false
    0xC3: 0,  # true
    0xCA: 4,  # float 32
    0xCB: 8,  # float 64
    0xCC: 1,  # uint 8
    0xCD: 2,
    0xCE: 4,
    0xCF: 8,
    0xD0: 1,  # int 8
    0xD1: 2,
    0xD2: 4,
    0xD3: 8,
    0xD4: 2,  # fixext 1 (type byte + data)
    0xD5: 3,
    0xD6: 5,
    0xD7: 9,
    0xD8: 17,
}
# Types whose length follows in 1, 2 or 4 bytes: (length bytes, extra type byte).
_SIZED: Final[dict[int, tuple[int, int]]] = {
    0xC4: (1, 0),  # bin 8
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xC7: (1, 1),  # ext 8
    0xC8: (2, 1),
    0xC9: (4, 1),
    0xD9: (1, 0),  # str 8
    0xDA: (2, 0),
    0xDB: (4, 0),
}
# Containers whose count follows in 2 or 4 bytes: (count bytes, slots per element).
_CONTAINERS: Final[dict[int, tuple[int, int]]] = {
    0xDC: (2, 1),  # array 16
    0xDD: (4, 1),
    0xDE: (2, 2),  # map 16
    0xDF: (4, 2),
}

# Integers past the fixints, by first byte: (width with the type byte, that byte alone).
_INT_WIDTHS: Final[dict[int, tuple[int, bytes]]] = {
    head: (width, bytes((head,)))
    for head, width in (
        (0xCC, 2),  # uint 8
        (0xCD, 3),
        (0xCE, 5),
        (0xCF, 9),
        (0xD0, 2),  # int 8
        (0xD1, 3),
        (0xD2, 5),
        (0xD3, 9),
    )
}
# A run of fixints, positive or negative (one byte each).
_FIXINT_RUN: Final = re.compile(rb"[\x00-\x7f\xe0-\xff]*")


def check_msgpack(
    data: _Bytes,
    *,
    max_depth: int = DEFAULT_MAX_DEPTH,
    max_items: int,
    what: str = "message",
    peer: str | None = None,
    max_other: int | None = None,
    integer_runs: bool = True,
) -> None:
    """Raise `RemoteProtocolError` unless `data` is exactly one msgpack object within the
    limits (see the module docstring). `integer_runs=False` reads one object per loop
    turn: the same decisions, slower (the reference the fast path is tested and
    benchmarked against)."""
    view = data if isinstance(data, bytes) else bytes(data)  # one copy: C-speed slices
    size = len(view)
    pos = 0
    items = 0
    others = 0
    # No cap: one the walk cannot reach (every object takes at least one byte).
    other_cap = size if max_other is None else max_other
    # Slots still to read at each open level; the top level has one.
    stack = [1]

    def fail(problem: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"{what} refused: {problem} (at byte {pos})", peer=peer)

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
        head = view[pos]
        pos += 1
        count = 0
        slots = 1
        if head <= 0x7F or head >= 0xE0:  # positive and negative fixint
            continue
        if head < 0xCC or head > 0xD3:  # anything but the wider integers
            others += 1
            if others > other_cap:
                raise fail(f"more than {max_other} objects other than integers")
        if head <= 0x8F:  # fixmap
            count, slots = head & 0x0F, 2
        elif head <= 0x9F:  # fixarray
            count = head & 0x0F
        elif head <= 0xBF:  # fixstr
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
            length = int.from_bytes(view[pos : pos + width], "big")
            pos += width + extra + length
            if pos > size:
                raise fail(f"a {length}-byte payload runs past the end")
            continue
        elif head in _CONTAINERS:
            width, slots = _CONTAINERS[head]
            if pos + width > size:
                raise fail("truncated msgpack")
            count = int.from_bytes(view[pos : pos + width], "big")
            pos += width
        else:  # 0xc1, never used
            raise fail(f"reserved msgpack byte 0x{head:02x}")
        needed = count * slots
        if needed > size - pos:
            raise fail(f"a container announces {count} elements, more than the bytes left")
        if needed:
            if len(stack) > max_depth:
                raise fail(f"nested deeper than {max_depth}")
            if slots == 1 and integer_runs:  # an array's leading integer runs at once
                while needed and pos < size:
                    head = view[pos]
                    if head <= 0x7F or head >= 0xE0:
                        matched = _FIXINT_RUN.match(view, pos, min(size, pos + needed))
                        width = 1
                        taken = 0 if matched is None else matched.end() - pos  # `*`: never None
                    elif head in _INT_WIDTHS:
                        # Every `width`-th byte from here is a type byte while the run lasts.
                        width, type_byte = _INT_WIDTHS[head]
                        heads = view[pos : min(size, pos + needed * width) : width]
                        whole = (size - pos) // width  # the last one may be cut short
                        taken = min(len(heads) - len(heads.lstrip(type_byte)), whole)
                    else:
                        break
                    if not taken:  # a truncated integer: the walk below says so
                        break
                    if items + taken > max_items:
                        pos += (max_items - items) * width  # the first object over the cap
                        raise fail(f"more than {max_items} objects")
                    items += taken
                    pos += taken * width
                    needed -= taken
                if not needed:
                    continue
            stack.append(needed)
    if pos != size:
        raise fail(f"{size - pos} bytes after the message")
