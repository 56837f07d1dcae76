"""The consumer role of the encoder-cache demo: pull, load and verify every encoding.

Each request arrives with the producer's publications (relayed on stdin by an
orchestrator, or built from the seeded list and `--peer`). The consumer pulls the
encoding over ZMQ + NIXL READ, loads it into its encoder cache and verifies every byte;
an encoding it cannot pull it encodes locally, and verifies that too. Each request ends
as a `received` event (`via` p2p or local, with the fallback reason) or `failed`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.demo.ec_loop import ECRoleOptions, Stdin, pace, settle
from kvhandoff.demo.ec_requests import BLOCK_BYTES, DTYPE, HIDDEN, ECDemoRequest, encoding, matches
from kvhandoff.demo.push_role import MARK, emit, rss_mb
from kvhandoff.machines.ec.meta import ECRequestInfo

__all__ = ["ConsumerLoop"]


@dataclass
class _Pending:
    req: ECDemoRequest
    info: ECRequestInfo
    scheduled: bool = False
    via: str = ""
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class ConsumerLoop:
    def __init__(
        self,
        side: ECSide,
        opts: ECRoleOptions,
        requests: list[ECDemoRequest],
        stdin: Stdin,
        deadline: float,
    ) -> None:
        self.side = side
        self.opts = opts
        self.stdin = stdin
        self.deadline = deadline
        self.expected = {req.client_id: req for req in requests}
        self.legs: list[tuple[ECDemoRequest, Mapping[str, Any] | None]] = []
        if not opts.relay:
            self.legs = [(req, self._seeded_params(req)) for req in requests]
        self.pending: dict[str, _Pending] = {}
        self.loading: dict[str, str] = {}
        self.counts = {"served_p2p": 0, "fallback_local": 0, "retried_not_ready": 0}
        self.verified = 0
        self.failed = 0
        self.resolved = 0
        self.stopped = False
        self.rss_start: float | None = None

    def _seeded_params(self, req: ECDemoRequest) -> dict[str, Any]:
        """Without a relaying orchestrator: the producer at `--peer` holds every encoding."""
        return {
            req.mm_hash: {
                "metadata": req.metadata,
                "peer_host": self.opts.peer_host,
                "peer_port": self.opts.peer_port,
                "size_bytes": req.tokens * BLOCK_BYTES,
            }
        }

    def _read_legs(self) -> None:
        for line in self.stdin.take():
            if line is None or line == "stop":
                self.stopped = True
                continue
            text = line[len(MARK) :] if line.startswith(MARK) else line
            if not text.startswith("{"):
                continue  # a log line of a piped producer, not a leg
            try:
                leg = json.loads(text)
                if leg.get("event", "finished") != "finished" or leg.get("op") == "stop":
                    self.stopped = self.stopped or leg.get("op") == "stop"
                    continue
                known = self.expected.get(leg["client"])
                req = known or ECDemoRequest(leg["client"], leg["mm_hash"], int(leg["tokens"]))
                self.legs.append((req, leg.get("params")))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                emit("error", what=f"bad leg: {exc}")

    def _admit(self) -> None:
        take, self.legs = self.legs[: self.opts.per_step], self.legs[self.opts.per_step :]
        if take and self.rss_start is None:
            self.rss_start = rss_mb()
        for req, params in take:
            info = ECRequestInfo(
                f"{req.client_id}-c",
                (req.mm_hash,),
                ec_transfer_params=params,
                mm_tokens=(req.tokens,),
            )
            self.pending[req.client_id] = _Pending(req, info)

    def _schedule(self, item: _Pending) -> None:
        """The request may run: load its encoding from the tier, or encode it here."""
        side = self.side
        sched = side.scheduler
        req = item.req
        item.scheduled = True
        outcome = side.read_outcomes.get(req.mm_hash)
        if outcome is not None and outcome.not_ready:
            item.extra["not_ready"] = outcome.not_ready
        if sched.has_cache_item(req.mm_hash):
            side.encoder_cache[req.mm_hash] = torch.empty(req.tokens, HIDDEN, dtype=DTYPE)
            sched.update_state_after_alloc(item.info, 0, side.clock())
            self.loading[req.mm_hash] = req.client_id
            item.via = "p2p"
            return
        item.reason = sched.local_reason(item.info.request_id, req.mm_hash)
        item.via = "local"
        side.encoder_cache[req.mm_hash] = encoding(req.mm_hash, req.tokens)  # encode here
        self._finish(item, ok=True)

    def _finish(self, item: _Pending, *, ok: bool, failure: str = "") -> None:
        side, req = self.side, item.req
        tensor = side.encoder_cache.pop(req.mm_hash, None)
        verified = ok and tensor is not None and matches(req.mm_hash, tensor)
        side.scheduler.request_finished(item.info, side.clock())
        del self.pending[req.client_id]
        self.resolved += 1
        if failure:
            self.failed += 1
            emit("failed", client=req.client_id, reason=failure)
            return
        self.verified += verified
        key = "served_p2p" if item.via == "p2p" else "fallback_local"
        self.counts[key] += 1
        self.counts["retried_not_ready"] += bool(item.extra.get("not_ready"))
        emit(
            "received",
            client=req.client_id,
            mm_hash=req.mm_hash,
            via=item.via,
            reason=item.reason,
            not_ready=item.extra.get("not_ready", 0),
            verified=verified,
            t=time.time(),
        )

    def _step(self) -> None:
        side, sched = self.side, self.side.scheduler
        for item in list(self.pending.values()):
            if not item.scheduled and sched.ensure_cache_available(item.info, 0, side.clock()):
                self._schedule(item)
        for failed in sched.take_failed_requests():
            client = failed.request_id.removesuffix("-c")
            if client in self.pending:
                self._finish(self.pending[client], ok=False, failure=failed.reason)
        finished = side.engine_step()
        for mm_hash in sorted(finished.loaded | finished.failed):
            client = self.loading.pop(mm_hash, "")
            if client in self.pending:
                bad = mm_hash in finished.failed
                self._finish(
                    self.pending[client],
                    ok=not bad,
                    failure="loading from the CPU tier failed" if bad else "",
                )

    def run(self) -> dict[str, Any]:
        side = self.side
        total = len(self.expected)
        while time.monotonic() < self.deadline and not self.stopped:
            side.poll()
            self._read_legs()
            self._admit()
            self._step()
            if total and self.resolved >= total and not self.legs:
                break
            pace(self.opts, busy=False)
        for item in list(self.pending.values()):
            self._finish(item, ok=False, failure="deadline passed")
        extra = side.extra
        waits = extra.consumer_ack_timeout_s + extra.nixl_read_timeout_s + extra.read_quarantine_s
        until = min(self.deadline, time.monotonic() + waits + 2.0)
        settle(side, self.opts, until, side.engine_step)
        return {
            "role": "consumer",
            "requests": total,
            **self.counts,
            "verified": self.verified,
            "failed": self.failed,
            "unresolved": total - self.resolved if total else 0,
        }
