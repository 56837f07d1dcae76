"""Run `kvhandoff bench push` in several configurations; one JSON line per configuration.

    python3 bench/push_sweep.py --device cuda --out sweep.jsonl [--variants a,b] [--reps 3]

Each line holds the variant's name, its overrides of `PushBenchConfig`, and the bench
result: framework, baseline, and the two diagnostics without the framework (the same block
descriptors in one raw WRITE per request, and in one raw WRITE for all requests). A failed
variant is recorded with its error and the sweep goes on. The table printed last is what
bench/RESULTS.md quotes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

from kvhandoff.bench.push import PushBenchConfig, run_push_bench

VARIANTS: dict[str, dict[str, Any]] = {
    # per-layer K/V regions (the CLI's layout): 64 descriptors per block
    "layer": {},
    "layer_sgl": {"ucx_sgl": True},
    "layer_req8_sgl": {"requests": 8, "ucx_sgl": True},
    "layer_4gib_sgl": {"blocks": 2048, "ucx_sgl": True},
    "layer_scattered_sgl": {"scattered": True, "ucx_sgl": True},
    # one cross-layer region: one descriptor per block
    "cross_sgl": {"kv_layout": "cross_layer", "ucx_sgl": True},
    "cross": {"kv_layout": "cross_layer"},
    "cross_req16_sgl": {"kv_layout": "cross_layer", "requests": 16, "ucx_sgl": True},
    "cross_req8_sgl": {"kv_layout": "cross_layer", "requests": 8, "ucx_sgl": True},
    "cross_4gib_sgl": {"kv_layout": "cross_layer", "blocks": 2048, "ucx_sgl": True},
    "cross_scattered_sgl": {"kv_layout": "cross_layer", "scattered": True, "ucx_sgl": True},
    "cross_step4_sgl": {"kv_layout": "cross_layer", "finish_per_step": 4, "ucx_sgl": True},
    "cross_step200us_sgl": {"kv_layout": "cross_layer", "step_us": 200.0, "ucx_sgl": True},
    "cross_noprogress_sgl": {
        "kv_layout": "cross_layer",
        "progress_thread": False,
        "ucx_sgl": True,
    },
    # the CUDA IPC path on the layer layout, fewer and larger requests (the same 1 GiB):
    # how the framework's per-request host cost scales out
    "ipc": {"transport": "cuda_ipc", "ucx_sgl": True, "diagnose": False},
    "ipc_req16": {"transport": "cuda_ipc", "requests": 16, "ucx_sgl": True, "diagnose": False},
    "ipc_req8": {"transport": "cuda_ipc", "requests": 8, "ucx_sgl": True, "diagnose": False},
    "ipc_req4": {"transport": "cuda_ipc", "requests": 4, "ucx_sgl": True, "diagnose": False},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    rows = []
    for name in args.variants.split(","):
        overrides = VARIANTS[name]
        settings: dict[str, Any] = {"diagnose": True, **overrides}
        cfg = replace(PushBenchConfig(), device=args.device, reps=args.reps, **settings)
        started = time.monotonic()
        try:

            def progress(message: str, variant: str = name) -> None:
                print(f"[{variant}] {message}", flush=True)

            result = run_push_bench(cfg, progress)
        except Exception as exc:  # record it and go on with the next variant
            result = {"error": f"{type(exc).__name__}: {exc}"}
        row = {"variant": name, "overrides": overrides, "seconds": time.monotonic() - started}
        row.update(result)
        rows.append(row)
        with open(args.out, "a") as out:
            out.write(json.dumps(row) + "\n")
    head = ("framework", "baseline", "ratio", "raw/req", "raw/one", "fw/raw")
    print(f"{'variant':22}" + "".join(f"{h:>11}" for h in head) + "  verified")
    for row in rows:
        if "error" in row:
            print(f"{row['variant']:22} ERROR {row['error'][:200]}")
            continue
        ok = all(v for k, v in row.items() if k.endswith("_verified"))
        per_request = row.get("raw_per_request_gbps", float("nan"))
        cells = (
            row["framework_gbps"],
            row["baseline_gbps"],
            row["ratio"],
            per_request,
            row.get("raw_one_write_gbps", float("nan")),
            row["framework_gbps"] / per_request,
        )
        print(f"{row['variant']:22}" + "".join(f"{c:11.3f}" for c in cells) + f"  {ok}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
