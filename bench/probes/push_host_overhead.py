"""`python -m kvhandoff.bench.probes.push_host_overhead`: the host work of the CUDA IPC
push path, measured on any machine (a probe, no GPU needed).

The push bench's 32-request layer layout runs through the real framework with the real
`IpcPushTransport`, whose kernel launch is replaced by one that moves no bytes
(`push_host_child`): what is timed is everything else on the path from P's first
`request_finished` to D's step that reports the last `finished_recving`, in the same two
processes and with the same NIXL notifs as on the H200. On the H200 the kernel moves the
rep's 1 GiB in about 0.6 ms; a 1 GiB NIXL WRITE takes about 0.8 ms, so the IPC path can
reach 0.8 of it only if this host work stays well under a millisecond.

Prints one JSON object: the median rep in ms, per-request µs, the phases of the median
rep and the latency percentiles. `--profile DIR` also writes cProfile stats of P's and D's
main and writer threads (timed reps only) into DIR and prints the top entries.
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import statistics
import sys
from dataclasses import dataclass, replace

from kvhandoff.bench.push import run_push_bench
from kvhandoff.bench.push_kv import PushBenchConfig


@dataclass(frozen=True, slots=True)
class _HostConfig(PushBenchConfig):
    def check(self) -> None:  # the IPC transport on the CPU: the child stubs its launch
        PushBenchConfig.check(replace(self, transport="nixl"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--profile", default="", help="directory for cProfile stats")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--progress-thread",
        action="store_true",
        help="run NIXL's progress threads (each spins a core: off on small hosts)",
    )
    parser.add_argument("--timers", default="", help="directory for per-call wall/CPU sums")
    args = parser.parse_args()
    # The layer layout's regions and block counts, with 16-byte blocks: the stubbed launch
    # moves nothing, and the KV pattern fills stay cheap.
    cfg = _HostConfig(
        device="cpu",
        transport="cuda_ipc",
        requests=args.requests,
        blocks=16 * args.requests,
        block_tokens=1,
        kv_heads=1,
        head_dim=8,
        reps=args.reps,
        warmup=2,
        progress_thread=args.progress_thread,
    )
    if args.profile:
        os.environ["KVH_PROBE_PROFILE"] = os.path.abspath(args.profile)
    if args.timers:
        os.makedirs(args.timers, exist_ok=True)
        os.environ["KVH_PROBE_TIMERS"] = os.path.abspath(args.timers)
    result = run_push_bench(
        cfg,
        lambda line: print(line, file=sys.stderr),
        child_module="kvhandoff.bench.probes.push_host_child",
    )
    phases = result["framework_phases_ms"]
    seconds = [p["last_finished_recving"] / 1e3 for p in phases]
    median_ms = statistics.median(seconds) * 1e3
    order = sorted(range(len(seconds)), key=seconds.__getitem__)
    print(
        json.dumps(
            {
                "rep_ms_median": round(median_ms, 3),
                "rep_ms_samples": [round(s * 1e3, 3) for s in seconds],
                "per_request_us": round(median_ms * 1e3 / cfg.requests, 1),
                "latency_ms": result["latency_ms"],
                "phases_median_rep": phases[order[len(order) // 2]],
                "p_counters": result["p_counters"],
                "notes": result["notes"][:2],
            },
            indent=1,
        )
    )
    if args.timers:
        for role in ("prefill", "decode"):
            with open(os.path.join(args.timers, f"{role}.json")) as f:
                spent = json.load(f)
            for name, (wall, cpu, calls) in sorted(spent.items()):
                print(
                    f"{name:50s} calls/rep {calls / cfg.reps:7.1f}  wall ms/rep"
                    f" {wall * 1e3 / cfg.reps:7.3f}  cpu ms/rep {cpu * 1e3 / cfg.reps:7.3f}"
                )
    if args.profile:
        for name in sorted(os.listdir(args.profile)):
            if name.endswith(".pstats"):
                print(f"\n== {name}")
                stats = pstats.Stats(os.path.join(args.profile, name))
                stats.sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
