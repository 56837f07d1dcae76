"""`python -m kvhandoff.bench.probes.push_ipc_sweep`: the CLI's CUDA push bench over the
CUDA IPC transport at several `ipc_launch_every` values (issue 18), one JSON line each."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kvhandoff.bench.push import config_for, run_push_bench


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launch-every", default="0,8,32", help="0: one launch per pass")
    parser.add_argument("--notifier", default="0,1", help="notifier thread off (0) / on (1)")
    parser.add_argument("--at-flush", default="0", help="launch at poll (0) / at flush (1)")
    parser.add_argument("--kernel", default="auto", help="cuda_core, triton or auto (each listed)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the variants, alternating")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    variants = [
        (int(every), notifier == "1", flush == "1", kernel)
        for every in args.launch_every.split(",")
        for notifier in args.notifier.split(",")
        for flush in args.at_flush.split(",")
        for kernel in args.kernel.split(",")
    ] * args.rounds
    for every, notifier, at_flush, kernel in variants:
        cfg = replace(
            config_for("cuda", False, "cuda_ipc"),
            ipc_launch_every=every,
            ipc_notifier=notifier,
            ipc_launch_at_flush=at_flush,
            ipc_kernel=kernel,
            reps=args.reps,
        )
        result = run_push_bench(cfg, lambda line: print(line, file=sys.stderr))
        keep = ("framework_gbps", "baseline_gbps", "ratio", "path", "latency_ms", "p_counters")
        print(
            json.dumps(
                {
                    "launch_every": every,
                    "notifier": notifier,
                    "at_flush": at_flush,
                    "kernel": kernel,
                    **{k: result[k] for k in keep},
                    "verified": result["framework_verified"] and result["baseline_verified"],
                    "phases": result["framework_phases_ms"][-1],
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
