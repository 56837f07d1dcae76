"""`python -m kvhandoff.bench.probes.push_ipc_sweep`: the CLI's CUDA push bench over the
CUDA IPC transport at several `ipc_launch_every` values (issue 18) and writer poll
intervals while a launch runs (`ipc_poll_us`, issue 26), one JSON line each."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from kvhandoff.bench.push import config_for, run_push_bench


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--launch-every", default="0,8,32", help="0: one launch per pass")
    parser.add_argument("--poll-us", default="100", help="writer poll while a launch runs, µs")
    parser.add_argument("--wait", default="0", help="writer waits for its launches: 0 / 1")
    parser.add_argument("--kernel", default="auto", help="cuda_core, triton or auto (each listed)")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the variants, alternating")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    variants = [
        (int(every), float(poll), wait == "1", kernel)
        for every in args.launch_every.split(",")
        for poll in args.poll_us.split(",")
        for wait in args.wait.split(",")
        for kernel in args.kernel.split(",")
    ] * args.rounds
    for every, poll, wait, kernel in variants:
        cfg = replace(
            config_for("cuda", False, "cuda_ipc"),
            ipc_launch_every=every,
            ipc_poll_us=poll,
            ipc_wait=wait,
            ipc_kernel=kernel,
            reps=args.reps,
        )
        result = run_push_bench(cfg, lambda line: print(line, file=sys.stderr))
        keep = ("framework_gbps", "baseline_gbps", "ratio", "path", "latency_ms", "p_counters")
        print(
            json.dumps(
                {
                    "launch_every": every,
                    "poll_us": poll,
                    "wait": wait,
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
