"""Two vLLM 0.33 engines through kvhandoff's connector over real NIXL, for the tier's tests
(C-05, R-T01, R-T03): each engine a real Scheduler in the test process, each worker-role
connector in its own process (`vllm_harness.WorkerProc`), vLLM's `KVOutputAggregator`
counting the ranks. Either side may run any TP size (P's TP rides in the decode leg).

On D, every received request's bytes are checked in every rank as vLLM hears of it; the
pattern (`vllm_harness.block_values`) counts elements across the engine's ranks, so a D
rank's block must hold exactly the chunks its P writers computed, whatever the two TP sizes.
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import vllm_harness

MODULE = "kvhandoff.integrations.vllm"
BLOCK = vllm_harness.BLOCK_SIZE
STEP_LIMIT = 4000  # engine steps: progress, not time, bounds the loop


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Engine:
    """One vLLM engine: its real Scheduler here, its worker connectors in other processes."""

    def __init__(self, model_dir: Path, kv_role: str, tp: int = 1, mode: str = "push") -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.engine_id = f"{kv_role}-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.tp = tp
        extra = {
            "side_channel_host": "127.0.0.1",
            "side_channel_port": self.port,
            "kv_lease_duration": 5.0,  # a lease nobody heartbeats ends soon
            # One host, one clock: pull's READs must be done within the lease less this.
            "sealed_notif_skew": 1.0,
            "handshake_timeout": 5.0,
            "transfer_mode": mode,
        }
        config = vllm_harness.vllm_config(
            model_dir,
            kv_connector="KVHandoffConnector",
            kv_connector_module_path=MODULE,
            kv_role=kv_role,
            extra_config=extra,
            engine_id=self.engine_id,
        )
        config.parallel_config.tensor_parallel_size = tp
        self.sched = vllm_harness.scheduler(config)
        self.pool = self.sched.kv_cache_manager.block_pool
        self.free_at_start = self.pool.get_num_free_blocks()
        self.workers = [
            vllm_harness.WorkerProc(model_dir, kv_role, self.engine_id, extra, tp, rank)
            for rank in range(tp)
        ]
        self.aggregator = KVOutputAggregator(expected_finished_count=tp)

    def start(self) -> None:
        metadata = {w.tp_rank: w.ready() for w in self.workers}
        self.sched.connector.set_xfer_handshake_metadata(metadata)

    def step(self) -> tuple[Any, Any]:
        return vllm_harness.engine_step(self.sched, self.workers, self.aggregator)

    def idle(self) -> bool:
        return not self.sched.requests and not self.sched.connector.has_pending_push_work()

    def close(self) -> None:
        for worker in self.workers:
            worker.stop()
        for worker in self.workers:
            worker.join()
        self.sched.connector.shutdown()


def engines(
    model_dir: Path, p_tp: int, d_tp: int | None = None, mode: str = "push"
) -> Iterator[tuple[Engine, Engine]]:
    """P at `p_tp` and D at `d_tp` (P's by default), started, closed at the end."""
    prefill = Engine(model_dir, "kv_producer", p_tp, mode)
    try:
        decode = Engine(model_dir, "kv_consumer", p_tp if d_tp is None else d_tp, mode)
    except BaseException:
        prefill.close()
        raise
    try:
        prefill.start()
        decode.start()
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def request(request_id: str, prompt: list[int], params: dict[str, Any], max_tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
    return Request(request_id, prompt, sampling, None)


def prompt(i: int, length: int) -> list[int]:
    return [3 + (i * 101 + t) % 900 for t in range(length)]


P_LEG = {"do_remote_decode": True, "do_remote_prefill": False}


def d_leg(prefill: Engine, engine_id: str | None = None) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id or prefill.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": prefill.port,
        "tp_size": prefill.tp,
    }


class Run:
    """What the D side saw while both engines stepped."""

    def __init__(self) -> None:
        self.registered: dict[str, list[int]] = {}
        self.verified: set[str] = set()
        self.failed: set[str] = set()
        self.invalid: set[int] = set()


def run(
    prefill: Engine,
    decode: Engine,
    unverified: frozenset[str] = frozenset(),
    seen: Run | None = None,
) -> Run:
    """Step both engines until both are idle; on D, check every received request's bytes
    in every rank as vLLM hears of it."""
    seen = seen or Run()
    for _ in range(STEP_LIMIT):
        prefill.step()
        out, kv_output = decode.step()
        push = out.kv_connector_metadata.push
        for rid, registration in push.push_registrations.items():
            seen.registered[rid] = list(registration.block_ids)
        for rid, read in push.pull_reads.items():  # pull mode: the blocks D reads into
            seen.registered[rid] = list(read.block_ids)
        if kv_output is not None:
            seen.failed |= set(kv_output.failed_recving or ())
            seen.invalid |= set(kv_output.invalid_block_ids or ())
            for rid in set(kv_output.finished_recving or ()) - set(kv_output.failed_recving):
                if rid not in unverified:
                    blocks = seen.registered[rid]
                    assert all(w.verify(rid, blocks) for w in decode.workers), rid
                    seen.verified.add(rid)
        if prefill.idle() and decode.idle():
            return seen
        time.sleep(0.002)  # let the writer threads move bytes between engine steps
    raise AssertionError("the engines did not settle")


def all_free(*engines: Engine) -> None:
    for engine in engines:
        assert engine.pool.get_num_free_blocks() == engine.free_at_start


def transfer(prefill: Engine, decode: Engine, lengths: dict[str, int]) -> Run:
    """Push `lengths` (request id -> prompt tokens) from P to D: every request's bytes
    verified in every D rank, D's registrations one per block, every block free."""
    from vllm.v1.request import RequestStatus

    d_requests = {}
    for i, (rid, length) in enumerate(lengths.items()):
        prefill.sched.add_request(request(rid, prompt(i, length), P_LEG, 1))
        d_requests[rid] = request(rid, prompt(i, length), d_leg(prefill), 2)
        decode.sched.add_request(d_requests[rid])
    seen = run(prefill, decode)
    assert seen.verified == set(lengths)
    assert not seen.failed
    assert {rid: len(b) for rid, b in seen.registered.items()} == {
        rid: -(-length // BLOCK) for rid, length in lengths.items()
    }
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in d_requests.values())
    all_free(prefill, decode)
    return seen


def pull_transfer(prefill: Engine, decode: Engine, lengths: dict[str, int]) -> Run:
    """`transfer_mode: pull` (B-09): P's vLLM finishes each prefill leg and returns, from
    kvhandoff's connector, vLLM-shaped pull params; the decode leg carries them to D, whose
    ranks READ P's blocks over NIXL. Bytes verified in every D rank, every block free."""
    from vllm.v1.request import RequestStatus

    params: dict[str, dict[str, Any]] = {}
    finish = prefill.sched.connector.request_finished

    def recording(req: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, leg = finish(req, block_ids)
        if leg is not None:
            params[req.request_id] = leg
        return delay, leg

    prefill.sched.connector.request_finished = recording  # what the proxy would relay
    try:
        for i, (rid, length) in enumerate(lengths.items()):
            prefill.sched.add_request(request(rid, prompt(i, length), P_LEG, 1))
        for _ in range(STEP_LIMIT):
            prefill.step()
            if set(params) == set(lengths):
                break
    finally:
        prefill.sched.connector.request_finished = finish
    assert set(params) == set(lengths), "P finished every prefill leg with pull params"
    assert all(leg["transfer_mode"] == "pull" for leg in params.values())
    d_requests = {
        rid: request(rid, prompt(i, length), params[rid], 2)
        for i, (rid, length) in enumerate(lengths.items())
    }
    for d_request in d_requests.values():
        decode.sched.add_request(d_request)
    seen = run(prefill, decode)
    assert seen.verified == set(lengths)
    assert not seen.failed
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in d_requests.values())
    all_free(prefill, decode)
    return seen
