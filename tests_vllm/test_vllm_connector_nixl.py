"""kvhandoff's connector moving KV between two real vLLM 0.33 Schedulers over real NIXL
(C-05, R-T01, R-P15): P and D each a real Scheduler in this process, each worker-role
connector in its own process building its rank from `register_kv_caches` (DRAM tensors),
the handshake through vLLM's `get_handshake_metadata` / `set_xfer_handshake_metadata`."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import vllm_harness

MODULE = "kvhandoff.integrations.vllm"
BLOCK = vllm_harness.BLOCK_SIZE
STEP_LIMIT = 4000  # engine steps: progress, not time, bounds the loop


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Engine:
    """One vLLM engine: its real Scheduler here, its worker connectors in other processes."""

    def __init__(self, model_dir: Path, kv_role: str, tp: int = 1, mode: str = "push") -> None:
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

        self.engine_id = f"{kv_role}-{uuid.uuid4().hex[:8]}"
        self.port = _free_port()
        extra = {
            "side_channel_host": "127.0.0.1",
            "side_channel_port": self.port,
            "kv_lease_duration": 5.0,  # a lease nobody heartbeats ends soon
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


def _engines(model_dir: Path, tp: int) -> Iterator[tuple[Engine, Engine]]:
    prefill = Engine(model_dir, "kv_producer", tp)
    decode = Engine(model_dir, "kv_consumer", tp)
    try:
        prefill.start()
        decode.start()
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    """P and D at TP=1, shared by this module's tests: each ends with every block free."""
    yield from _engines(tiny_model_dir, 1)


@pytest.fixture
def pair_tp2(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from _engines(tiny_model_dir, 2)


def _request(request_id: str, prompt: list[int], params: dict[str, Any], max_tokens: int) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sampling = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
    return Request(request_id, prompt, sampling, None)


def _prompt(i: int, length: int) -> list[int]:
    return [3 + (i * 101 + t) % 900 for t in range(length)]


P_LEG = {"do_remote_decode": True, "do_remote_prefill": False}


def _d_leg(prefill: Engine, tp: int = 1, engine_id: str | None = None) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine_id or prefill.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": prefill.port,
        "tp_size": tp,
    }


class Run:
    """What the D side saw while both engines stepped."""

    def __init__(self) -> None:
        self.registered: dict[str, list[int]] = {}
        self.verified: set[str] = set()
        self.failed: set[str] = set()
        self.invalid: set[int] = set()


def _run(
    prefill: Engine,
    decode: Engine,
    unverified: frozenset[str] = frozenset(),
    run: Run | None = None,
) -> Run:
    """Step both engines until both are idle; on D, check every received request's bytes
    in every rank as vLLM hears of it."""
    run = run or Run()
    for _ in range(STEP_LIMIT):
        prefill.step()
        out, kv_output = decode.step()
        push = out.kv_connector_metadata.push
        for rid, registration in push.push_registrations.items():
            run.registered[rid] = list(registration.block_ids)
        for rid, read in push.pull_reads.items():  # pull mode: the blocks D reads into
            run.registered[rid] = list(read.block_ids)
        if kv_output is not None:
            run.failed |= set(kv_output.failed_recving or ())
            run.invalid |= set(kv_output.invalid_block_ids or ())
            for rid in set(kv_output.finished_recving or ()) - set(kv_output.failed_recving):
                if rid not in unverified:
                    blocks = run.registered[rid]
                    assert all(w.verify(rid, blocks) for w in decode.workers), rid
                    run.verified.add(rid)
        if prefill.idle() and decode.idle():
            return run
        time.sleep(0.002)  # let the writer threads move bytes between engine steps
    raise AssertionError("the engines did not settle")


def _all_free(*engines: Engine) -> None:
    for engine in engines:
        assert engine.pool.get_num_free_blocks() == engine.free_at_start


def _transfer(prefill: Engine, decode: Engine, lengths: dict[str, int], tp: int = 1) -> None:
    from vllm.v1.request import RequestStatus

    d_requests = {}
    for i, (rid, length) in enumerate(lengths.items()):
        prefill.sched.add_request(_request(rid, _prompt(i, length), P_LEG, 1))
        d_requests[rid] = _request(rid, _prompt(i, length), _d_leg(prefill, tp), 2)
        decode.sched.add_request(d_requests[rid])
    run = _run(prefill, decode)
    assert run.verified == set(lengths)
    assert {rid: len(b) for rid, b in run.registered.items()} == {
        rid: -(-length // BLOCK) for rid, length in lengths.items()
    }
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in d_requests.values())
    _all_free(prefill, decode)


def test_C_05_bytes_move_between_two_vllm_schedulers_over_real_nixl(
    pair: tuple[Engine, Engine],
) -> None:
    """Several requests, one of them prefilled in chunks (longer than the step's token
    budget): P's vLLM leases each finished prefill leg, kvhandoff's P worker pushes its
    blocks into D's registered blocks over NIXL, D's vLLM runs each decode leg once every
    byte landed; both schedulers end with every block free."""
    lengths = {"cmpl-a-0": 3 * BLOCK + 5, "cmpl-b-0": 2 * BLOCK, "cmpl-c-0": 9 * BLOCK + 1}
    assert max(lengths.values()) > 256  # max_num_batched_tokens: a chunked prefill
    _transfer(*pair, lengths)


