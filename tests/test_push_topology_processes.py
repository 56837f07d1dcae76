"""Push on the engine's real topology (issue 14): per engine, the scheduler and two worker
ranks each in its own OS process, over real NIXL and ZMQ (R-T01..R-T04, S-05).

Six processes: P's scheduler and two ranks, D's scheduler and two ranks
(`helpers/push_proc.py`). Each rank has its own NIXL agent, KV memory, writer thread and
handshake executor; each scheduler serves its engine's handshake (every rank's payload)
on its side channel. The test process is the engines' step loops: it relays only the
msgspec records an engine passes between its processes (the scheduler's
`PushConnectorMeta` to every rank, each rank's `PushWorkerOutput` back), as hex lines.

Topologies: P TP 2 -> D TP 2 (with and without the cluster key, which seals every
control notif between the processes, S-05), and a pipeline-parallel producer, P TP 1 x
PP 2 -> D TP 2: each stage holds half the layers and registers as its own rank, D's
`PUSH_REG` goes to both stages, each stage WRITEs one half of its heads into each D rank
(R-T03, R-T04). P TP 2 -> D TP 1: both P ranks WRITE their heads into halves of D's one
rank's blocks. Every head chunk of every layer of every block carries its own pattern,
so D rank r must hold exactly the heads vLLM's rank mapping sends it, from every stage;
D reports a request only after both of its ranks received it from every writer (R-T02).

Pull mode (B-09) on the same processes: P's scheduler returns the pull params, D's ranks
each READ from the P ranks whose heads they hold (TP 2 -> 2: one READ each; TP 1 -> 2:
each D rank reads its half of P's blocks; TP 2 -> 1: D's rank reads both P ranks into
halves of its blocks), and each P rank frees its lease once every D rank reading from it
sent its completion notif.
"""

from __future__ import annotations

import importlib.util
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest

from kvhandoff.machines.push.meta import PushConnectorOutput
from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg

pytestmark = pytest.mark.integration

HELPERS = Path(__file__).resolve().parent / "helpers"
REQUESTS = 6
DEADLINE_S = 60.0


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvh_helpers_{name}", HELPERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child_mod = _load("child")


class Engine:
    """One engine: a scheduler process and `TP` rank processes, stepped by the test."""

    def __init__(self, role: str, engine_id: str, config: dict[str, Any], tmp: Path) -> None:
        self.role = role
        self.engine_id = engine_id
        self.tp, self.pp = int(config.get("tp_size", 1)), int(config.get("pp_size", 1))
        raw = json.dumps(config, separators=(",", ":"))
        self.children: list[Any] = []

        def spawn(*args: str) -> Any:
            err = tmp / f"{engine_id}-{args[0]}{len(self.children)}-{uuid.uuid4().hex[:6]}.err"
            child = child_mod.Child("push_proc.py", *args, stderr_path=err)
            self.children.append(child)
            return child

        world = int(config.get("tp_size", 1)) * int(config.get("pp_size", 1))
        self.ranks = [spawn("rank", role, engine_id, str(r), raw) for r in range(world)]
        self.scheduler = spawn("scheduler", role, engine_id, raw)
        payloads = []
        for rank in self.ranks:
            ready = rank.expect(120.0)
            assert ready.startswith("READY "), rank.stderr()
            payloads.append(ready.split(" ", 1)[1])
        assert self.scheduler.expect(60.0) == "READY", self.scheduler.stderr()
        self.port = int(self.scheduler.request("SERVE " + ",".join(payloads), 60.0))

    def command(self, line: str) -> None:
        assert self.scheduler.request(line, 30.0) == "OK", self.scheduler.stderr()

    def finish(self, request_id: str, blocks: str) -> dict[str, Any]:
        """P's `request_finished`: the params it returned for the decode leg."""
        answer = self.scheduler.request(
            f'FINISHED {request_id} {blocks} {{"do_remote_decode":true}}', 30.0
        )
        assert answer.startswith("OK "), (answer, self.scheduler.stderr())
        params: dict[str, Any] = json.loads(answer[3:])
        return params

    def step(self) -> PushConnectorOutput:
        """build_connector_meta -> every rank's step -> update_connector_output."""
        meta = self.scheduler.request("META", 30.0)
        assert not meta.startswith("ERROR"), meta
        for rank in self.ranks:
            rank.send("STEP " + meta)
        outputs = [rank.expect(60.0) for rank in self.ranks]
        raw = self.scheduler.request("OUTPUTS " + ",".join(outputs), 30.0)
        return msgspec.msgpack.decode(bytes.fromhex(raw), type=PushConnectorOutput)

    def on_ranks(self, line: str) -> list[str]:
        return [rank.request(line, 60.0) for rank in self.ranks]

    def stats(self) -> list[dict[str, Any]]:
        return [json.loads(answer) for answer in self.on_ranks("STATS")]

    def logs(self) -> list[str]:
        """What each process logged (for a failure message)."""
        return [child.stderr()[-1500:] for child in self.children]

    def pending(self) -> bool:
        return bool(self.scheduler.request("PENDING", 30.0) == "1")

    def close(self) -> None:
        for child in self.children:
            child.close()


