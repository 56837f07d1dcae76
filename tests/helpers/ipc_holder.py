"""D for tests/test_push_ipc_gpu.py: holds two layers of K/V regions on the GPU, prints
its CUDA IPC export (hex) and checks, on request, what P wrote into them.

`ipc_holder.py [GPU]`: the regions live on that GPU (default 0; another one for the
tests across GPUs, tests/test_push_ipc_peer_gpu.py).

Commands on stdin, one a line: `verify <json [[p_block, d_block], ...]>` answers `ok` or
`bad ...`; `exit` ends it.
"""

from __future__ import annotations

import json
import sys

import torch

from kvhandoff.adapters.cuda.ipc_export import build_export, encode_export
from kvhandoff.protocol.member_routing import MemberSlot

BLOCKS, WORDS = 16, 512  # 4 KiB blocks


def pattern(region: int, block: int) -> torch.Tensor:
    base = (region << 24) + (block << 12)
    return torch.arange(WORDS, dtype=torch.int64, device="cuda") + base


def main() -> int:
    gpu = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    torch.cuda.set_device(gpu)
    layers = [torch.full((2, BLOCKS, WORDS), -1, dtype=torch.int64, device="cuda") for _ in (0, 1)]
    regions = [t[kv] for t in layers for kv in (0, 1)]
    slots = tuple(
        MemberSlot(f"layer.{r // 2}.{'kv'[r % 2]}", r // 2, r_t.data_ptr(), WORDS * 8, BLOCKS)
        for r, r_t in enumerate(regions)
    )
    torch.cuda.synchronize()
    print(encode_export(build_export(slots, gpu)).hex(), flush=True)
    for line in sys.stdin:
        op, _, arg = line.strip().partition(" ")
        if op == "exit":
            return 0
        pairs = json.loads(arg)
        torch.cuda.synchronize()
        bad = []
        written = {d for _, d in pairs}
        for r, region in enumerate(regions):
            for p_block, d_block in pairs:
                if not torch.equal(region[d_block], pattern(r, p_block)):
                    bad.append((r, d_block))
            for d_block in range(BLOCKS):
                if d_block not in written and not bool((region[d_block] == -1).all()):
                    bad.append((r, d_block, "touched"))
        print("ok" if not bad else f"bad {bad[:5]}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
