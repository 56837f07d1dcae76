"""Does pre-coalescing block descriptors help a NIXL WRITE? (bench/RESULTS.md, "## Push").

    python3 bench/desc_merge_probe.py [--device cpu|cuda] [--blocks 512] [--reps 5]

Two NIXL agents (UCX) in one process, each with one buffer cut into the bench's layer
layout (64 regions x N blocks x 32 KiB). up to 32 requests of 16 consecutive blocks per region
(P's runs ascending, D's in reverse request order, as in `kvhandoff bench push`) are
written with one WRITE per request, in three ways:

- `per_block`: one index per (region, block) into per-block lists (what the framework
  posts): 1,024 indices per request;
- `per_block_nomerge`: the same with NIXL's descriptor merge turned off
  (`skip_desc_merge=True`): 1,024 descriptors reach the backend;
- `coarse`: lists prepared with one descriptor per 16-block run: 64 indices per request.

Printed per variant: median `make_prepped_xfer` time per request (µs) and median time to
post all WRITEs and see them done (ms). Also the prep time of a per-block list and of a
list holding every power-of-two run length 1..128 starting at every block.
With `NIXL_LOG_LEVEL=DEBUG` NIXL logs "merged X indices into Y descriptors" per request.
Both agents live in one process, so on CUDA UCX does not take its cuda_ipc path (absolute
GB/s are far below `kvhandoff bench push`, and `NIXL_UCX_SGL_ENABLE=1` finds no protocol);
compare the variants with one another, not with the bench.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Literal

import numpy as np

from kvhandoff.adapters.nixl.agent import NixlAgent

REGIONS, BLOCK_LEN, REQUESTS, RUN = 64, 32 * 1024, 32, 16


def _alloc(nbytes: int, device: str, fill: bool) -> Any:
    """A byte buffer: random bytes for P's side (`fill`), zeros for D's."""
    if device == "cuda":
        import torch

        if fill:
            return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
        return torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    if fill:
        return np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    return np.zeros(nbytes, dtype=np.uint8)


def _landed(src: Any, dst: Any, n: int, requests: int) -> bool:
    """D's run `requests - 1 - q` holds P's run `q` in every region; zero D afterwards."""
    s = src.reshape(REGIONS, n, BLOCK_LEN)
    d = dst.reshape(REGIONS, n, BLOCK_LEN)
    ok = True
    for q in range(requests):
        p_run = s[:, q * RUN : (q + 1) * RUN]
        qd = requests - 1 - q
        d_run = d[:, qd * RUN : (qd + 1) * RUN]
        ok = ok and bool((p_run == d_run).all())
    if hasattr(dst, "zero_"):
        dst.zero_()
    else:
        dst.fill(0)
    return ok


def _addr(buf: Any) -> int:
    return int(buf.data_ptr()) if hasattr(buf, "data_ptr") else int(buf.ctypes.data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    n = args.blocks
    mem: Literal["DRAM", "VRAM"] = "VRAM" if args.device == "cuda" else "DRAM"
    size = REGIONS * n * BLOCK_LEN
    bufs = [_alloc(size, args.device, fill) for fill in (True, False)]
    src, dst = NixlAgent("probe-p"), NixlAgent("probe-d")
    for agent, buf in ((src, bufs[0]), (dst, bufs[1])):
        if mem == "VRAM":
            agent.register_vram(_addr(buf), size, 0)
        else:
            agent.register_dram(_addr(buf), size)
    peer = src.add_remote(dst.metadata())

    def regions(buf: Any, block_len: int) -> list[tuple[int, int, int]]:
        base = _addr(buf)
        return [
            (base + r * n * BLOCK_LEN, block_len, n * BLOCK_LEN // block_len) for r in range(64)
        ]

    t0 = time.perf_counter()
    loc = src.prep_local_blocks(regions(bufs[0], BLOCK_LEN), mem)
    rem = src.prep_remote_blocks(peer, regions(bufs[1], BLOCK_LEN), mem)
    prep_block_ms = (time.perf_counter() - t0) * 1e3 / 2
    loc16 = src.prep_local_blocks(regions(bufs[0], RUN * BLOCK_LEN), mem)
    rem16 = src.prep_remote_blocks(peer, regions(bufs[1], RUN * BLOCK_LEN), mem)

    # Every power-of-two run 1..128 starting at every block, per region (the rejected design).
    levels = [1 << k for k in range(8) if (1 << k) <= n]
    rows = [
        (_addr(bufs[0]) + r * n * BLOCK_LEN + b * BLOCK_LEN, length * BLOCK_LEN, 0)
        for r in range(REGIONS)
        for length in levels
        for b in range(n - length + 1)
    ]
    t0 = time.perf_counter()
    multi = src._agent.prep_xfer_dlist("NIXL_INIT_AGENT", np.array(rows, dtype=np.uint64), mem)
    prep_multi_ms = (time.perf_counter() - t0) * 1e3
    multi.release()

    requests = min(REQUESTS, n // RUN)
    pushed = requests * RUN * REGIONS * BLOCK_LEN
    p_runs = [list(range(q * RUN, (q + 1) * RUN)) for q in range(requests)]
    d_runs = list(reversed(p_runs))
    variants: dict[str, tuple[Any, Any, list[tuple[Any, Any]], bool]] = {
        "per_block": (loc, rem, [], False),
        "per_block_nomerge": (loc, rem, [], True),
        "coarse": (loc16, rem16, [], False),
    }
    for name, (lp, rp, pairs, _) in variants.items():
        for q in range(requests):
            if name == "coarse":
                li = lp.layout.indices_for_blocks([p_runs[q][0] // RUN])
                ri = rp.layout.indices_for_blocks([d_runs[q][0] // RUN])
            else:
                li = lp.layout.indices_for_blocks(p_runs[q])
                ri = rp.layout.indices_for_blocks(d_runs[q])
            pairs.append((np.ascontiguousarray(li, np.int32), np.ascontiguousarray(ri, np.int32)))

    print(f"device={args.device} blocks/region={n} bytes pushed={pushed} requests={requests}")
    print(f"prep per-block list: {prep_block_ms:.1f} ms ({REGIONS * n} descriptors)")
    print(f"prep all pow2 runs 1..{levels[-1]}: {prep_multi_ms:.1f} ms ({len(rows)} descriptors)")
    agent = src._agent
    for name, (lp, rp, pairs, skip) in variants.items():
        make_us: list[float] = []
        total_ms: list[float] = []
        for _rep in range(args.reps + 1):
            handles = []
            t0 = time.perf_counter()
            for li, ri in pairs:
                t1 = time.perf_counter()
                h = agent.make_prepped_xfer(
                    "WRITE", lp.raw, li, rp.raw, ri, b"", skip_desc_merge=skip
                )
                make_us.append((time.perf_counter() - t1) * 1e6)
                agent.transfer(h)
                handles.append(h)
            for h in handles:
                while agent.check_xfer_state(h) == "PROC":
                    pass
            total_ms.append((time.perf_counter() - t0) * 1e3)
            for h in handles:
                h.release()
        if args.device == "cuda":
            import torch

            torch.cuda.synchronize()
        landed = _landed(bufs[0], bufs[1], n, requests)
        gbps = pushed / (statistics.median(total_ms[1:]) * 1e6)
        print(
            f"{name:18} indices/request={pairs[0][0].size:5d}"
            f"  make_prepped_xfer {statistics.median(make_us):7.1f} us"
            f"  {requests} WRITEs {statistics.median(total_ms[1:]):8.2f} ms ({gbps:7.1f} GB/s)"
            f"  bytes ok: {landed}"
        )
    src.close()
    dst.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
