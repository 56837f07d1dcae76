"""`kvhandoff soak --seconds S`: two-process push traffic under injected faults.

P and D run as processes over real NIXL and ZMQ for about S seconds, one request per
paced engine step, with seeded faults (WRITE post failures, lost notifs, failed
handshakes) on both sides and short deadlines, so every fault path is exercised many
times. At the end every request must be resolved — verified, or failed with a reason —
every KV block back in its pool, no lifecycle left on either bus, and the resident
memory of both processes flat.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from typing import Any

from kvhandoff.demo.launcher import collect, go, start_role, wait_ready

SOAK_CONFIG = {
    "kv_lease_duration": 3.0,
    "push_registration_timeout": 3.0,
    "handshake_timeout": 1.0,
    "push_write_timeout": 3.0,
    "heartbeat_interval": 0.5,
}
DEFAULT_FAULTS = "write_fail=0.02,notif_drop=0.01,handshake_fail=0.05"


def _bucket(reason: str) -> str:
    if "injected post failure" in reason:
        return "WRITE failed to post (B-06)"
    if "watchdog" in reason:
        return "registration watchdog expired"
    if "handshake" in reason:
        return "handshake failed"
    return reason[:60]


def run_soak(seconds: float, faults: str = DEFAULT_FAULTS, seed: int = 1) -> dict[str, Any]:
    step_ms = 20.0
    requests = max(1, int(seconds * 1000 / step_ms))
    common = [
        "--requests", str(requests), "--seed", str(seed), "--per-step", "1",
        "--step-ms", str(step_ms), "--wait-go", "--deadline", str(seconds + 60),
        "--faults", faults, "--config", json.dumps(SOAK_CONFIG),
    ]  # fmt: skip
    prefill = start_role("prefill", ["run", "prefill", *common, "--fault-seed", str(seed)])
    ready = wait_ready(prefill, 60)
    decode = start_role(
        "decode",
        ["run", "decode", "--peer", f"127.0.0.1:{ready['port']}", *common,
         "--fault-seed", str(seed + 1)],
    )  # fmt: skip
    wait_ready(decode, 60)
    go([prefill, decode])
    failed: Counter[str] = Counter()
    summaries: dict[str, dict[str, Any]] = {}
    counts = {"received": 0, "bad_bytes": 0}

    def on_event(role: str, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "received":
            counts["received"] += 1
            counts["bad_bytes"] += not event["verified"]
            if counts["received"] % 100 == 0:
                print(f"soak: {counts['received']} received", file=sys.stderr, flush=True)
        elif kind == "failed":
            failed[_bucket(event["reason"])] += 1
        elif kind == "summary":
            summaries[role] = event

    collect([prefill, decode], seconds + 90, on_event)
    leaked = counts["bad_bytes"]
    for role in ("prefill", "decode"):
        summary = summaries.get(role)
        if summary is None:
            leaked += 1  # a role that never reported cannot vouch for its pool
            continue
        leaked += summary["leaked_blocks"] + summary["live_lifecycles"] + summary["unresolved"]
    growth = [s["rss_mb"] - s["rss_mb_start"] for s in summaries.values() if s.get("rss_mb_start")]
    return {
        "requests": requests,
        "completed": counts["received"] - counts["bad_bytes"],
        "failed": sum(failed.values()),
        "failed_by_reason": dict(failed),
        "leaked": leaked,
        "rss_growth_mb": round(max(growth), 1) if growth else None,
        "injected": {role: s.get("injected", {}) for role, s in summaries.items()},
    }
