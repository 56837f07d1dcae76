"""`python -m kvhandoff.bench.probes.push_ipc_kernel`: the CUDA IPC gather-scatter kernel
alone, between two processes on one GPU (issue 18), against one 1 GiB device copy.

D (a child process) holds the bench's layer layout (64 regions x 512 blocks x 32 KiB,
1 GiB) and exports it; P opens it once (`OpenedPeer`) and moves 32 requests x 16 blocks
in every region: one launch for all, and one launch per request. Medians of `--reps`
timed runs after a warm-up; D checks every pushed word after the last run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from kvhandoff.adapters.cuda.ipc_export import build_export, decode_export, encode_export
from kvhandoff.protocol.member_routing import MemberSlot

LAYERS, BLOCKS, WORDS, REQUESTS = 32, 512, 4096, 32
PER = BLOCKS // REQUESTS


def _regions() -> tuple[list[torch.Tensor], list[torch.Tensor], tuple[MemberSlot, ...]]:
    layers = [
        torch.full((2, BLOCKS, WORDS), -1, dtype=torch.int64, device="cuda") for _ in range(LAYERS)
    ]
    regions = [t[kv] for t in layers for kv in (0, 1)]
    slots = tuple(
        MemberSlot(f"layer.{r // 2}.{'kv'[r % 2]}", r // 2, t.data_ptr(), WORDS * 8, BLOCKS)
        for r, t in enumerate(regions)
    )
    return layers, regions, slots


def _d_blocks(q: int) -> list[int]:
    return list(range((REQUESTS - 1 - q) * PER, (REQUESTS - q) * PER))


def _decode() -> int:
    torch.cuda.set_device(0)
    _layers, regions, slots = _regions()
    torch.cuda.synchronize()
    print(encode_export(build_export(slots, 0)).hex(), flush=True)
    sys.stdin.readline()  # P is done
    torch.cuda.synchronize()
    d_ids = torch.tensor([d for q in range(REQUESTS) for d in _d_blocks(q)], device="cuda")
    s_ids = torch.arange(REQUESTS * PER, device="cuda")
    ok = True
    for r, region in enumerate(regions):
        ok = ok and bool((region[d_ids] == (s_ids + (r << 32))[:, None]).all())
    print("ok" if ok else "bad", flush=True)
    return 0


def _time(fn: object, reps: int) -> float:
    samples = []
    for i in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        torch.cuda.synchronize()
        if i:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", default="prefill")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if args.role == "decode":
        return _decode()
    from kvhandoff.adapters.cuda.ipc_peer import OpenedPeer

    torch.cuda.set_device(0)
    child = subprocess.Popen(
        [sys.executable, "-m", "kvhandoff.bench.probes.push_ipc_kernel", "--role", "decode"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    export = decode_export(bytes.fromhex(child.stdout.readline().strip()))
    _layers, regions, slots = _regions()
    for r, region in enumerate(regions):
        region.copy_(torch.arange(BLOCKS, device="cuda")[:, None] + (r << 32))
    peer = OpenedPeer(export, slots, 0)
    local = [list(range(q * PER, (q + 1) * PER)) for q in range(REQUESTS)]
    remote = [_d_blocks(q) for q in range(REQUESTS)]
    flat_l = [b for ids in local for b in ids]
    flat_r = [b for ids in remote for b in ids]
    nbytes = LAYERS * 2 * REQUESTS * PER * WORDS * 8
    one = _time(lambda: peer.launch(flat_l, flat_r), args.reps)

    def each_request() -> None:
        for a, b in zip(local, remote, strict=True):
            peer.launch(a, b)

    per_request = _time(each_request, args.reps)
    src = torch.empty(nbytes // 8, dtype=torch.int64, device="cuda")
    dst = torch.empty_like(src)
    copy = _time(lambda: dst.copy_(src), args.reps)
    child.stdin.write("done\n")
    child.stdin.flush()
    verified = child.stdout.readline().strip() == "ok"
    peer.close()
    child.wait(timeout=60)
    print(
        json.dumps(
            {
                "bytes": nbytes,
                "one_launch_gbps": round(nbytes / one / 1e9, 1),
                "launch_per_request_gbps": round(nbytes / per_request / 1e9, 1),
                "device_copy_gbps": round(nbytes / copy / 1e9, 1),
                "one_launch_ms": round(one * 1e3, 3),
                "verified": verified,
            }
        )
    )
    return 0 if verified else 1


if __name__ == "__main__":
    raise SystemExit(main())
