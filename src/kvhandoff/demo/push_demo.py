"""`kvhandoff demo push|pull`: P and D as two processes, every request moved and verified.

In push mode the launcher, standing in for the proxy, sends both legs at once. In pull
mode (B-09) it sends the decode leg once P has finished the prefill, carrying the params
P's `request_finished` returned (its request and block ids), as a disaggregating proxy
does.
"""

from __future__ import annotations

import sys
from typing import Any

from kvhandoff.demo.launcher import collect, go, relay, start_role, wait_ready
from kvhandoff.demo.push_role import demo_requests


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def run_push_demo(
    requests: int,
    seed: int,
    backend: str = "UCX",
    timeout_s: float = 60.0,
    mode: str = "push",
    pacing: tuple[int, float] | None = None,
    warmup: bool = False,
) -> dict[str, Any]:
    """Run P and D as processes; `pacing` = (requests per step, step ms) spreads arrivals
    over time like live traffic instead of starting everything at once."""
    per_step, step_ms = pacing or (4, 0.0)
    common = ["--mode", mode, "--requests", str(requests), "--seed", str(seed)]
    common += ["--backend", backend, "--wait-go", "--per-step", str(per_step)]
    common += ["--step-ms", str(step_ms), *(["--warmup"] if warmup else [])]
    prefill = start_role("prefill", ["run", "prefill", "--listen", "127.0.0.1:0", *common])
    ready = wait_ready(prefill, 30.0)
    decode = start_role(
        "decode",
        [
            "run",
            "decode",
            "--listen",
            "127.0.0.1:0",
            "--peer",
            f"127.0.0.1:{ready['port']}",
            "--peer-engine-id",
            ready["engine_id"],
            *common,
        ],
    )
    wait_ready(decode, 30.0)
    go([prefill, decode])
    finished: dict[str, tuple[float, int]] = {}
    received: dict[str, float] = {}
    verified = 0
    failures: list[str] = []
    summaries: dict[str, dict[str, Any]] = {}

    def on_event(role: str, event: dict[str, Any]) -> None:
        nonlocal verified
        kind = event["event"]
        if kind == "finished":
            finished[event["client"]] = (event["t"], event["bytes"])
            if mode == "pull":
                relay(decode, {"client": event["client"], "params": event["params"]})
        elif kind == "received":
            received[event["client"]] = event["t"]
            verified += bool(event["verified"])
            if not event["verified"]:
                failures.append(f"{event['client']}: bytes differ")
            if len(received) % max(1, requests // 4) == 0 or len(received) == requests:
                print(f"{mode}: {len(received)}/{requests} received", file=sys.stderr, flush=True)
        elif kind == "failed":
            failures.append(f"{event['client']}: {event['reason']}")
        elif kind == "summary":
            summaries[role] = event

    collect([prefill, decode], timeout_s, on_event)
    warmed = {demo_requests(1, seed)[0].client_id} if warmup else set()
    measured = [c for c in received if c in finished and c not in warmed]
    latencies = [(received[c] - finished[c][0]) * 1000.0 for c in measured]
    total_bytes = sum(finished[c][1] for c in measured)
    starts = [finished[c][0] for c in measured]
    span = (max(received[c] for c in measured) - min(starts)) if measured else 0.0
    return {
        "requests": requests,
        "verified": verified,
        "p50_ms": round(_percentile(latencies, 0.5), 3),
        "p99_ms": round(_percentile(latencies, 0.99), 3),
        "gbps": round(total_bytes / span / 1e9, 3) if span > 0 else 0.0,
        "failures": failures,
        "summaries": summaries,
    }
