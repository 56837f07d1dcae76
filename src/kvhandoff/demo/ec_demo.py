"""`kvhandoff demo ec`: an encoder-cache producer and consumer as two processes.

The launcher stands in for the orchestrator: it relays each publication the producer's
`request_finished` returned (`ec_transfer_params`) to the consumer as the follow-up
request, as a disaggregating proxy does in pull mode. Publications of the `late` case
it holds back until the producer has announced their eviction (B-01), and then relays
them anyway, so the consumer meets a `NACK_MISSING` and encodes locally. The consumer
pulls the rest over ZMQ + NIXL READ (one after a `NACK_NOT_READY` retry), loads and
verifies them.

This module imports neither torch nor NIXL: the roles do, in their own processes.
"""

from __future__ import annotations

import queue
import sys
import time
from typing import Any

from kvhandoff.demo.launcher import go, relay, start_role, stop_all, wait_ready

EC_KEYS = ("requests", "served_p2p", "fallback_local", "retried_not_ready", "verified")


def _progress(message: str) -> None:
    print(f"ec: {message}", file=sys.stderr, flush=True)


class ECDemo:
    """The two roles, started at construction (they import torch and create their NIXL
    agents in the background, e.g. while other demos run) and driven by `run()`."""

    def __init__(
        self, requests: int, seed: int, backend: str = "UCX", timeout_s: float = 60.0
    ) -> None:
        self.requests = requests
        self.timeout_s = timeout_s
        common = ["--requests", str(requests), "--seed", str(seed), "--backend", backend]
        common += ["--wait-go", "--deadline", str(timeout_s + 30.0)]
        self.producer = start_role(
            "producer", ["run", "producer", "--listen", "127.0.0.1:0", *common]
        )
        self.consumer = start_role("consumer", ["run", "consumer", "--relay", *common])
        self.held: dict[str, dict[str, Any]] = {}
        self.evicted: set[str] = set()
        self.received: dict[str, dict[str, Any]] = {}
        self.failures: list[str] = []
        self.summaries: dict[str, dict[str, Any]] = {}

    def run(self) -> dict[str, Any]:
        roles = [self.producer, self.consumer]
        try:
            ready = wait_ready(self.producer, 60.0)
            wait_ready(self.consumer, 60.0)
            _progress(f"producer serving on 127.0.0.1:{ready['port']}, region {ready['region']}")
            go(roles)
            self._events(time.monotonic() + self.timeout_s)
        finally:
            stop_all(roles)
        if "consumer" not in self.summaries:
            tail = " | ".join(self.consumer.stderr_tail[-3:])
            self.failures.append(f"the consumer did not finish: {tail}")
        events = self.received.values()
        result: dict[str, Any] = {
            "requests": self.requests,
            "served_p2p": sum(e["via"] == "p2p" for e in events),
            "fallback_local": sum(e["via"] == "local" for e in events),
            "retried_not_ready": sum(bool(e["not_ready"]) for e in events),
            "verified": sum(bool(e["verified"]) for e in events),
        }
        if self.requests >= 2 and not (result["retried_not_ready"] and result["fallback_local"]):
            self.failures.append("the NACK_NOT_READY retry or the NACK fallback did not happen")
        result["failures"] = self.failures
        result["summaries"] = self.summaries
        return result

    def _events(self, deadline: float) -> None:
        """Handle both roles' events as they come, until both summaries are in."""
        roles = {"producer": self.producer, "consumer": self.consumer}
        while len(self.summaries) < len(roles) and time.monotonic() < deadline:
            idle = True
            for name, role in roles.items():
                try:
                    event = role.events.get_nowait()
                except queue.Empty:
                    continue
                idle = False
                if event["event"] == "exit":
                    self.summaries.setdefault(name, {"event": "exit"})
                else:
                    self._on_event(name, event)
            if idle:
                time.sleep(0.001)  # poll interval; the deadline bounds the wait

    def _on_event(self, role: str, event: dict[str, Any]) -> None:
        kind = event["event"]
        if kind == "finished":
            if event.get("case") == "late" and event["mm_hash"] not in self.evicted:
                self.held[event["mm_hash"]] = consumer_leg(event)  # the orchestrator is late here
            else:
                relay(self.consumer, consumer_leg(event))
        elif kind == "evicted":
            self.evicted.add(event["mm_hash"])
            _progress(f"producer announced {event['mm_hash']} {event['reason']} (B-01)")
            if event["mm_hash"] in self.held:
                _progress("relaying its stale publication anyway: expect NACK_MISSING")
                relay(self.consumer, self.held.pop(event["mm_hash"]))
        elif kind == "save_released":
            _progress(f"slow save of {event['mm_hash']} lands ({event['why']})")
        elif kind == "received":
            self._received(event)
        elif kind == "failed":
            self.failures.append(f"{event['client']}: {event['reason']}")
        elif kind == "error":
            self.failures.append(f"{role}: {event['what']}")
        elif kind == "summary":
            self.summaries[role] = event
            if role == "consumer":
                relay(self.producer, {"op": "stop"})

    def _received(self, event: dict[str, Any]) -> None:
        self.received[event["client"]] = event
        if not event["verified"]:
            self.failures.append(f"{event['client']}: bytes differ")
        if event["via"] == "local":
            _progress(f"{event['client']} encoded locally ({event['reason']})")
        elif event["not_ready"]:
            _progress(f"{event['client']} read after {event['not_ready']} NACK_NOT_READY")
        done = len(self.received)
        if done % max(1, self.requests // 4) == 0 or done == self.requests:
            _progress(f"{done}/{self.requests} served")


def consumer_leg(event: dict[str, Any]) -> dict[str, Any]:
    """The follow-up request the orchestrator sends the consumer."""
    return {key: event[key] for key in ("client", "mm_hash", "tokens", "params")}


def run_ec_demo(
    requests: int, seed: int, backend: str = "UCX", timeout_s: float = 60.0
) -> dict[str, Any]:
    return ECDemo(requests, seed, backend, timeout_s).run()
