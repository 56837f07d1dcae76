"""`python -m kvhandoff.bench.probes.push_nixl_sweep`: the CLI's push bench on the NIXL-only
path at several `nixl_post_every` values (issue 18: the framework against raw per-request
WRITEs of its own descriptors), one JSON line each."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kvhandoff.bench.push import config_for, run_push_bench
from kvhandoff.bench.push_kv import Device


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--post-every", default="0,4,8", help="0: one transfer per pass")
    parser.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    device: Device = args.device
    for every in (int(e) for e in args.post_every.split(",")):
        cfg = replace(config_for(device, False, "nixl"), nixl_post_every=every, reps=args.reps)
        result = run_push_bench(cfg, lambda line: print(line, file=sys.stderr))
        keep = (
            "framework_gbps",
            "baseline_gbps",
            "ratio",
            "raw_per_request_gbps",
            "ratio_vs_raw_per_request",
            "latency_ms",
            "p_counters",
        )
        verified = all(v for k, v in result.items() if k.endswith("_verified"))
        print(
            json.dumps(
                {
                    "post_every": every,
                    **{k: result.get(k) for k in keep},
                    "verified": verified,
                    "phases": result["framework_phases_ms"][-1],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
