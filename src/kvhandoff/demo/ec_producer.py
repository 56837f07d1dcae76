"""The producer role of the encoder-cache demo: encode, save into the tier, publish.

Each engine step encodes a few requests (fills their encoder outputs with the seeded
bytes of `ec_requests.encoding`), saves them into the `/dev/shm` region and publishes
their `ec_transfer_params` from `request_finished` as `finished` events. The planned
detours: the `late` request is followed by an unpublished encoding that needs its room,
once the late one's publication hold let go of it (`producer_publish_pin_s`, R-E06;
FIFO evicts it, announced as `evicted`, B-01); the `slow` request's save is held until
the producer has answered `NACK_NOT_READY` for it (or `HOLD_MAX_S` passed). Commands on
stdin: `encode`, `release`, `status`, `stop`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from kvhandoff.adapters.ec_fault_injection import ECFaults
from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.demo.ec_loop import ECRoleOptions, SaveGate, Stdin, pace, settle
from kvhandoff.demo.ec_requests import HOLD_MAX_S, ECDemoRequest, encoding
from kvhandoff.demo.push_role import emit, rss_mb
from kvhandoff.machines.ec.cache_entry import EncodingEvicted
from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.protocol.ec_status import XferStatus
from kvhandoff.protocol.ec_wire import XferAck

__all__ = ["ProducerLoop"]


class ProducerLoop:
    def __init__(
        self,
        side: ECSide,
        opts: ECRoleOptions,
        requests: list[ECDemoRequest],
        stdin: Stdin,
        deadline: float,
        gate: SaveGate,
        faults: ECFaults,
    ) -> None:
        self.side = side
        self.opts = opts
        self.stdin = stdin
        self.deadline = deadline
        self.held = gate.held
        self.faults = faults
        self.rss_start: float | None = None
        self.published = 0
        self.evicted: list[str] = []
        self.todo: list[list[ECDemoRequest]] = self._plan(requests)
        side.ack_observers.append(self._acked)
        side.eviction_observers.append(self._evicted)

    def _plan(self, requests: list[ECDemoRequest]) -> list[list[ECDemoRequest]]:
        """Steps of work: the late request, then an unpublished encoding that needs its
        room (FIFO evicts the oldest ready entry: the late one), then the slow request
        alone, then the rest a few per step."""
        steps: list[list[ECDemoRequest]] = []
        rest = [r for r in requests if r.case == "normal"]
        for req in requests:
            if req.case == "late":
                tokens = self.side.layout.num_blocks - req.tokens + 1
                filler = ECDemoRequest(
                    f"{req.client_id}-filler", f"filler-{req.mm_hash}", tokens, "filler"
                )
                steps += [[req], [filler]]
            elif req.case == "slow":
                steps.append([req])
        per_step = max(1, self.opts.per_step)
        steps += [rest[i : i + per_step] for i in range(0, len(rest), per_step)]
        return steps

    def _acked(self, ack: XferAck) -> None:
        not_ready = ack.status is XferStatus.NACK_NOT_READY
        if not_ready and self.held.pop(ack.mm_hash, None) is not None:
            emit("save_released", mm_hash=ack.mm_hash, why="answered NACK_NOT_READY")

    def _evicted(self, effect: EncodingEvicted) -> None:
        self.evicted.append(effect.mm_hash)
        emit("evicted", mm_hash=effect.mm_hash, reason=effect.reason)

    def _encode(self, req: ECDemoRequest, *, hold_s: float = 0.0) -> ECRequestInfo:
        info = ECRequestInfo(
            req.client_id,
            (req.mm_hash,),
            mm_metadata={req.mm_hash: req.metadata},
            mm_tokens=(req.tokens,),
        )
        self.side.encoder_cache[req.mm_hash] = encoding(req.mm_hash, req.tokens)
        if hold_s > 0:
            self.held[req.mm_hash] = time.monotonic() + hold_s
        side = self.side
        side.scheduler.update_state_after_alloc(info, 0, side.clock())
        return info

    def _publish(self, req: ECDemoRequest, info: ECRequestInfo) -> None:
        params = self.side.scheduler.request_finished(info, self.side.clock())
        self.published += bool(params.get(req.mm_hash, {}).get("peer_host"))
        emit(
            "finished",
            client=req.client_id,
            mm_hash=req.mm_hash,
            tokens=req.tokens,
            case=req.case,
            params=params,
            t=time.time(),
        )

    def _commands(self) -> bool:
        """Apply stdin commands; False once told to stop."""
        for line in self.stdin.take():
            if line is None or line == "stop":
                return False
            try:
                cmd = json.loads(line)
            except ValueError:
                emit("error", what=f"not a command: {line[:80]}")
                continue
            op = cmd.get("op") if isinstance(cmd, dict) else None
            if op == "stop":
                return False
            if op == "encode":
                req = ECDemoRequest(cmd["client"], cmd["mm_hash"], int(cmd["tokens"]), "command")
                hold = cmd.get("hold", False)  # true: up to HOLD_MAX_S; a number: seconds
                hold_s = HOLD_MAX_S if hold is True else float(hold or 0)
                info = self._encode(req, hold_s=hold_s)
                self.side.engine_step()
                if cmd.get("publish", True):
                    self._publish(req, info)
            elif op == "release":
                self.held.clear()
                emit("released")
            elif op == "status":
                emit("status", **self.status())
            else:
                emit("error", what=f"unknown command {op!r}")
        return True

    def status(self) -> dict[str, Any]:
        """Grants and entries by state name, held saves and metrics (a report)."""
        sched = self.side.scheduler
        grants: dict[str, int] = {}
        if sched.producer is not None:
            for inst in sched.producer.grants():
                grants[inst.state] = grants.get(inst.state, 0) + 1
        entries = {inst.ctx.key: inst.state for inst in sched.cache.entries()}
        return {
            "entries": entries,
            "grants": grants,
            "held": sorted(self.held),
            "metrics": dict(sched.bus.metrics),
        }

    def _hold_s(self, req: ECDemoRequest) -> float:
        """How long the save of `req` is held back: the slow case, or a `slow_save`."""
        slow = req.case == "slow" or (req.case == "normal" and self.faults.roll("slow_save"))
        return HOLD_MAX_S if slow else 0.0

    def _release_due(self) -> None:
        now = time.monotonic()
        for mm_hash, until in list(self.held.items()):
            if now > until:
                del self.held[mm_hash]
                emit("save_released", mm_hash=mm_hash, why="hold timed out")

    def _step(self, group: list[ECDemoRequest]) -> None:
        """One engine step: encode `group`, land saves, let go of what is in the tier or
        was never going to be (no room for its save), publish `group`."""
        side = self.side
        infos = [self._encode(req, hold_s=self._hold_s(req)) for req in group]
        finished = side.engine_step()
        for mm_hash in finished.saved | finished.failed:
            side.encoder_cache.pop(mm_hash, None)  # the "GPU" cache lets it go
        for req, info in zip(group, infos, strict=True):
            if side.scheduler.cache.entry(req.mm_hash) is None:
                side.encoder_cache.pop(req.mm_hash, None)  # no room: nothing to save
            if req.case != "filler":
                self._publish(req, info)

    def _next_group(self) -> list[ECDemoRequest]:
        """The next step's requests; a filler waits until the entry it is to evict is no
        longer pinned by its publication hold (`producer_publish_pin_s`, R-E06)."""
        publisher = self.side.scheduler.publisher
        if not self.todo:
            return []
        for req in self.todo[0]:
            victim = req.mm_hash.removeprefix("filler-")
            if req.case == "filler" and publisher is not None and publisher.holding(victim):
                return []
        return self.todo.pop(0)

    def run(self) -> dict[str, Any]:
        side = self.side
        encoded = 0
        while time.monotonic() < self.deadline:
            side.poll()
            if not self._commands():
                break
            self._release_due()
            group = self._next_group()
            if group and self.rss_start is None:
                self.rss_start = rss_mb()
            self._step(group)
            encoded += len(group)
            pace(self.opts, busy=bool(group))
        self.held.clear()  # held saves land now; grants end with XferDone or the pin lease
        # Grants end by their lease at the latest, publication holds by theirs (R-E06).
        lease_s = max(side.extra.pin_lease_s, side.extra.producer_publish_pin_s)
        until = min(self.deadline, time.monotonic() + lease_s + 2.0)
        settle(side, self.opts, until, lambda: self._step([]))
        return {
            "role": "producer",
            "encoded": encoded,
            "published": self.published,
            "evictions_announced": len(self.evicted),
            "grants": self.status()["grants"],
            "unresolved": sum(map(len, self.todo)),
        }