@pytest.fixture
def engines(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Engine, Engine]]:
    """P TP x PP and D TP, with or without the cluster key, in push or pull mode."""
    (p_tp, p_pp, d_tp), keyed, mode = request.param
    common: dict[str, Any] = {"heartbeat_interval": 0.5, "mode": mode}
    if keyed:
        common["cluster_key"] = "topology-test-cluster-key-0123"
    p_config = {**common, "tp_size": p_tp, "pp_size": p_pp, "peer_tp": d_tp}
    d_config = {**common, "tp_size": d_tp, "peer_tp": p_tp}
    made: list[Engine] = []
    try:
        tag = uuid.uuid4().hex[:6]
        made.append(Engine("prefill", f"prefill-{tag}", p_config, tmp_path))
        made.append(Engine("decode", f"decode-{tag}", d_config, tmp_path))
        yield made[0], made[1]
    finally:
        for engine in made:
            engine.close()


TOPOLOGIES = [
    pytest.param(((2, 1, 2), False, "push"), id="P-tp2-D-tp2"),
    pytest.param(((2, 1, 2), True, "push"), id="P-tp2-D-tp2-keyed"),
    pytest.param(((1, 2, 2), False, "push"), id="P-pp2-D-tp2"),
    pytest.param(((2, 1, 1), False, "push"), id="P-tp2-D-tp1"),
]
PULL_TOPOLOGIES = [
    pytest.param(((2, 1, 2), True, "pull"), id="pull-P-tp2-D-tp2-keyed"),
    pytest.param(((1, 1, 2), False, "pull"), id="pull-P-tp1-D-tp2"),
    pytest.param(((2, 1, 1), False, "pull"), id="pull-P-tp2-D-tp1"),
]


