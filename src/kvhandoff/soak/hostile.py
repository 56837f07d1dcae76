"""`kvhandoff soak --hostile --seconds S`: legitimate traffic while attackers flood (issue 27).

The same four real processes as `kvhandoff soak` (P and D over NIXL WRITE and the ZMQ
side channel; an encoder-cache producer and consumer over the ZMQ ROUTER and NIXL READ),
without injected faults, and a fifth: the attackers (`soak/attack.py`), from another
loopback address (127.0.0.2, another host), flooding every listener for as long as the
legitimate traffic lasts. Every legitimate request must succeed: a push request's bytes
verified on D; an encoding pulled over NIXL and verified, or encoded locally when its
publication was relayed after the producer evicted it (the soak's planned late
relays); none failed, none left open.

The roles' caps are lowered from their defaults so the cap paths are reached within
seconds: P holds at most 128 pending registrations (16 per peer) and the producer grants
one host at most 8 pins at once. The side channel keeps its defaults (64 connections a
host, 512 in all): each attack wave opens more than 64.

One JSON object: the legitimate requests done and failed per kind, each role's resident
memory at its first request and at its end, what the attackers sent per kind, what the
roles rejected per cause (their counters), and `counted`: for each attack kind, the
rejections the roles counted for it (each must be > 0). `attack_targets_gone` names the
listeners that closed under a flood after it had reached them: a role that finished and
left before the attackers heard `stop` (the soak stops them at the first role's summary).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any

from kvhandoff.demo.launcher import RoleProcess, collect, go, relay, start_role, wait_ready
from kvhandoff.soak.ec import CONSUMER_CONFIG, PRODUCER_CONFIG, ECSoak
from kvhandoff.soak.push import PUSH_CONFIG, PushSoak

START_TIMEOUT_S = 120.0
PUSH_HOSTILE_CONFIG = {
    **PUSH_CONFIG,
    "kv_lease_duration": 10.0,
    "kv_lease_extension": 10.0,
    "push_registration_timeout": 10.0,
    "handshake_timeout": 5.0,
    "push_write_timeout": 10.0,
    "heartbeat_interval": 1.0,
    "max_pending_registrations": 128,
    "max_pending_registrations_per_peer": 16,
}
PRODUCER_HOSTILE_CONFIG = {**PRODUCER_CONFIG, "producer_max_grants_per_host": 8.0}
CONSUMER_HOSTILE_CONFIG = {
    **CONSUMER_CONFIG,
    "consumer_ack_timeout_s": 3.0,
    "nixl_read_timeout_s": 5.0,
}
ROLES = ("prefill", "decode", "producer", "consumer")

# Which rejections, as the roles name their causes (`RejectionLog.reasons()`), answer
# which forged notif: substrings of the cause labels.
PUSH_NOTIF_CAUSES = {
    "push_notif_push_reg_unknown_request": ("waiting PUSH_REGs",),
    "push_notif_push_reg_other_engine": ("PUSH_REG for engine",),
    "push_notif_malformed_bundle": ("notif bundle",),
    "push_notif_garbage": ("not valid UTF-8", "unknown notif", "malformed notif"),
    "push_notif_heartbeat_unknown_ids": ("heartbeat for unknown",),
}
EC_NOTIF_CAUSES = {
    "ec_read_notif_no_grant": ("names no live grant",),
    "ec_read_notif_garbage": ("READ notif is not",),
}
ATTACK_KINDS = (
    "side_channel_idle_connections",
    "ec_router_oversized_request_cap",
    "ec_router_oversized_socket_cap",
    "ec_router_malformed",
    "ec_router_unknown_requests",
    "ec_router_grant_requests",
    "push_notif_push_reg_replayed",
    *PUSH_NOTIF_CAUSES,
    *EC_NOTIF_CAUSES,
)
"""The attacks the soak checks: each sent > 0 and counted by the roles > 0."""


def _progress(message: str) -> None:
    print(f"soak --hostile: {message}", file=sys.stderr, flush=True)


def _matching(reasons: dict[str, int], needles: tuple[str, ...]) -> int:
    return sum(n for cause, n in reasons.items() if any(s in cause for s in needles))


class HostileSoak:
    def __init__(self, seconds: float, seed: int, rate: float) -> None:
        self.seconds = seconds
        self.rate = rate
        self.push = PushSoak(seconds, "", seed, _progress, PUSH_HOSTILE_CONFIG)
        self.ec = ECSoak(
            seconds, "", seed, _progress, (PRODUCER_HOSTILE_CONFIG, CONSUMER_HOSTILE_CONFIG)
        )
        self.attacker: RoleProcess | None = None
        self.attack_summary: dict[str, Any] = {}
        self.stopped = False

    def start(self) -> list[RoleProcess]:
        push, ec = self.push, self.ec
        push.start_prefill()
        roles = ec.start()
        try:
            push.start_decode(START_TIMEOUT_S)
            roles = [*push.roles, *roles]
            for role in roles:
                if not role.ready:
                    wait_ready(role, START_TIMEOUT_S)
            argv = [
                "--push", f"127.0.0.1:{push.roles[0].ready['port']}",
                "--ec", f"127.0.0.1:{ec.roles['producer'].ready['port']}",
                "--seconds", str(self.seconds + START_TIMEOUT_S), "--rate", str(self.rate),
            ]  # fmt: skip
            self.attacker = start_role("attacker", argv, module="kvhandoff.soak.attack")
            wait_ready(self.attacker, START_TIMEOUT_S)
        except BaseException:
            from kvhandoff.demo.launcher import stop_all

            stop_all([*push.roles, *roles, *([self.attacker] if self.attacker else [])])
            raise
        return [*roles, self.attacker]

    def _stop_attacks(self) -> None:
        """The first role to finish its traffic ends the attacks: they covered all of it."""
        if not self.stopped and self.attacker is not None:
            self.stopped = True
            with contextlib.suppress(OSError):
                relay_line(self.attacker, "stop")

    def on_event(self, role: str, event: dict[str, Any]) -> None:
        if role == "attacker":
            if event["event"] == "summary":
                self.attack_summary = event
            return
        if event["event"] == "summary":
            self._stop_attacks()
        if role in ("prefill", "decode"):
            self.push.on_event(role, event)
            return
        self.ec.on_event(role, event)
        if event["event"] == "finished" and self.attacker is not None and not self.stopped:
            with contextlib.suppress(OSError):  # the attackers ask for published ones too
                relay(self.attacker, {"mm_hash": event["mm_hash"], "tokens": event["tokens"]})

    def summaries(self) -> dict[str, dict[str, Any]]:
        return {**self.push.summaries, **self.ec.summaries}

    def rejected(self) -> dict[str, dict[str, Any]]:
        """What the attacked roles counted, per cause."""
        out: dict[str, dict[str, Any]] = {}
        prefill = self.summaries().get("prefill", {})
        if prefill:
            side = prefill.get("side_channel", {})
            out["prefill"] = {
                "notifs_by_cause": prefill.get("rejected_by_reason", {}),
                "side_channel_shed": side.get("connections_shed", {}),
                "side_channel_accepted": side.get("connections_accepted", 0),
                "side_channel_requests_dropped": side.get("requests_dropped", 0),
                "registrations_dropped": prefill.get("registrations_dropped", {}),
            }
        producer = self.summaries().get("producer", {})
        if producer:
            counters = producer.get("counters", {})
            metrics = counters.get("metrics", {})
            out["producer"] = {
                "by_cause": counters.get("rejected_by_reason", {}),
                "router": {
                    k: counters.get(f"router_{k}", 0)
                    for k in ("accepted", "dropped", "oversized", "disconnects")
                },
                "grants_over_cap": metrics.get("ec.producer.over_cap", 0),
                "acks_sent": counters.get("acks_sent", {}),
            }
        return out

    def counted(self, rejected: dict[str, dict[str, Any]]) -> dict[str, int]:
        """For each attack kind, what the roles counted for it. Two are answers rather
        than rejections: an XferReq for an encoding nobody published gets its
        NACK_MISSING (`acks_sent`, which the legitimate consumer's late relays share), and a
        replayed PUSH_REG is dropped as a duplicate by its match slot. ZMQ closes the
        connection of a frame over the ROUTER's socket cap without saying why: that count
        is of every connection closed (the attackers' identities leaving too)."""
        prefill, producer = rejected.get("prefill", {}), rejected.get("producer", {})
        notif_causes = prefill.get("notifs_by_cause", {})
        ec_causes = producer.get("by_cause", {})
        router = producer.get("router", {})
        counted = {
            "side_channel_idle_connections": sum(prefill.get("side_channel_shed", {}).values()),
            "ec_router_oversized_request_cap": router.get("oversized", 0),
            "ec_router_oversized_socket_cap": router.get("disconnects", 0),
            "ec_router_malformed": _matching(ec_causes, ("EC message",)),
            "ec_router_unknown_requests": producer.get("acks_sent", {}).get("NACK_MISSING", 0),
            "ec_router_grant_requests": int(producer.get("grants_over_cap", 0)),
            "push_notif_push_reg_replayed": prefill.get("registrations_dropped", {}).get(
                "duplicate", 0
            ),
        }
        for kind, needles in PUSH_NOTIF_CAUSES.items():
            counted[kind] = _matching(notif_causes, needles)
        # Held (an agent of no connected engine has its share) until it expires, or refused.
        counted["push_notif_push_reg_unknown_request"] += prefill.get(
            "registrations_dropped", {}
        ).get("expired", 0)
        for kind, needles in EC_NOTIF_CAUSES.items():
            counted[kind] = _matching(ec_causes, needles)
        return counted

    def result(self, elapsed: float) -> dict[str, Any]:
        push, ec = self.push.result(), self.ec.result()
        rss: dict[str, dict[str, float | None]] = {}
        for role, summary in self.summaries().items():
            before, after = summary.get("rss_mb_start"), summary.get("rss_mb")
            growth = round(after - before, 1) if before and after else None
            rss[role] = {"before_mb": before, "after_mb": after, "growth_mb": growth}
        growths = [r["growth_mb"] for r in rss.values() if r["growth_mb"] is not None]
        legit = {
            "push": {
                "requests": push["requests"],
                "done": push["completed"],
                "failed": push["requests"] - push["completed"],  # failed, unresolved or bad bytes
                "failed_by_reason": push["failed_by_reason"],
            },
            "ec": {
                "requests": ec["requests"],
                "done": ec["completed"],
                "served_p2p": ec["served_p2p"],
                "fallback_local": ec["fallback_local"],
                "fallback_by_reason": ec["fallback_by_reason"],
                "failed": ec["requests"] - ec["completed"],
                "failed_by_reason": ec["failed_by_reason"],
            },
        }
        rejected = self.rejected()
        counted = self.counted(rejected)
        missing = [r for r in ROLES if r not in self.summaries()]
        return {
            "seconds": self.seconds,
            "elapsed_s": round(elapsed, 1),
            "failed": sum(k["failed"] for k in legit.values()) + len(missing),
            "legitimate": legit,
            "roles_without_summary": missing,
            "leaked": push["leaked"] + ec["leaked"],
            "rss": rss,
            "rss_growth_mb": max(growths) if growths else None,
            "attacks_sent": self.attack_summary.get("sent", {}),
            "attack_errors": self.attack_summary.get("errors", {}),
            "attack_targets_gone": self.attack_summary.get("targets_gone", []),
            "rejected": rejected,
            "counted": counted,
            "uncounted": [k for k in ATTACK_KINDS if not counted.get(k)],
            "unsent": [k for k in ATTACK_KINDS if not self.attack_summary.get("sent", {}).get(k)],
        }


def relay_line(role: RoleProcess, line: str) -> None:
    assert role.proc.stdin is not None
    role.proc.stdin.write(line + "\n")
    role.proc.stdin.flush()


def run_hostile_soak(seconds: float, seed: int = 1, rate: float = 1.0) -> dict[str, Any]:
    started = time.monotonic()
    soak = HostileSoak(seconds, seed, rate)
    roles = soak.start()
    _progress(
        f"{soak.push.requests} push and {soak.ec.requests} encoder-cache requests under "
        f"attack, {seconds:g} s"
    )
    go(roles)
    collect(roles, seconds + 180, soak.on_event)
    return soak.result(time.monotonic() - started)
