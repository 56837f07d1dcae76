"""`kvhandoff run prefill|decode`: one push-mode instance with an engine-like step loop.

Each process owns a real NIXL agent over its KV regions, serves its handshake on a ZMQ
side channel, runs the push writer thread and steps the scheduler/worker API like an
engine: D allocates blocks and registers them; P "prefills" (fills each request's blocks
with a request-specific pattern) and finishes; the framework pushes; D verifies every
byte. Both derive the same request list from `--seed`, standing in for a proxy that
sends the prefill leg to P and the decode leg to D (R-P01). Events go to stdout as
`@@ <json>` lines, which the demo launcher reads.
"""

from __future__ import annotations

import json
import os
import queue
import random
import secrets
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvhandoff.adapters.trace import apply_trace_config
from kvhandoff.protocol.push_config import PushConfig

MARK = "@@ "


@dataclass(frozen=True, slots=True)
class DemoRequest:
    client_id: str
    num_blocks: int


def demo_requests(count: int, seed: int) -> list[DemoRequest]:
    """Many small requests and a few large ones, the same list on both sides."""
    rng = random.Random(seed)
    sizes = [
        rng.choice((1, 2, 3, 4, 6, 8)) if i % 8 else rng.choice((24, 32)) for i in range(count)
    ]
    return [DemoRequest(f"cmpl-{seed:04x}{i:05d}-0", n) for i, n in enumerate(sizes)]


def emit(event: str, **fields: Any) -> None:
    print(MARK + json.dumps({"event": event, **fields}), flush=True)


@dataclass
class RoleOptions:
    role: str
    engine_id: str
    listen_host: str
    listen_port: int
    peer_host: str
    peer_port: int
    peer_engine_id: str
    requests: int
    seed: int
    backend: str
    deadline_s: float
    per_step: int
    config: PushConfig
    wait_go: bool = False
    mode: str = "push"
    step_ms: float = 0.0
    warmup: bool = False
    faults: str = ""
    fault_seed: int = 0


def run_push_role(opts: RoleOptions) -> int:
    from kvhandoff.adapters.fault_injection import FaultPlan, faulty_transport_factory
    from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
    from kvhandoff.demo.push_instance import LivePushInstance

    plan = FaultPlan.parse(opts.faults)
    factory = faulty_transport_factory(plan, opts.fault_seed) if plan.any else NixlPushTransport
    live = LivePushInstance(
        opts.role,  # type: ignore[arg-type]
        opts.engine_id,
        listen_host=opts.listen_host,
        listen_port=opts.listen_port,
        config=opts.config,
        mode=opts.mode,  # type: ignore[arg-type]
        transport_factory=factory,
    )
    emit("ready", engine_id=opts.engine_id, port=live.port, role=opts.role, mode=opts.mode)
    if opts.wait_go:
        sys.stdin.readline()  # the launcher starts both sides together, as a proxy would
    try:
        loop = _PrefillLoop(live, opts) if opts.role == "prefill" else _DecodeLoop(live, opts)
        summary = loop.run()
    finally:
        live.close()
    counters = live.counters()
    summary.update(
        rejected_notifs=counters["rejected_notifs"],
        failed_transfers=counters["failed_transfers"],
        writer_errors=counters["writer_errors"],
        rejected_by_reason=counters["rejected_by_reason"],
        registrations_dropped=counters["registrations_dropped"],
        side_channel=counters["side_channel"],
        injected=dict(getattr(live.transport, "injected", {})),
        leaked_blocks=live.memory.shape.num_blocks - live.memory.free_count,
        live_lifecycles=live.live_lifecycles(),
        rss_mb=rss_mb(),
    )
    emit("summary", **summary)
    return 0 if summary.get("unresolved", 0) == 0 else 1


