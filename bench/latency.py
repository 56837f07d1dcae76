"""`kvhandoff bench latency`: push versus pull on the same two-process workload (B-09).

The same seeded mix (many small requests, every eighth a large one) runs once in push
mode and once in pull mode, each as a fresh P and D process pair over real NIXL, in the
same invocation. Latency is measured from P's finish to D's receive; throughput over the
whole run. Repeats alternate the modes so drift on a noisy machine hits both alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

from kvhandoff.demo.push_demo import run_push_demo

PACING = (1, 5.0)
"""One new request every 5 ms engine step, after one warm-up request that pays for the
first-contact handshakes alone: arrivals spread like live traffic, percentiles describe
the steady state."""


def run_latency_bench(
    requests: int = 64,
    repeats: int = 2,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"push": [], "pull": []}
    for repeat in range(repeats):
        for mode in ("push", "pull"):
            progress(f"{mode} run {repeat + 1}/{repeats} ({requests} requests) ...")
            result = run_push_demo(
                requests, seed=100 + repeat, mode=mode, pacing=PACING, warmup=True
            )
            if result["verified"] != requests:
                raise RuntimeError(f"{mode}: only {result['verified']}/{requests} verified")
            runs[mode].append(result)
    return {
        mode: {
            "p50_ms": round(statistics.median(r["p50_ms"] for r in results), 3),
            "p99_ms": round(statistics.median(r["p99_ms"] for r in results), 3),
            "gbps": round(statistics.median(r["gbps"] for r in results), 3),
        }
        for mode, results in runs.items()
    }
