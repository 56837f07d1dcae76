"""`python -m kvhandoff.bench.probes.push_writer_pass`: the host cost of a push, P and D,
per request, in one process (a probe: a stand-in transport, no NIXL, no GPU).

A P and a D engine (`PushSide`: the real scheduler, worker rank, writer core and
executors), each over a transport that knows the other engine as connected; P's queues
WRITEs the way the CUDA IPC transport does (nothing moves, each handle is DONE once
"launched"). Per rep: D registers
`requests` requests and P's writer holds their `PUSH_REG`s, then P finishes every request
in one engine step; the phases are timed one after the other, single-threaded, with
`time.perf_counter`:

- `d_register`: D's side of the registrations: `update_state_after_alloc` for every
  request, the engine step that hands them to the rank, and the writer pass that sends the
  `PUSH_REG`s (encoded, sent through the stand-in);
- `p_reg`: P's writer pass that takes them (each `PUSH_REG` checked, decoded, validated
  and held in its match slot);
- `finish`: the scheduler's `request_finished` for every request;
- `stage`: the engine step that hands the blocks to the rank (`build_connector_meta`,
  `start_load_kv`);
- `writer`: the writer pass that matches and issues every WRITE;
- `report`: the engine step that takes the writer's reports, polls the WRITEs and reports
  `finished_sending`;
- `d_writer`: D's writer pass that takes the completion notifs;
- `d_step`: D's engine step that applies them and reports `finished_recving`.

Prints the median of each phase in µs per request, their total, and `total_from_finish`
(the phases from `finish` on: what the probe timed before `d_register` and `p_reg` were
added) as JSON.

`--count` runs the same reps under cProfile instead, from D's `update_state_after_alloc`
to D's `finished_recving` (both engines' scheduler, rank and writer halves), and prints
per pushed request: Python calls, bus dispatches (calls of `EventBus.dispatch` and of
`dispatch_many`, one per batch), the events those delivered to instances (a batch counts
each of its keys), and machine instances created on every bus (issue 26's figures of the
request's path).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvhandoff.adapters.push_side import PushSide
from kvhandoff.adapters.push_transport import (
    EngineInfo,
    RankInfo,
    Routes,
    TransferHandle,
    XferState,
)
from kvhandoff.machines.push.scheduler import LocalEngine
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError
from kvhandoff.protocol.handshake import EngineHandshake, HandshakePayload
from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk

P_ENGINE = "bench-prefill"
D_ENGINE = "bench-decode"
P_AGENT = "bench-prefill-agent"
D_AGENT = "bench-decode-agent"


@dataclass(eq=False, slots=True)
class _Handle:
    notif: bytes
    xfer_status: XferState = "PROC"


@dataclass
class MemoryTransport:
    """One side's stand-in: connected to the other side from the start; notifs go
    straight into the peer's inbox; WRITEs queue and are all DONE, their notifs sent, at
    the next poll (as the CUDA IPC transport does after its launch)."""

    engine_id: str
    agent_name: str
    peer_engine: str
    peer_agent: str
    capacity: int
    peer: MemoryTransport | None = None
    inbox: list[tuple[str, bytes]] = field(default_factory=list)
    queued: list[_Handle] = field(default_factory=list)

    def handshake_payload(self) -> HandshakePayload:
        raise LocalProtocolError("the probe serves no handshake")

    def advertise(self, extensions: Sequence[str], auth_key_id: str) -> None:
        return None

    def fetch_handshake(
        self, host: str, port: int, timeout_s: float, ranks: Sequence[tuple[int, int]]
    ) -> list[bytes]:
        raise LocalProtocolError("the probe's peers are connected from the start")

    def connect(self, engine: EngineHandshake, routes: Routes) -> EngineInfo:
        raise LocalProtocolError("the probe's peers are connected from the start")

    def forget(self, engine_id: str) -> None:
        return None

    def engine(self, engine_id: str) -> EngineInfo | None:
        if engine_id != self.peer_engine:
            return None
        rank = RankInfo(0, self.peer_agent, 1, self.capacity)
        return EngineInfo(self.peer_engine, 1, 1, frozenset(), (rank,))

    def identify(self, agent_name: str) -> tuple[str, int] | None:
        return (self.peer_engine, 0) if agent_name == self.peer_agent else None

    def send_notif(self, engine_id: str, rank: int, message: bytes) -> None:
        assert self.peer is not None
        self.peer.inbox.append((self.agent_name, message))

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        inbox, self.inbox = self.inbox, []
        return inbox

    def write_blocks(
        self,
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        *,
        local_chunk: Chunk = WHOLE,
        remote_chunk: Chunk = WHOLE,
    ) -> _Handle:
        handle = _Handle(notif)
        self.queued.append(handle)
        return handle

    def flush_writes(self) -> list[tuple[str, KvHandoffError]]:
        return []

    def read_blocks(
        self,
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        *,
        local_chunk: Chunk = WHOLE,
        remote_chunk: Chunk = WHOLE,
    ) -> _Handle:
        raise LocalProtocolError("the probe runs push mode")

    def poll(self, handle: TransferHandle) -> XferState:
        assert isinstance(handle, _Handle)
        if self.queued:
            for queued in self.queued:
                queued.xfer_status = "DONE"
                self.send_notif(self.peer_engine, 0, queued.notif)
            self.queued = []
        return handle.xfer_status

    def progress(self) -> None:
        return None

    write_poll_interval_s: float | None = None

    def complete_writes(self, now: float) -> int:
        return 0  # a WRITE here ends when the main thread polls it: nothing to settle

    def bind_bus(self, bus: EventBus) -> None:
        return None

    def release(self, handle: TransferHandle) -> None:
        return None


PHASES = ("d_register", "p_reg", "finish", "stage", "writer", "report", "d_writer", "d_step")


def _created(side: PushSide) -> int:
    """Machine instances created so far on every bus of one engine."""
    buses = [side.scheduler.bus, *(r.bus for r in side.ranks), *(r.writer_bus for r in side.ranks)]
    return sum(m.created for bus in buses for m in bus._machines.values())


class _Profiler(Protocol):
    def enable(self) -> None: ...
    def disable(self) -> None: ...


def run(
    requests: int, blocks_per_request: int, reps: int, profile: _Profiler | None = None
) -> dict[str, float]:
    capacity = requests * blocks_per_request
    tp = MemoryTransport(P_ENGINE, P_AGENT, D_ENGINE, D_AGENT, capacity)
    td = MemoryTransport(D_ENGINE, D_AGENT, P_ENGINE, P_AGENT, capacity)
    tp.peer, td.peer = td, tp
    config = PushConfig()
    p = PushSide(
        "prefill", LocalEngine(P_ENGINE, "127.0.0.1", 5600), tp, lambda job: None, config=config
    )
    d = PushSide(
        "decode", LocalEngine(D_ENGINE, "127.0.0.1", 5700), td, lambda job: None, config=config
    )
    prefill = PrefillCoordinates(P_ENGINE, "127.0.0.1", 5600, 1)
    phases: dict[str, list[float]] = {name: [] for name in PHASES}
    created = 0
    for rep in range(reps + 2):
        if profile is not None and rep >= 2:
            created -= _created(p) + _created(d)
            profile.enable()
        client = [f"cmpl-probe{rep:04d}{q:05d}-0" for q in range(requests)]
        n = blocks_per_request
        p_blocks = [list(range(q * n, (q + 1) * n)) for q in range(requests)]
        d_blocks = list(reversed(p_blocks))
        legs = [decode_leg({"request_id": cid}, prefill)["kv_transfer_params"] for cid in client]
        tr = time.perf_counter()
        for q, cid in enumerate(client):  # D registers ...
            d.update_state_after_alloc(f"{cid}-ffff0000", d_blocks[q], legs[q])
        d.step()
        d.writer_pass()
        connect_deferred(d.ranks[0])  # first rep: D's remote engine connects
        d.writer_pass()
        tp0 = time.perf_counter()
        p.writer_pass()  # ... and P's writer takes and holds the registrations
        t0 = time.perf_counter()
        for q, cid in enumerate(client):
            p.request_finished(f"{cid}-abcd1234", p_blocks[q], {"do_remote_decode": True})
        t1 = time.perf_counter()
        rank = p.ranks[0]
        rank.start_load_kv(p.build_connector_meta())
        t2 = time.perf_counter()
        rank.writer_pass()
        t3 = time.perf_counter()
        sent = set(p.get_finished().finished_sending)
        t4 = time.perf_counter()
        d.writer_pass()
        t5 = time.perf_counter()
        received = set(d.step().finished_recving)
        t6 = time.perf_counter()
        if rep >= 2:
            if profile is not None:
                profile.disable()
                created += _created(p) + _created(d)
            assert (len(sent), len(received)) == (requests, requests), (len(sent), len(received))
        connect_deferred(rank)  # first rep: P's remote engine connects, as a handshake would
        while len(sent) < requests or len(received) < requests:  # warm-up reps
            p.writer_pass()
            sent |= set(p.step().finished_sending)
            d.writer_pass()
            received |= set(d.step().finished_recving)
        if rep >= 2:
            marks = (tr, tp0, t0, t1, t2, t3, t4, t5, t6)
            for i, name in enumerate(PHASES):
                phases[name].append((marks[i + 1] - marks[i]) * 1e6 / requests)
    result = {name: round(statistics.median(v), 2) for name, v in phases.items()}
    result["total"] = round(sum(result.values()), 2)
    # The phases timed before `d_register` and `p_reg` were (issue 26's earlier figures).
    result["total_from_finish"] = round(sum(result[name] for name in PHASES[2:]), 2)
    if profile is not None:
        result["instances_per_request"] = round(created / (requests * reps), 2)
    return result


class _Hops:
    """A profile-shaped tracer of the request's path: calls from one kvhandoff module into
    another (a hop), and the modules entered (`sys.setprofile`, enabled like cProfile).
    The bus's generated steps (`<kvhandoff step ...>`) are its general step specialised
    per route (`machines/runtime/steps.py`), so they count as that step's module,
    `delivery.py`."""

    def __init__(self) -> None:
        self.hops = 0
        self.modules: set[str] = set()

    def _trace(self, frame: object, event: str, arg: object) -> None:
        if event != "call":
            return
        callee = _module_of(frame.f_code.co_filename)  # type: ignore[attr-defined]
        if "kvhandoff/" not in callee or "/probes/" in callee:
            return
        self.modules.add(callee)
        caller = frame.f_back  # type: ignore[attr-defined]
        if caller is not None and _module_of(caller.f_code.co_filename) != callee:
            self.hops += 1

    def enable(self) -> None:
        sys.setprofile(self._trace)

    def disable(self) -> None:
        sys.setprofile(None)


def _module_of(filename: str) -> str:
    """The package-relative module of a code object's file (`kvhandoff/...`)."""
    if filename.startswith("<kvhandoff step "):
        return "kvhandoff/machines/runtime/delivery.py"
    _head, sep, tail = filename.rpartition("kvhandoff/")
    return sep + tail if sep else filename