def rss_mb() -> float:
    """Resident set size of this process, in MiB (Linux)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


class _Loop:
    def __init__(self, live: Any, opts: RoleOptions) -> None:
        self.live = live
        self.side = live.side
        self.memory = live.memory
        self.opts = opts
        self.todo = demo_requests(opts.requests, opts.seed)
        self.suffix = secrets.token_hex(4)  # the per-engine random request-id suffix
        self.blocks: dict[str, list[int]] = {}
        self.client_of: dict[str, str] = {}
        self.deadline = time.monotonic() + opts.deadline_s
        self.rss_start: float | None = None
        self.started = 0
        self.completed = 0
        self._held: tuple[str, dict[str, Any]] | None = None

    def _admit(self) -> int:
        """Requests to start this step. With --warmup, the first request runs alone, so
        first-contact handshakes stay out of the measured ones."""
        if self.opts.warmup and self.completed == 0:
            return 0 if self.blocks or self.started else 1
        return self.opts.per_step

    def _fitting(self, requests: list[DemoRequest]) -> list[DemoRequest]:
        """The leading requests whose blocks fit in the free pool (backpressure)."""
        fitting: list[DemoRequest] = []
        free = self.memory.free_count
        for req in requests:
            if req.num_blocks > free:
                break
            fitting.append(req)
            free -= req.num_blocks
        return fitting

    def request_id(self, client_id: str) -> str:
        return f"{client_id}-{self.suffix}"

    def step(self) -> Any:
        return self.live.step()

    def idle(self) -> None:
        # An engine step takes time (or waits for requests when idle); --step-ms paces it.
        time.sleep(max(0.0002, self.opts.step_ms / 1000.0))


class _PrefillLoop(_Loop):
    def run(self) -> dict[str, Any]:
        side = self.side
        sent = 0
        while time.monotonic() < self.deadline:
            batch = self._fitting(self.todo[: self._admit()])
            for req in batch:
                rid = self.request_id(req.client_id)
                blocks = self.memory.allocate(req.num_blocks)
                self.memory.fill(req.client_id, blocks)
                self.blocks[rid], self.client_of[rid] = blocks, req.client_id
                _, params = side.request_finished(rid, blocks, {"do_remote_decode": True})
                self.started += 1
                nbytes = req.num_blocks * self.memory.shape.block_len * self.memory.shape.regions
                emit("finished", client=req.client_id, t=time.time(), bytes=nbytes, params=params)
            self.todo = self.todo[len(batch) :]
            if len(self.blocks) == 1 and self.rss_start is None:
                self.rss_start = rss_mb()
            output = self.step()
            for rid in output.finished_sending:
                self.memory.free(self.blocks.pop(rid))
                sent += 1
                self.completed += 1
            if not self.todo and not side.scheduler.has_pending_push_work():
                break
            self.idle()
        return {
            "role": "prefill",
            "finished_sending": sent,
            "unresolved": len(self.blocks),
            "rss_mb_start": self.rss_start,
        }


class _DecodeLoop(_Loop):
    """D's engine loop. Push: the decode legs come with the seeded list (P's coordinates
    only). Pull: each leg carries P's request and blocks, relayed on stdin as JSON lines by
    the proxy (the launcher) once P has finished the prefill."""

    def run(self) -> dict[str, Any]:
        side = self.side
        legs = self._legs()
        expected = len(self.todo)
        sizes = {req.client_id: req.num_blocks for req in self.todo}
        started = verified = failed = 0
        while time.monotonic() < self.deadline:
            for client_id, params in self._take(legs, self._admit(), sizes):
                rid = self.request_id(client_id)
                blocks = self.memory.allocate(sizes[client_id])
                self.memory.clear(blocks)
                self.blocks[rid], self.client_of[rid] = blocks, client_id
                side.update_state_after_alloc(rid, blocks, params)
                started += 1
                self.started = started
            if started == 1 and self.rss_start is None:
                self.rss_start = rss_mb()
            output = self.step()
            for rid in output.finished_recving:
                client, blocks = self.client_of.pop(rid), self.blocks.pop(rid)
                ok = self.memory.verify(client, blocks)
                verified += ok
                self.completed += 1
                emit("received", client=client, t=time.time(), verified=ok)
                self.memory.free(blocks)
            for rid, reason in output.failed_recving.items():
                client, blocks = self.client_of.pop(rid), self.blocks.pop(rid)
                failed += 1
                emit("failed", client=client, reason=reason)
                self.memory.free(blocks)
            for rid, reason in output.released.items():
                # Ended by the abort path below (R-P10), once no rank holds it.
                client, blocks = self.client_of.pop(rid), self.blocks.pop(rid)
                failed += 1
                emit("failed", client=client, reason=reason)
                self.memory.free(blocks)
            for rid in self._given_up():
                side.abort(rid)  # the engine's request-level abort path: released next step
            if started == expected and not self.blocks:
                break
            self.idle()
        for rid in list(self.blocks):
            side.abort(rid)
            emit("failed", client=self.client_of[rid], reason="deadline passed")
        return {
            "role": "decode",
            "verified": verified,
            "failed": failed,
            "unresolved": len(self.blocks) + expected - started,
            "rss_mb_start": self.rss_start,
        }

    def _given_up(self) -> list[str]:
        """Requests the watchdog dropped: they wait for the engine's abort path."""
        from kvhandoff.machines.push.d_request import D_REQUEST

        return [str(i.key) for i in self.side.scheduler.bus.tagged(D_REQUEST, "given_up")]

    def _legs(self) -> queue.Queue[tuple[str, dict[str, Any]]]:
        from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg

        legs: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        if self.opts.mode == "pull":
            threading.Thread(target=_read_legs, args=(legs,), daemon=True).start()
            return legs
        prefill = PrefillCoordinates(
            self.opts.peer_engine_id, self.opts.peer_host, self.opts.peer_port, 1
        )
        for req in self.todo:
            legs.put((req.client_id, decode_leg({}, prefill)["kv_transfer_params"]))
        return legs

    def _take(
        self, legs: queue.Queue[tuple[str, dict[str, Any]]], count: int, sizes: dict[str, int]
    ) -> list[tuple[str, dict[str, Any]]]:
        """Up to `count` legs, in order, while their blocks fit the free pool."""
        taken: list[tuple[str, dict[str, Any]]] = []
        free = self.memory.free_count
        while len(taken) < count:
            if self._held is None:
                try:
                    self._held = legs.get_nowait()
                except queue.Empty:
                    break
            client_id, _params = self._held
            if sizes[client_id] > free:
                break
            taken.append(self._held)
            free -= sizes[client_id]
            self._held = None
        return taken