class Run:
    """One test's requests across P and D: what each engine reported, each id once, and
    the requests made (D id -> (client, D's block ids); P id -> P's block ids)."""

    def __init__(self, p: Engine, d: Engine) -> None:
        self.p, self.d = p, d
        self.received: set[str] = set()
        self.failed: dict[str, str] = {}
        self.sent: set[str] = set()
        self.blocks: dict[str, tuple[str, str]] = {}
        self.p_ids: dict[str, str] = {}

    def request(self, tag: str, i: int) -> tuple[str, str, str, str]:
        """Request `i`: P's KV filled, D's blocks cleared; (D id, P id, D's, P's blocks)."""
        client = f"cmpl-{tag}{i:02d}-0"
        n = 1 + i % 4
        p_blocks = ",".join(str(10 * i + k) for k in range(n))
        d_blocks = ",".join(str(100 + 10 * i + k) for k in range(n))
        assert self.p.on_ranks(f"FILL {client} {p_blocks}") == ["OK"] * len(self.p.ranks)
        assert self.d.on_ranks(f"CLEAR {d_blocks}") == ["OK"] * len(self.d.ranks)
        d_id, p_id = f"{client}-dddd{i:04d}", f"{client}-aaaa{i:04d}"
        self.blocks[d_id] = (client, d_blocks)
        self.p_ids[p_id] = p_blocks
        return d_id, p_id, d_blocks, p_blocks

    def take(self, engine: Engine) -> None:
        out = engine.step()
        assert not self.received & out.finished_recving, "a receive is reported once"
        assert not self.sent & out.finished_sending, "a lease is freed once"
        self.received.update(out.finished_recving)
        self.failed.update(out.failed_recving)
        self.sent.update(out.finished_sending)

    def drive(self) -> None:
        """Step both engines until every request was received and every lease freed, then
        check D's bytes rank by rank and that nothing is left on either side."""
        p, d = self.p, self.d
        deadline = time.monotonic() + DEADLINE_S
        while len(self.received) + len(self.failed) < len(self.blocks) or len(self.sent) < len(
            self.p_ids
        ):
            assert time.monotonic() < deadline, (
                self.received,
                self.failed,
                self.sent,
                p.logs(),
                d.logs(),
            )
            self.take(d)
            self.take(p)
            time.sleep(0.002)  # yield the two cores to the six processes between steps

        assert self.failed == {}, self.failed
        assert self.received == set(self.blocks) and self.sent == set(self.p_ids)
        for client, d_blocks in self.blocks.values():
            assert d.on_ranks(f"VERIFY {client} {d_blocks}") == ["OK"] * len(d.ranks), client
        for engine in (p, d):
            assert not engine.pending()
            for stats in engine.stats():
                assert stats["writer_alive"] and stats["writer_errors"] == 0, stats
                assert stats["failed_transfers"] == 0 and stats["live"] == 0, stats
                if engine is d:  # (P may refuse a heartbeat for a lease it already freed)
                    assert stats["rejected_notifs"] == 0, stats


@pytest.mark.parametrize("engines", TOPOLOGIES, indirect=True)
def test_R_T01_R_T02_R_T03_R_T04_S_05_scheduler_and_two_ranks_per_engine_in_six_processes(
    engines: tuple[Engine, Engine],
) -> None:
    p, d = engines
    coords = PrefillCoordinates(p.engine_id, "127.0.0.1", p.port, p.tp, p.pp)
    params = json.dumps(decode_leg({}, coords)["kv_transfer_params"], separators=(",", ":"))
    run = Run(p, d)
    for i in range(REQUESTS):
        d_id, p_id, d_blocks, p_blocks = run.request("topo", i)
        # Half the requests reach D first (PUSH_REG waits on P), half reach P first.
        order = (d, p) if i % 2 == 0 else (p, d)
        for engine in order:
            if engine is d:
                d.command(f"ALLOC {d_id} {d_blocks} {params}")
            else:
                p.finish(p_id, p_blocks)
            run.take(engine)
    run.drive()


@pytest.mark.parametrize("engines", PULL_TOPOLOGIES, indirect=True)
def test_B09_R_T01_R_T02_R_T03_pull_with_two_ranks_on_a_side_in_separate_processes(
    engines: tuple[Engine, Engine],
) -> None:
    p, d = engines
    run = Run(p, d)
    for i in range(REQUESTS):
        d_id, p_id, d_blocks, p_blocks = run.request("pull", i)
        params = p.finish(p_id, p_blocks)  # P first: its answer is D's leg (the proxy's relay)
        assert params["transfer_mode"] == "pull" and params["remote_request_id"] == p_id
        assert params["tp_size"] == p.tp, params
        run.take(p)
        d.command(f"ALLOC {d_id} {d_blocks} {json.dumps(params, separators=(',', ':'))}")
        run.take(d)
    run.drive()