def test_R_P10_abort_on_d_mid_transfer_frees_every_block_on_both_sides(
    pair: tuple[Engine, Engine],
) -> None:
    """vLLM aborts D's request while P is still prefilling it (chunked): kvhandoff's D
    ranks drop it, vLLM frees its blocks, P's lease ends on its own; both schedulers end
    with every block free and the other request's bytes intact."""
    from vllm.v1.request import RequestStatus

    prefill, decode = pair
    lengths = {"cmpl-abort-0": 12 * BLOCK, "cmpl-keep-0": 2 * BLOCK}
    d_requests = {}
    for i, (rid, length) in enumerate(lengths.items()):
        prefill.sched.add_request(_request(rid, _prompt(10 + i, length), P_LEG, 1))
        d_requests[rid] = _request(rid, _prompt(10 + i, length), _d_leg(prefill), 2)
        decode.sched.add_request(d_requests[rid])
    prefill.step()  # P computes the first chunk only
    out, _kv_output = decode.step()
    run = Run()
    run.registered = {
        r: list(g.block_ids) for r, g in out.kv_connector_metadata.push.push_registrations.items()
    }
    assert d_requests["cmpl-abort-0"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    decode.sched.finish_requests("cmpl-abort-0", RequestStatus.FINISHED_ABORTED)
    run = _run(prefill, decode, unverified=frozenset({"cmpl-abort-0"}), run=run)
    assert run.verified == {"cmpl-keep-0"}
    assert d_requests["cmpl-abort-0"].status == RequestStatus.FINISHED_ABORTED
    assert d_requests["cmpl-keep-0"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not run.failed
    assert decode.sched.connector.scheduler.stale_reports == 0
    _all_free(prefill, decode)


def test_R_P12_failed_transfer_surfaces_as_invalid_blocks_and_finished_error(
    pair: tuple[Engine, Engine],
) -> None:
    """D's ranks cannot handshake with the P engine the decode leg names (its side
    channel serves another engine): each rank fails the receive, vLLM gets the request
    finished and failed with its blocks as load errors, and ends it FINISHED_ERROR; every
    block is free."""
    from vllm.v1.request import RequestStatus

    prefill, decode = pair
    rid = "cmpl-fail-0"
    request = _request(rid, _prompt(20, 3 * BLOCK), _d_leg(prefill, engine_id="nobody"), 2)
    decode.sched.add_request(request)
    run = _run(prefill, decode)
    assert request.status == RequestStatus.FINISHED_ERROR
    assert run.failed == {rid}
    assert run.invalid == set(run.registered[rid])
    _all_free(prefill, decode)


def test_R_T03_tp2_workers_on_both_sides_move_every_rank_share(
    pair_tp2: tuple[Engine, Engine],
) -> None:
    """TP=2 on P and D, each worker its own process and NIXL agent: every D rank holds
    its head share of every block, written by its P peer rank."""
    lengths = {"cmpl-tp-a-0": 4 * BLOCK + 3, "cmpl-tp-b-0": 9 * BLOCK}
    _transfer(*pair_tp2, lengths, tp=2)


@pytest.fixture(scope="module")
def pull_pair(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    prefill = Engine(tiny_model_dir, "kv_producer", mode="pull")
    decode = Engine(tiny_model_dir, "kv_consumer", mode="pull")
    try:
        prefill.start()
        decode.start()
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_C_02_pull_mode_reads_between_two_vllm_schedulers_over_real_nixl(
    pull_pair: tuple[Engine, Engine],
) -> None:
    """`transfer_mode: pull` (B-09): P's vLLM finishes each prefill leg and returns, from
    kvhandoff's connector, vLLM-shaped pull params (its block ids, one list per group); the
    decode leg carries them to D, whose worker READs P's blocks over NIXL; P's lease ends
    with the READ's notif. Bytes verified on D, every block free on both schedulers."""
    from vllm.v1.request import RequestStatus

    prefill, decode = pull_pair
    lengths = {"cmpl-p-0": 2 * BLOCK + 3, "cmpl-q-0": 3 * BLOCK}
    params: dict[str, dict[str, Any]] = {}
    finish = prefill.sched.connector.request_finished

    def recording(request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, leg = finish(request, block_ids)
        if leg is not None:
            params[request.request_id] = leg
        return delay, leg

    prefill.sched.connector.request_finished = recording  # what the proxy would relay
    for i, (rid, length) in enumerate(lengths.items()):
        prefill.sched.add_request(_request(rid, _prompt(i, length), P_LEG, 1))
    for _ in range(STEP_LIMIT):
        prefill.step()
        if set(params) == set(lengths):
            break
    assert set(params) == set(lengths), "P finished every prefill leg with pull params"
    assert all(leg["transfer_mode"] == "pull" for leg in params.values())
    d_requests = {
        rid: _request(rid, _prompt(i, length), params[rid], 2)
        for i, (rid, length) in enumerate(lengths.items())
    }
    for request in d_requests.values():
        decode.sched.add_request(request)
    run = _run(prefill, decode)
    assert run.verified == set(lengths)
    assert not run.failed
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in d_requests.values())
    _all_free(prefill, decode)