def _read_legs(legs: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
    """Pull mode: `{"client": .., "params": ..}` lines from the proxy on stdin."""
    for line in sys.stdin:
        if line.strip():
            leg = json.loads(line)
            legs.put((leg["client"], leg["params"]))


def main_from_args(args: Any) -> int:
    host, _, port = args.listen.rpartition(":")
    peer_host, _, peer_port = (args.peer or ":0").rpartition(":")
    opts = RoleOptions(
        role=args.role,
        engine_id=args.engine_id or f"{args.role}-0",
        listen_host=host or "127.0.0.1",
        listen_port=int(port or 0),
        peer_host=peer_host or "127.0.0.1",
        peer_port=int(peer_port or 0),
        peer_engine_id=args.peer_engine_id,
        requests=args.requests,
        seed=args.seed,
        backend=args.backend,
        deadline_s=args.deadline,
        per_step=args.per_step,
        config=PushConfig.from_mapping(
            {"nixl_backend": args.backend, **apply_trace_config(json.loads(args.config))}
        ),
        wait_go=args.wait_go,
        mode=args.mode,
        step_ms=args.step_ms,
        warmup=args.warmup,
        faults=args.faults,
        fault_seed=args.fault_seed,
    )
    if opts.role == "decode" and not opts.peer_port:
        print(
            "kvhandoff run decode needs --peer HOST:PORT (the prefill side channel)",
            file=sys.stderr,
        )
        return 2
    return run_push_role(opts)
