"""`python -m kvhandoff.bench.probes.push_reg_decode`: what decoding one `PUSH_REG` costs
P's writer thread (msgspec's typed decode into the closed schema, the field checks), by
the number of block ids D registers; `--baseline` also times, in the same run, the walked
path every `PUSH_REG` took before (S-01's structure check, then the lenient decode:
`walked_us`) and that path with the one-object-a-turn walk
(`check_msgpack(..., integer_runs=False)`: `one_object_a_turn_us`). `--hostile` times instead how
long P's writer spends refusing `PUSH_REG`s of about 1 MiB that a peer could send (a list
of 3-byte integers, of fixints, of short strings). Prints one JSON line: µs per
`decode_push_reg`, best of 5."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec

import kvhandoff.protocol.push_wire as push_wire
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.msgpack_limits import check_msgpack
from kvhandoff.protocol.push_wire import (
    PUSH_REG_PREFIX,
    PushRegistration,
    decode_push_reg,
    encode_push_reg,
)


def _registration(blocks: int) -> bytes:
    reg = PushRegistration(
        request_id="cmpl-3f2a9c1e-0-ffff0000",
        decode_engine_id="decode-0",
        decode_host="10.0.0.2",
        decode_port=5600,
        decode_tp_size=1,
        block_ids=tuple(range(1000, 1000 + blocks)),
        remote_engine_id="prefill-0",
        remote_host="10.0.0.1",
        remote_port=5600,
        remote_tp_size=1,
    )
    return encode_push_reg(reg)


def _best_us(call: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            call()
        best = min(best, (time.perf_counter() - start) / reps)
    return round(best * 1e6, 2)


def _one_object_a_turn(data: Any, **limits: Any) -> None:
    check_msgpack(data, **limits, integer_runs=False)


class _RefusesAll:
    """Stands in for the closed-form decoder: every message takes the walked path."""

    def decode(self, body: object) -> object:
        raise msgspec.ValidationError("forced onto the walked path")


def run(block_counts: list[int], baseline: bool) -> dict[str, Any]:
    result: dict[str, Any] = {}
    namespace = vars(push_wire)  # where `decode_push_reg` finds its decoder and checker
    closed = namespace["_CLOSED"]
    for blocks in block_counts:
        decode = partial(decode_push_reg, _registration(blocks))
        reps = max(20, 40_000 // (blocks + 16))
        row = {"decode_us": _best_us(decode, reps)}
        if baseline:
            namespace["_CLOSED"] = _RefusesAll()
            try:
                row["walked_us"] = _best_us(decode, reps)
                namespace["check_msgpack"] = _one_object_a_turn
                row["one_object_a_turn_us"] = _best_us(decode, reps)
            finally:
                namespace["check_msgpack"] = check_msgpack
                namespace["_CLOSED"] = closed
            row["speedup_over_walked"] = round(row["walked_us"] / row["decode_us"], 2)
        result[str(blocks)] = row
    return result


HOSTILE: dict[str, Any] = {
    "ints_3_byte": [300] * 349_000,  # 3 bytes each
    "fixints": [7] * 1_040_000,
    "short_strings": ["ab"] * 349_000,  # 3 bytes each
}
"""About 1 MiB bodies under an unknown key (refused by the structure check's caps)."""


def _refuse(data: bytes) -> None:
    try:
        decode_push_reg(data)
    except RemoteProtocolError:
        return
    raise AssertionError("a hostile PUSH_REG was accepted")


def _without_other_cap(data: Any, **limits: Any) -> None:
    limits.pop("max_other", None)
    check_msgpack(data, **limits)


def hostile(baseline: bool) -> dict[str, float]:
    """Microseconds P's writer spends refusing each hostile `PUSH_REG`; with `baseline`,
    also without the cap on objects other than integers (the check before it), same run."""
    out: dict[str, float] = {}
    namespace = vars(push_wire)
    for name, body in HOSTILE.items():
        data = PUSH_REG_PREFIX + msgspec.msgpack.encode({"padding": body})
        key = f"{name}_{len(data) >> 10}KiB"
        out[f"{key}_us"] = _best_us(partial(_refuse, data), 3)
        if baseline:
            namespace["check_msgpack"] = _without_other_cap
            try:
                out[f"{key}_without_other_cap_us"] = _best_us(partial(_refuse, data), 3)
            finally:
                namespace["check_msgpack"] = check_msgpack
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 256, 2048])
    parser.add_argument(
        "--baseline", action="store_true", help="also time the one-object-a-turn walk"
    )
    parser.add_argument(
        "--hostile", action="store_true", help="time refusing ~1 MiB hostile PUSH_REGs"
    )
    args = parser.parse_args()
    result = hostile(args.baseline) if args.hostile else run(args.blocks, args.baseline)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
