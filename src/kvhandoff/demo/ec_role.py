"""`kvhandoff run producer|consumer`: one encoder-cache P2P instance with an engine-like loop.

The producer "encodes" (fills an encoder output with an `mm_hash`-specific pattern),
saves it into its `/dev/shm` region and publishes its `ec_transfer_params` from
`request_finished`. The consumer takes each request with the producer's publications
(relayed on stdin by an orchestrator, or built from the seeded list and `--peer`), pulls
the encodings over ZMQ + NIXL READ, loads them into its encoder cache and verifies every
byte; an encoding it cannot pull it encodes locally, and verifies that too.

Both derive the same request list from `--seed`. Two requests play the protocol's
detours when there are at least two:

- request 0 is published and then evicted by the producer (an unpublished encoding
  needs the room), which announces it (`evicted`, B-01); an orchestrator that relays
  the stale publication anyway gets a `NACK_MISSING`, and the consumer encodes locally;
- request 1 is published before its save has landed (a slow save): the producer holds
  its end event until it has answered `NACK_NOT_READY` for it (or `HOLD_MAX_S` passed),
  so the consumer retries and then reads it.

Events go to stdout as `@@ <json>` lines. Lines on stdin: `go` (with `--wait-go`),
`stop`, and JSON objects: a consumer leg `{"client", "mm_hash", "tokens", "params"}`
(also a producer's `finished` event line as it printed it), or producer commands
`{"op": "encode", "client", "mm_hash", "tokens", "hold", "publish"}` (`hold`: true, or
the most seconds to hold the save back waiting for a NACK_NOT_READY),
`{"op": "release"}` (held saves land), `{"op": "status"}`, `{"op": "stop"}`. A role ends
at `stop`, at the end of stdin, or at `--deadline`; it settles first (held saves land,
grants end with their XferDone or pin lease, reads with their quarantine) and its summary
counts what is left (`ec_audit`), with its resident memory.

For soaks: `--step-ms` paces each engine step, `--faults` with `--fault-seed` injects
seeded faults (`adapters/ec_fault_injection.py`), and `ec_cpu_bytes` in `--config` sizes
the tier (a small one evicts under pressure).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import queue
import secrets
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import numpy as np
import torch

from kvhandoff.adapters.ec_copy_cpu import CpuCopyEngine
from kvhandoff.adapters.ec_fault_injection import ECFaultPlan, ECFaults, FaultyECSide
from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.demo.ec_audit import audit, settled
from kvhandoff.demo.push_role import MARK, emit, rss_mb
from kvhandoff.machines.ec.cache_entry import EncodingEvicted
from kvhandoff.machines.ec.meta import CopyDirection, CopyItem, ECRequestInfo
from kvhandoff.protocol.ec_config import EXTRA_CONFIG_KEYS, ECLayout, ECRole, ECTransferConfig
from kvhandoff.protocol.ec_status import compatibility_hash
from kvhandoff.protocol.ec_wire import XferAck

HIDDEN = 64
DTYPE = torch.bfloat16
DTYPE_NAME = "bfloat16"
BLOCK_BYTES = HIDDEN * 2
TOKEN_CHOICES = (8, 12, 16, 24, 32)
SPARE_BLOCKS = 16
HOLD_MAX_S = 3.0
COMPAT = compatibility_hash("kvhandoff-demo", "demo-encoder", DTYPE_NAME, BLOCK_BYTES)
"""Both demo roles run the same "model", so their compatibility hashes agree (R-E10)."""


@dataclass(frozen=True, slots=True)
class ECDemoRequest:
    client_id: str
    mm_hash: str
    tokens: int
    case: str = "normal"
    """`normal`, `late` (evicted before the orchestrator relays it), `slow` (its save
    lands only after a NACK_NOT_READY) or `filler` (unpublished; evicts the late one)."""

    @property
    def metadata(self) -> dict[str, Any]:
        """The placeholder fields a model would declare for an image of this size."""
        return {"modality": "image", "num_tokens": self.tokens}


def ec_demo_requests(count: int, seed: int) -> list[ECDemoRequest]:
    """The same list on both sides: a few KB per encoding, two detour cases."""
    picks = np.random.default_rng(seed).integers(0, len(TOKEN_CHOICES), max(count, 0))
    out = []
    for i in range(count):
        client = f"mm-{seed:04x}{i:05d}"
        digest = hashlib.blake2b(client.encode(), digest_size=8).hexdigest()
        case = ("late", "slow")[i] if count >= 2 and i < 2 else "normal"
        out.append(ECDemoRequest(client, f"img-{digest}", TOKEN_CHOICES[int(picks[i])], case))
    return out


def encoding(mm_hash: str, tokens: int) -> torch.Tensor:
    """The encoder output of `mm_hash`: `[tokens, HIDDEN]` bfloat16 of seeded bytes."""
    seed = int.from_bytes(hashlib.blake2b(mm_hash.encode(), digest_size=8).digest(), "little")
    raw = np.random.default_rng(seed).integers(0, 256, tokens * BLOCK_BYTES, dtype=np.uint8)
    return torch.from_numpy(raw).view(DTYPE).reshape(tokens, HIDDEN)


def matches(mm_hash: str, tensor: torch.Tensor) -> bool:
    """Every byte of `tensor` is the encoding of `mm_hash` (compared as bytes, so NaN
    patterns compare equal)."""
    expected = encoding(mm_hash, tensor.shape[0])
    return tensor.shape == expected.shape and torch.equal(
        tensor.contiguous().view(torch.uint8), expected.view(torch.uint8)
    )


def region_blocks(requests: list[ECDemoRequest], extra: Mapping[str, Any]) -> int:
    """Room for every encoding at once plus a little, so only the planned eviction
    happens; or what `ec_cpu_bytes` in the extra config asks for (a small tier evicts
    under pressure), at least room for the largest encoding."""
    if "ec_cpu_bytes" in extra:
        return max(int(extra["ec_cpu_bytes"]) // BLOCK_BYTES, max(TOKEN_CHOICES))
    return max(sum(r.tokens for r in requests) + SPARE_BLOCKS, 64)


@dataclass
class ECRoleOptions:
    role: str
    engine_id: str
    listen_host: str
    listen_port: int
    advertise_host: str | None
    peer_host: str
    peer_port: int
    requests: int
    seed: int
    backend: str
    deadline_s: float
    per_step: int
    extra: dict[str, Any]
    machine: dict[str, float]
    wait_go: bool = False
    relay: bool = False
    step_ms: float = 0.0
    """Each engine step takes this long (0: as fast as it goes, idling when there is
    nothing to do)."""
    faults: str = ""
    """Seeded faults of `ECFaultPlan`, e.g. `read_fail=0.02,ack_drop=0.01`."""
    fault_seed: int = 0


def transfer_config(opts: ECRoleOptions, num_blocks: int) -> ECTransferConfig:
    role: ECRole = "ec_producer" if opts.role == "producer" else "ec_consumer"
    return ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role=role,
        ec_connector_extra_config={
            "ec_enable_nixl": True,
            "nixl_backend": opts.backend,
            **opts.extra,
            "ec_cpu_bytes": num_blocks * BLOCK_BYTES,
        },
        engine_id=opts.engine_id,
    )


class _Stdin:
    """Lines from stdin on a daemon thread. When stdin is a pipe (a launcher, a test, a
    shell pipeline) its end means whoever drives the role is gone: None is queued and the
    role stops. A terminal or `/dev/null` ending means nothing."""

    def __init__(self) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        try:
            self.piped = stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode)
        except (OSError, ValueError):
            self.piped = False
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in sys.stdin:
            if line.strip():
                self.lines.put(line.strip())
        if self.piped:
            self.lines.put(None)

    def wait_go(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None or line == "stop":
                return False
            if line == "go":
                return True
        return False

    def take(self) -> list[str | None]:
        out: list[str | None] = []
        while True:
            try:
                out.append(self.lines.get_nowait())
            except queue.Empty:
                return out


class _SaveGate:
    """Holds the end event of saves named in `held` (mm_hash -> give-up time)."""

    def __init__(self) -> None:
        self.held: dict[str, float] = {}

    def may_land(
        self, batch_id: int, direction: CopyDirection, items: tuple[CopyItem, ...]
    ) -> bool:
        return direction != "save" or not any(item.mm_hash in self.held for item in items)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through `close()`: the region is unlinked


def _side_class(opts: ECRoleOptions) -> tuple[Callable[..., ECSide], ECFaults]:
    faults = ECFaults(ECFaultPlan.parse(opts.faults), opts.fault_seed)
    if not faults.plan.any:
        return ECSide, faults
    return functools.partial(FaultyECSide, faults=faults), faults


def run_ec_role(opts: ECRoleOptions) -> int:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _on_sigterm)
    requests = ec_demo_requests(opts.requests, opts.seed)
    num_blocks = region_blocks(requests, opts.extra)
    layout = ECLayout(HIDDEN, 2, num_blocks * BLOCK_BYTES)
    stdin = _Stdin()
    gate = _SaveGate()
    loop: _ProducerLoop | _ConsumerLoop
    side_class, faults = _side_class(opts)
    side = side_class(
        transfer_config(opts, num_blocks),
        layout,
        compat_hash=COMPAT,
        listen=(opts.listen_host, opts.listen_port) if opts.role == "producer" else None,
        advertise_host=opts.advertise_host,
        machine_config=opts.machine,
        copy_engine_factory=lambda region, size: CpuCopyEngine(region, size, release=gate.may_land),
    )
    try:
        emit(
            "ready",
            role=opts.role,
            engine_id=opts.engine_id,
            port=side.publish_port,
            region=side.region_path,
            reaped=side.reaped,
            pid=os.getpid(),
        )
        deadline = time.monotonic() + opts.deadline_s
        if opts.wait_go and not stdin.wait_go(deadline):
            emit("summary", role=opts.role, unresolved=0, stopped_before_go=True)
            return 0
        if opts.role == "producer":
            loop = _ProducerLoop(side, opts, requests, stdin, deadline, gate, faults)
        else:
            loop = _ConsumerLoop(side, opts, requests, stdin, deadline)
        summary = loop.run()
        summary.update(audit(side), counters=side.counters(), injected=dict(faults.injected))
    finally:
        side.close()
    emit("summary", **summary, rss_mb_start=loop.rss_start, rss_mb=rss_mb())
    return 0 if summary.get("unresolved", 0) == 0 else 1


def _idle() -> None:
    time.sleep(0.0002)  # an engine with nothing to compute would wait for requests


def _pace(opts: ECRoleOptions, busy: bool) -> None:
    """The end of one engine step: it took `--step-ms`, or it idles when it had no work."""
    if opts.step_ms > 0:
        time.sleep(opts.step_ms / 1000.0)
    elif not busy:
        _idle()


def _settle(side: ECSide, opts: ECRoleOptions, until: float, step: Callable[[], Any]) -> None:
    """Keep stepping after the traffic until nothing is in flight (grants end with their
    XferDone or pin lease, reads with their quarantine), or `until`."""
    while not settled(side) and time.monotonic() < until:
        step()
        _pace(opts, busy=False)


class _ProducerLoop:
    def __init__(
        self,
        side: ECSide,
        opts: ECRoleOptions,
        requests: list[ECDemoRequest],
        stdin: _Stdin,
        deadline: float,
        gate: _SaveGate,
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
        if str(ack.status) == "NACK_NOT_READY" and self.held.pop(ack.mm_hash, None) is not None:
            emit("save_released", mm_hash=ack.mm_hash, why="answered NACK_NOT_READY")

    def _evicted(self, effect: EncodingEvicted) -> None:
        self.evicted.append(effect.mm_hash)
        emit("evicted", mm_hash=effect.mm_hash, reason=effect.reason)

    def _encode(self, req: ECDemoRequest, *, hold_s: float = 0.0) -> ECRequestInfo:
        info = ECRequestInfo(req.client_id, (req.mm_hash,), mm_metadata={req.mm_hash: req.metadata})
        self.side.encoder_cache[req.mm_hash] = encoding(req.mm_hash, req.tokens)
        if hold_s > 0:
            self.held[req.mm_hash] = time.monotonic() + hold_s
        self.side.scheduler.update_state_after_alloc(info, req.mm_hash, req.tokens)
        return info

    def _publish(self, req: ECDemoRequest, info: ECRequestInfo) -> None:
        params = self.side.scheduler.request_finished(info)
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
        sched = self.side.scheduler
        grants: dict[str, int] = {}
        if sched.producer is not None:
            for inst in sched.producer.grants():
                grants[inst.state] = grants.get(inst.state, 0) + 1
        entries = {inst.key: inst.state for inst in sched.cache.entries()}
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
            if side.scheduler.cache.state(req.mm_hash) is None:
                side.encoder_cache.pop(req.mm_hash, None)  # no room: nothing to save
            if req.case != "filler":
                self._publish(req, info)

    def run(self) -> dict[str, Any]:
        side = self.side
        encoded = 0
        while time.monotonic() < self.deadline:
            side.poll()
            if not self._commands():
                break
            self._release_due()
            group = self.todo.pop(0) if self.todo else []
            if group and self.rss_start is None:
                self.rss_start = rss_mb()
            self._step(group)
            encoded += len(group)
            _pace(self.opts, busy=bool(group))
        self.held.clear()  # held saves land now; grants end with XferDone or the pin lease
        until = min(self.deadline, time.monotonic() + side.extra.pin_lease_s + 2.0)
        _settle(side, self.opts, until, lambda: self._step([]))
        return {
            "role": "producer",
            "encoded": encoded,
            "published": self.published,
            "evictions_announced": len(self.evicted),
            "grants": self.status()["grants"],
            "unresolved": sum(map(len, self.todo)),
        }


@dataclass
class _Pending:
    req: ECDemoRequest
    info: ECRequestInfo
    scheduled: bool = False
    via: str = ""
    reason: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class _ConsumerLoop:
    def __init__(
        self,
        side: ECSide,
        opts: ECRoleOptions,
        requests: list[ECDemoRequest],
        stdin: _Stdin,
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
            info = ECRequestInfo(f"{req.client_id}-c", (req.mm_hash,), ec_transfer_params=params)
            self.pending[req.client_id] = _Pending(req, info)

    def _schedule(self, item: _Pending) -> None:
        """The request may run: load its encoding from the tier, or encode it here."""
        sched, side = self.side.scheduler, self.side
        req = item.req
        item.scheduled = True
        outcome = side.read_outcomes.get(req.mm_hash)
        if outcome is not None and outcome.not_ready:
            item.extra["not_ready"] = outcome.not_ready
        if sched.has_cache_item(req.mm_hash):
            side.encoder_cache[req.mm_hash] = torch.empty(req.tokens, HIDDEN, dtype=DTYPE)
            sched.update_state_after_alloc(item.info, req.mm_hash, req.tokens)
            self.loading[req.mm_hash] = req.client_id
            item.via = "p2p"
            return
        inst = sched.bus.get("ec.request", item.info.request_id)
        item.reason = "" if inst is None else inst.ctx.local.get(req.mm_hash, "")
        item.via = "local"
        side.encoder_cache[req.mm_hash] = encoding(req.mm_hash, req.tokens)  # encode here
        self._finish(item, ok=True)

    def _finish(self, item: _Pending, *, ok: bool, failure: str = "") -> None:
        req = item.req
        tensor = self.side.encoder_cache.pop(req.mm_hash, None)
        verified = ok and tensor is not None and matches(req.mm_hash, tensor)
        self.side.scheduler.request_finished(item.info)
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

    def run(self) -> dict[str, Any]:
        side, sched = self.side, self.side.scheduler
        total = len(self.expected)
        while time.monotonic() < self.deadline and not self.stopped:
            side.poll()
            self._read_legs()
            self._admit()
            for item in list(self.pending.values()):
                if not item.scheduled and sched.ensure_cache_available(item.info):
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
            if total and self.resolved >= total and not self.legs:
                break
            _pace(self.opts, busy=False)
        for item in list(self.pending.values()):
            self._finish(item, ok=False, failure="deadline passed")
        extra = side.extra
        waits = extra.consumer_ack_timeout_s + extra.nixl_read_timeout_s + extra.read_quarantine_s
        until = min(self.deadline, time.monotonic() + waits + 2.0)
        _settle(side, self.opts, until, side.engine_step)
        return {
            "role": "consumer",
            "requests": total,
            **self.counts,
            "verified": self.verified,
            "failed": self.failed,
            "unresolved": total - self.resolved if total else 0,
        }


def _split(address: str | None, default_host: str) -> tuple[str, int]:
    host, _, port = (address or ":0").rpartition(":")
    return (host.strip("[]") or default_host), int(port or 0)


def main_from_args(args: Any) -> int:
    """`kvhandoff run producer|consumer`; ends the process when the role is done."""
    listen_host, listen_port = _split(args.listen, "127.0.0.1")
    peer_host, peer_port = _split(args.peer, "127.0.0.1")
    overrides = json.loads(args.config)
    if not isinstance(overrides, dict):
        print("--config must be a JSON object", file=sys.stderr)
        return 2
    extra = {k: v for k, v in overrides.items() if k in EXTRA_CONFIG_KEYS}
    machine = {k: float(v) for k, v in overrides.items() if k not in EXTRA_CONFIG_KEYS}
    relay = bool(getattr(args, "relay", False))
    if args.role == "consumer" and not relay and not peer_port:
        print(
            "kvhandoff run consumer needs --peer HOST:PORT (the producer's side channel), "
            "or --relay to take publications on stdin",
            file=sys.stderr,
        )
        return 2
    opts = ECRoleOptions(
        role=args.role,
        engine_id=args.engine_id or f"{args.role}-{secrets.token_hex(4)}",
        listen_host=listen_host,
        listen_port=listen_port,
        advertise_host=getattr(args, "advertise_host", None),
        peer_host=peer_host,
        peer_port=peer_port,
        requests=args.requests,
        seed=args.seed,
        backend=args.backend,
        deadline_s=args.deadline,
        per_step=args.per_step,
        extra=extra,
        machine=machine,
        wait_go=args.wait_go,
        relay=relay,
        step_ms=float(getattr(args, "step_ms", 0.0)),
        faults=getattr(args, "faults", ""),
        fault_seed=int(getattr(args, "fault_seed", 0)),
    )
    code = run_ec_role(opts)
    # Everything was closed explicitly (the region unlinked, the agent and sockets closed);
    # skip the interpreter teardown, which takes about a second with torch loaded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
