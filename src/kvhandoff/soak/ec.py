"""The encoder-cache half of `kvhandoff soak`: producer and consumer as processes under
seeded EC faults.

`kvhandoff run producer|consumer` over real NIXL READ and ZMQ. The producer encodes one
request per paced engine step into a small tier (256 blocks: encodings are evicted under
pressure); the soak relays every publication to the consumer as an orchestrator would,
every `LATE_EVERY`th one late: once the producer announced its eviction (B-01) or
`LATE_BY` publications later, so it meets `NACK_MISSING`. Faults: READs that fail to post,
lost and garbled control messages, slow saves answered `NACK_NOT_READY` (see
`adapters/ec_fault_injection.py`), with short ack, read, quarantine and pin-lease
timeouts. Every request must resolve with verified bytes, pulled over NIXL or encoded
locally after a fallback; at the end neither role may hold a block outside a ready entry,
a pinned grant, a live lifecycle or a READ, and both `/dev/shm` regions must be gone.

This module imports neither torch nor NIXL: the roles do, in their own processes.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvhandoff.demo.ec_demo import consumer_leg
from kvhandoff.demo.launcher import RoleProcess, relay, start_role
from kvhandoff.soak.push import rss_growth

DEFAULT_EC_FAULTS = "read_fail=0.02,req_drop=0.01,ack_drop=0.01,garble=0.01,slow_save=0.03"
PRODUCER_CONFIG = {"pin_lease_s": 2.0, "ec_cpu_bytes": 256 * 128}  # 256 token rows
CONSUMER_CONFIG = {
    "consumer_ack_timeout_s": 1.0,
    "nixl_read_timeout_s": 3.0,
    "read_quarantine_s": 1.0,
    "ec_cpu_bytes": 1024 * 128,
}
PRODUCER_STEP_MS = 20.0  # one encoding per step
CONSUMER_STEP_MS = 5.0
LATE_EVERY = 25
LATE_BY = 20
ROLES = ("producer", "consumer")
_LEAK_KEYS = ("leaked_blocks", "live_lifecycles", "pinned_grants", "unresolved")


class ECSoak:
    """Starts the two roles (`start`), relays publications (`on_event`), sums up."""

    def __init__(
        self,
        seconds: float,
        faults: str,
        seed: int,
        progress: Callable[[str], None],
        configs: tuple[dict[str, Any], dict[str, Any]] = (PRODUCER_CONFIG, CONSUMER_CONFIG),
    ) -> None:
        self.seconds = seconds
        self.producer_config, self.consumer_config = configs
        self.faults = faults
        self.seed = seed
        self.progress = progress
        self.requests = max(2, int(seconds * 1000 / PRODUCER_STEP_MS))
        self.roles: dict[str, RoleProcess] = {}
        self.summaries: dict[str, dict[str, Any]] = {}
        self.via: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()
        self.failed: Counter[str] = Counter()
        self.errors: list[str] = []
        self.received = 0
        self.bad_bytes = 0
        self.not_ready = 0
        self.evictions = 0
        self.published = 0
        self.late: dict[str, tuple[int, dict[str, Any]]] = {}
        self.relayed_late = 0

    def _argv(self, role: str, step_ms: float, per_step: int, config: dict[str, Any]) -> list[str]:
        fault_seed = self.seed + (2 if role == "producer" else 3)
        return [
            "run", role, "--requests", str(self.requests), "--seed", str(self.seed),
            "--per-step", str(per_step), "--step-ms", str(step_ms), "--wait-go",
            "--deadline", str(self.seconds + 60), "--faults", self.faults,
            "--fault-seed", str(fault_seed), "--config", json.dumps(config),
        ]  # fmt: skip

    def start(self) -> list[RoleProcess]:
        producer = self._argv("producer", PRODUCER_STEP_MS, 1, self.producer_config)
        consumer = self._argv("consumer", CONSUMER_STEP_MS, 4, self.consumer_config)
        self.roles["producer"] = start_role("producer", [*producer, "--listen", "127.0.0.1:0"])
        self.roles["consumer"] = start_role("consumer", [*consumer, "--relay"])
        return list(self.roles.values())

    def _tell(self, role: str, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):  # it has exited: its summary or exit says why
            relay(self.roles[role], message)

    def on_event(self, role: str, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "finished":
            self._published(event)
        elif kind == "evicted":
            self.evictions += 1
            self._relay_late(lambda mm_hash, due: mm_hash == event["mm_hash"])
        elif kind == "received":
            self._received(event)
        elif kind == "failed":
            self.failed[event["reason"][:60]] += 1
        elif kind == "error":
            self.errors.append(f"{role}: {event['what']}")
        elif kind == "summary":
            self.summaries[role] = event
            if role == "consumer":
                self._tell("producer", {"op": "stop"})

    def _published(self, event: dict[str, Any]) -> None:
        """Relay the publication to the consumer, as the orchestrator; every
        `LATE_EVERY`th one late."""
        self.published += 1
        if self.published % LATE_EVERY == 0:
            self.late[event["mm_hash"]] = (self.published + LATE_BY, consumer_leg(event))
        else:
            self._tell("consumer", consumer_leg(event))
        last = self.published >= self.requests
        self._relay_late(lambda mm_hash, due: last or due <= self.published)

    def _relay_late(self, now: Callable[[str, int], bool]) -> None:
        for mm_hash, (due, leg) in list(self.late.items()):
            if now(mm_hash, due):
                del self.late[mm_hash]
                self.relayed_late += 1
                self._tell("consumer", leg)

    def _received(self, event: dict[str, Any]) -> None:
        self.received += 1
        self.bad_bytes += not event["verified"]
        self.via[event["via"]] += 1
        self.not_ready += bool(event["not_ready"])
        if event["via"] == "local":
            self.fallbacks[event["reason"] or "not published"] += 1
        if self.received % 250 == 0:
            self.progress(f"ec: {self.received}/{self.requests} served")

    def _leaks(self) -> dict[str, int]:
        """What each role left behind; a role that never reported cannot vouch for it."""
        leaks: Counter[str] = Counter(bad_bytes=self.bad_bytes, errors=len(self.errors))
        for role in ROLES:
            summary = self.summaries.get(role)
            if summary is None or "leaked_blocks" not in summary:
                leaks[f"{role}_no_summary"] += 1
                continue
            for key in _LEAK_KEYS:
                leaks[f"{role}_{key}"] += summary.get(key, 0)
            leaks[f"{role}_pool_inconsistent"] += not summary["pool_consistent"]
            leaks[f"{role}_reads_in_flight"] += summary["counters"].get("reads_in_flight", 0)
        for role, proc in self.roles.items():
            region = proc.ready.get("region", "")
            leaks[f"{role}_shm_region"] += bool(region) and os.path.exists(region)
        return {key: value for key, value in leaks.items() if value}

    def result(self) -> dict[str, Any]:
        leaks = self._leaks()
        return {
            "requests": self.requests,
            "completed": self.received - self.bad_bytes,
            "served_p2p": self.via["p2p"],
            "fallback_local": self.via["local"],
            "retried_not_ready": self.not_ready,
            "fallback_by_reason": dict(self.fallbacks),
            "failed": sum(self.failed.values()),
            "failed_by_reason": dict(self.failed),
            "unresolved": self.requests - self.received - sum(self.failed.values()),
            "evictions_announced": self.evictions,
            "relayed_late": self.relayed_late,
            "leaked": sum(leaks.values()),
            "leaks": leaks,
            "errors": self.errors[:10],
            "rss_growth_mb": rss_growth(self.summaries.values()),
            "injected": {role: s.get("injected", {}) for role, s in self.summaries.items()},
        }
