"""`kvhandoff soak --seconds S`: push and encoder-cache traffic under injected faults.

Four processes run for about S seconds, side by side: P and D push KV blocks
(`soak_push`), an encoder-cache producer and consumer pull encodings over NIXL READ
(`soak_ec`), each with seeded faults and short deadlines, so every fault path is
exercised many times. At the end every request must be resolved, every block back in
its pool, no lifecycle, grant or `/dev/shm` region left, and the resident memory of the
processes flat. The totals keep the keys `requests`, `completed`, `failed`, `leaked` and
`rss_growth_mb`; `push` and `ec` break them down.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from kvhandoff.demo.launcher import collect, go, stop_all, wait_ready
from kvhandoff.soak.ec import DEFAULT_EC_FAULTS, ECSoak
from kvhandoff.soak.push import DEFAULT_PUSH_FAULTS, PushSoak

DEFAULT_FAULTS = DEFAULT_PUSH_FAULTS
START_TIMEOUT_S = 120.0  # four processes import torch and start NIXL on a few cores


def _progress(message: str) -> None:
    print(f"soak: {message}", file=sys.stderr, flush=True)


def run_soak(
    seconds: float,
    faults: str = DEFAULT_PUSH_FAULTS,
    seed: int = 1,
    ec_faults: str = DEFAULT_EC_FAULTS,
) -> dict[str, Any]:
    started = time.monotonic()
    push = PushSoak(seconds, faults, seed, _progress)
    ec = ECSoak(seconds, ec_faults, seed, _progress)
    push.start_prefill()
    roles = ec.start()
    try:
        push.start_decode(START_TIMEOUT_S)
        roles = [*push.roles, *roles]
        for role in roles:
            if not role.ready:
                wait_ready(role, START_TIMEOUT_S)
    except BaseException:
        stop_all([*push.roles, *roles])
        raise
    _progress(f"{push.requests} push and {ec.requests} encoder-cache requests, {seconds:g} s")
    go(roles)
    owner = {name: push for name in ("prefill", "decode")}

    def on_event(role: str, event: dict[str, Any]) -> None:
        (owner.get(role) or ec).on_event(role, event)

    collect(roles, seconds + 120, on_event)
    parts = {"push": push.result(), "ec": ec.result()}
    growth = [p["rss_growth_mb"] for p in parts.values() if p["rss_growth_mb"] is not None]
    failed_by_reason = dict(parts["push"]["failed_by_reason"])
    failed_by_reason.update({f"ec: {k}": v for k, v in parts["ec"]["failed_by_reason"].items()})
    return {
        **{key: sum(p[key] for p in parts.values()) for key in ("requests", "completed")},
        "failed": sum(p["failed"] for p in parts.values()),
        "failed_by_reason": failed_by_reason,
        "leaked": sum(p["leaked"] for p in parts.values()),
        "rss_growth_mb": max(growth) if growth else None,
        "elapsed_s": round(time.monotonic() - started, 1),
        "injected": {**parts["push"]["injected"], **parts["ec"]["injected"]},
        **parts,
    }
