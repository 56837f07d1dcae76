"""`python -m kvhandoff.bench.probes.push_writer_pass`: the host cost of P's side of a
push, per request, in one process (a probe: a stand-in transport, no NIXL, no GPU).

One P engine (`PushSide`: the real scheduler, worker rank, writer core and executors) over
a transport that knows one connected D engine and queues WRITEs the way the CUDA IPC
transport does (nothing moves, each handle is DONE once "launched"). Per rep: `requests`
`PUSH_REG`s reach the writer and are held (untimed), then P finishes every request in one
engine step and the phases are timed one after the other, single-threaded, with
`time.perf_counter`:

- `finish`: the scheduler's `request_finished` for every request;
- `stage`: the engine step that hands the blocks to the rank (`build_connector_meta`,
  `start_load_kv`);
- `writer`: the writer pass that matches and issues every WRITE;
- `report`: the engine step that takes the writer's reports, polls the WRITEs and reports
  `finished_sending`.

Prints the median of each phase in µs per request (and in total) as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvhandoff.adapters.push_side import PushSide
from kvhandoff.adapters.push_transport import EngineInfo, RankInfo, Routes, XferState
from kvhandoff.machines.push.scheduler import LocalEngine
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.handshake import EngineHandshake, HandshakePayload
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PushRegistration, encode_push_reg
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk

D_ENGINE = "bench-decode"
D_AGENT = "bench-decode-agent"


@dataclass(eq=False, slots=True)
class _Handle:
    notif: bytes
    xfer_status: XferState = "PROC"


@dataclass
class _QueueingTransport:
    """Connected to one D engine; WRITEs queue and are all DONE at the next poll."""

    capacity: int
    engine_id: str = "bench-prefill"
    agent_name: str = "bench-prefill-agent"
    inbox: list[tuple[str, bytes]] = field(default_factory=list)
    queued: list[_Handle] = field(default_factory=list)
    sent: int = 0

    def handshake_payload(self) -> HandshakePayload:
        raise LocalProtocolError("the probe serves no handshake")

    def advertise(self, extensions: Sequence[str], auth_key_id: str) -> None:
        return None

    def fetch_handshake(
        self, host: str, port: int, timeout_s: float, ranks: Sequence[tuple[int, int]]
    ) -> list[bytes]:
        raise LocalProtocolError("the probe's D is connected from the start")

    def connect(self, engine: EngineHandshake, routes: Routes) -> EngineInfo:
        raise LocalProtocolError("the probe's D is connected from the start")

    def forget(self, engine_id: str) -> None:
        return None

    def engine(self, engine_id: str) -> EngineInfo | None:
        if engine_id != D_ENGINE:
            return None
        return EngineInfo(D_ENGINE, 1, 1, frozenset(), (RankInfo(0, D_AGENT, 1, self.capacity),))

    def identify(self, agent_name: str) -> tuple[str, int] | None:
        return (D_ENGINE, 0) if agent_name == D_AGENT else None

    def send_notif(self, engine_id: str, rank: int, message: bytes) -> None:
        self.sent += 1

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

    def flush_writes(self) -> list[tuple[str, Exception]]:
        return []

    def read_blocks(
        self,
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> _Handle:
        raise LocalProtocolError("the probe runs push mode")

    def poll(self, handle: _Handle) -> XferState:
        if self.queued:
            for queued in self.queued:
                queued.xfer_status = "DONE"
            self.sent += len(self.queued)
            self.queued = []
        return handle.xfer_status

    def release(self, handle: _Handle) -> None:
        return None


def _registration(request_id: str, blocks: list[int]) -> PushRegistration:
    return PushRegistration(
        request_id=request_id,
        decode_engine_id=D_ENGINE,
        decode_host="127.0.0.1",
        decode_port=5700,
        decode_tp_size=1,
        decode_tp_rank=0,
        block_ids=tuple(blocks),
        remote_engine_id="bench-prefill",
        remote_host="127.0.0.1",
        remote_port=5600,
        remote_tp_size=1,
    )


def run(requests: int, blocks_per_request: int, reps: int) -> dict[str, float]:
    capacity = requests * blocks_per_request
    transport = _QueueingTransport(capacity)
    side = PushSide(
        "prefill",
        LocalEngine("bench-prefill", "127.0.0.1", 5600),
        transport,  # type: ignore[arg-type]
        lambda job: None,
        config=PushConfig(),
    )
    rank = side.ranks[0]
    # The remote engine is connected as after a handshake (its machine too).
    phases: dict[str, list[float]] = {"finish": [], "stage": [], "writer": [], "report": []}
    for rep in range(reps + 2):
        ids = [f"cmpl-probe{rep:04d}{q:05d}-0-abcd1234" for q in range(requests)]
        d_ids = [f"cmpl-probe{rep:04d}{q:05d}-0-ffff0000" for q in range(requests)]
        n = blocks_per_request
        p_blocks = [list(range(q * n, (q + 1) * n)) for q in range(requests)]
        d_blocks = list(reversed(p_blocks))
        transport.inbox = [
            (D_AGENT, encode_push_reg(_registration(d_id, d_blocks[q])))
            for q, d_id in enumerate(d_ids)
        ]
        rank.writer_pass()
        t0 = time.perf_counter()
        for q, rid in enumerate(ids):
            side.request_finished(rid, p_blocks[q], {"do_remote_decode": True})
        t1 = time.perf_counter()
        meta = side.build_connector_meta()
        rank.start_load_kv(meta)
        t2 = time.perf_counter()
        rank.writer_pass()
        t3 = time.perf_counter()
        _connect(rank)  # the first rep: D's remote engine connects as a handshake would
        output = side.get_finished()
        t4 = time.perf_counter()
        sent = set(output.finished_sending)
        while len(sent) < requests:  # the first step may only adopt the reports
            sent |= set(side.step().finished_sending)
        if rep >= 2:
            marks = (("finish", t0, t1), ("stage", t1, t2), ("writer", t2, t3), ("report", t3, t4))
            for name, a, b in marks:
                phases[name].append((b - a) * 1e6 / requests)
    result = {name: round(statistics.median(v), 2) for name, v in phases.items()}
    result["total"] = round(sum(result.values()), 2)
    return result


def _connect(rank: object) -> None:
    from kvhandoff.machines.push.remote_engine import REMOTE_ENGINE

    writer = rank.writer  # type: ignore[attr-defined]
    inst = writer.bus.get(REMOTE_ENGINE, D_ENGINE)
    if inst is not None and inst.has("deferring"):
        writer.on_handshake_result(D_ENGINE, inst.ctx.attempt, True, writer.bus.now)
        rank._execute(writer.bus.now)  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=16, help="blocks per request")
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    print(json.dumps(run(args.requests, args.blocks, args.reps)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
