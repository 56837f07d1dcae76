"""The push half of `kvhandoff soak`: P and D as processes under seeded push faults.

`kvhandoff run prefill|decode` over real NIXL and ZMQ, one request per paced engine step,
with WRITE post failures, lost notifs and failed handshakes on both sides and short
deadlines. Every request must be resolved (verified, or failed with a reason), every KV
block back in its pool and no lifecycle left on either bus.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from kvhandoff.demo.launcher import RoleProcess, start_role, wait_ready

PUSH_CONFIG = {
    "kv_lease_duration": 3.0,
    "kv_lease_extension": 3.0,
    "push_registration_timeout": 3.0,
    "handshake_timeout": 1.0,
    "push_write_timeout": 3.0,
    "heartbeat_interval": 0.5,
}
DEFAULT_PUSH_FAULTS = "write_fail=0.02,notif_drop=0.01,handshake_fail=0.05"
STEP_MS = 20.0
ROLES = ("prefill", "decode")


def rss_growth(summaries: Iterable[dict[str, Any]]) -> float | None:
    """The largest growth of resident memory, first request to end, over the roles."""
    growth = [s["rss_mb"] - s["rss_mb_start"] for s in summaries if s.get("rss_mb_start")]
    return round(max(growth), 1) if growth else None


def bucket(reason: str) -> str:
    if "injected post failure" in reason:
        return "WRITE failed to post (B-06)"
    if "watchdog" in reason:
        return "registration watchdog expired"
    if "handshake" in reason:
        return "handshake failed"
    return reason[:60]


class PushSoak:
    """Starts the two roles (`start`), takes their events (`on_event`), sums up."""

    def __init__(
        self,
        seconds: float,
        faults: str,
        seed: int,
        progress: Callable[[str], None],
        config: dict[str, Any] | None = None,
    ) -> None:
        self.seconds = seconds
        self.config = PUSH_CONFIG if config is None else config
        self.faults = faults
        self.seed = seed
        self.progress = progress
        self.requests = max(1, int(seconds * 1000 / STEP_MS))
        self.roles: list[RoleProcess] = []
        self.failed: Counter[str] = Counter()
        self.summaries: dict[str, dict[str, Any]] = {}
        self.received = 0
        self.bad_bytes = 0

    def _common(self, fault_seed: int) -> list[str]:
        return [
            "--requests", str(self.requests), "--seed", str(self.seed), "--per-step", "1",
            "--step-ms", str(STEP_MS), "--wait-go", "--deadline", str(self.seconds + 60),
            "--faults", self.faults, "--fault-seed", str(fault_seed),
            "--config", json.dumps(self.config),
        ]  # fmt: skip

    def start_prefill(self) -> None:
        self.roles.append(start_role("prefill", ["run", "prefill", *self._common(self.seed)]))

    def start_decode(self, timeout_s: float) -> None:
        """D needs P's side-channel port: waits for P to come up first."""
        ready = wait_ready(self.roles[0], timeout_s)
        peer = f"127.0.0.1:{ready['port']}"
        argv = ["run", "decode", "--peer", peer, *self._common(self.seed + 1)]
        self.roles.append(start_role("decode", argv))

    def on_event(self, role: str, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "received":
            self.received += 1
            self.bad_bytes += not event["verified"]
            if self.received % 250 == 0:
                self.progress(f"push: {self.received}/{self.requests} received")
        elif kind == "failed":
            self.failed[bucket(event["reason"])] += 1
        elif kind == "summary":
            self.summaries[role] = event

    def result(self) -> dict[str, Any]:
        leaked = self.bad_bytes
        for role in ROLES:
            summary = self.summaries.get(role)
            if summary is None:
                leaked += 1  # a role that never reported cannot vouch for its pool
                continue
            leaked += summary["leaked_blocks"] + summary["live_lifecycles"] + summary["unresolved"]
        return {
            "requests": self.requests,
            "completed": self.received - self.bad_bytes,
            "failed": sum(self.failed.values()),
            "failed_by_reason": dict(self.failed),
            "leaked": leaked,
            "rss_growth_mb": rss_growth(self.summaries.values()),
            "injected": {role: s.get("injected", {}) for role, s in self.summaries.items()},
        }