def hops() -> dict[str, object]:
    """One request pushed alone (after two warm-up reps): cross-module calls and modules."""
    tracer = _Hops()
    run(1, 4, 1, tracer)
    return {"cross_module_calls": tracer.hops, "modules": len(tracer.modules)}


def count(requests: int, blocks_per_request: int, reps: int) -> dict[str, float]:
    """Calls, dispatches and instances per pushed request (see the module docstring)."""
    profile = cProfile.Profile()
    result = run(requests, blocks_per_request, reps, profile)
    stats = pstats.Stats(profile)
    pushed = requests * reps
    calls = sum(entry[1] for entry in stats.stats.values())  # type: ignore[attr-defined]
    dispatches = sum(
        entry[1]
        for (filename, _line, name), entry in stats.stats.items()  # type: ignore[attr-defined]
        if name in ("dispatch", "dispatch_many") and filename.endswith("runtime/delivery.py")
    )
    return {
        "requests": requests,
        "reps": reps,
        "calls_per_request": round(calls / pushed, 1),
        "dispatches_per_request": round(dispatches / pushed, 2),
        "events_per_request": round(_delivered(requests, blocks_per_request) / requests, 2),
        "instances_per_request": result["instances_per_request"],
    }


def _delivered(requests: int, blocks_per_request: int) -> int:
    """Events delivered to instances during one measured rep (a batch of `dispatch_many`
    counts each key), counted by wrapping the bus's two entry points (unprofiled)."""
    from kvhandoff.machines.runtime.bus import EventBus

    single, many = EventBus.dispatch, EventBus.dispatch_many
    counter = _EventCounter()

    def dispatch(bus: EventBus, kind: Any, key: Any, event: Any, now: float) -> None:
        counter.events += counter.on
        single(bus, kind, key, event, now)

    def dispatch_many(bus: EventBus, kind: Any, keys: Any, event: Any, now: float) -> Any:
        keys = list(keys)
        counter.events += counter.on * len(keys)
        return many(bus, kind, keys, event, now)

    EventBus.dispatch, EventBus.dispatch_many = dispatch, dispatch_many  # type: ignore[assignment,method-assign]
    try:
        run(requests, blocks_per_request, 1, counter)
    finally:
        EventBus.dispatch, EventBus.dispatch_many = single, many  # type: ignore[method-assign]
    return counter.events


class _EventCounter:
    """Profile-shaped: counts while enabled (the measured rep)."""

    def __init__(self) -> None:
        self.events = 0
        self.on = 0

    def enable(self) -> None:
        self.on = 1

    def disable(self) -> None:
        self.on = 0


def connect_deferred(rank: object) -> None:
    """Complete a handshake the rank's writer started (the probe's peers are connected)."""
    from kvhandoff.machines.push.remote_engine import REMOTE_ENGINE

    writer = rank.writer  # type: ignore[attr-defined]
    for inst in writer.bus.tagged(REMOTE_ENGINE, "deferring"):
        writer.on_handshake_result(inst.key, inst.ctx.attempt, True, writer.bus.now)
        rank._execute(writer.bus.now)  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per request")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument(
        "--count", action="store_true", help="calls, dispatches, instances per request"
    )
    parser.add_argument(
        "--hops", action="store_true", help="cross-module calls and modules of one request"
    )
    args = parser.parse_args()
    if args.hops:
        print(json.dumps(hops()))
    elif args.count:
        print(json.dumps(count(args.requests, args.blocks, args.reps)))
    else:
        print(json.dumps(run(args.requests, args.blocks, args.reps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
