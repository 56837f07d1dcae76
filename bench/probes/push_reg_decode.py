"""`python -m kvhandoff.bench.probes.push_reg_decode`: what decoding one `PUSH_REG` costs
P's writer thread (S-01's structure check, msgspec's typed decode, the field checks), by
the number of block ids D registers; `--baseline` also times the one-object-a-turn walk
(`check_msgpack(..., integer_runs=False)`) in the same run. Prints one JSON line: µs per
`decode_push_reg`, best of 5."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import kvhandoff.protocol.push_wire as push_wire
from kvhandoff.protocol.msgpack_limits import check_msgpack
from kvhandoff.protocol.push_wire import PushRegistration, decode_push_reg, encode_push_reg


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


def run(block_counts: list[int], baseline: bool) -> dict[str, Any]:
    result: dict[str, Any] = {}
    namespace = vars(push_wire)  # where `decode_push_reg` finds its checker
    for blocks in block_counts:
        decode = partial(decode_push_reg, _registration(blocks))
        reps = max(20, 40_000 // (blocks + 16))
        row = {"decode_us": _best_us(decode, reps)}
        if baseline:
            namespace["check_msgpack"] = _one_object_a_turn
            try:
                row["baseline_decode_us"] = _best_us(decode, reps)
            finally:
                namespace["check_msgpack"] = check_msgpack
            row["speedup"] = round(row["baseline_decode_us"] / row["decode_us"], 2)
        result[str(blocks)] = row
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 256, 2048])
    parser.add_argument(
        "--baseline", action="store_true", help="also time the one-object-a-turn walk"
    )
    args = parser.parse_args()
    print(json.dumps(run(args.blocks, args.baseline)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
