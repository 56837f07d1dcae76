"""kvhandoff's push connector inside vLLM 0.33's real Scheduler (C-05, R-T01): vLLM loads
it by module path for both roles, drives D's request through its hooks into
WAITING_FOR_REMOTE_KVS, and the per-step metadata it gets back is a msgspec payload that
survives a msgpack round trip; the worker half takes it in another process."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvhandoff.machines.push.d_request import D_REQUEST
from kvhandoff.machines.push.meta import PushConnectorMeta
from kvhandoff.machines.push.p_request import P_REQUEST

import vllm_harness

_one_token = vllm_harness.one_token
_worker_step = vllm_harness.worker_step

MODULE = "kvhandoff.integrations.vllm"
P_ENGINE = {
    "remote_engine_id": "prefill-0",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,  # vLLM's name for P's TP size
}


def _scheduler(model_dir: Path, kv_role: str, failure_policy: str = "fail") -> Any:
    config = vllm_harness.vllm_config(
        model_dir,
        kv_connector="KVHandoffConnector",
        kv_connector_module_path=MODULE,
        kv_role=kv_role,
        extra_config={"side_channel_host": "127.0.0.1", "side_channel_port": 5700},
        kv_load_failure_policy=failure_policy,
    )
    return vllm_harness.scheduler(config)


def _request(
    request_id: str, prompt_len: int, params: dict[str, Any] | None, max_tokens: int = 4
) -> Any:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=max_tokens, extra_args=extra)
    return Request(request_id, list(range(3, 3 + prompt_len)), sampling, None)


def _decode_leg() -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, **P_ENGINE}


@pytest.mark.parametrize(
    ("kv_role", "side"), [("kv_producer", "prefill"), ("kv_consumer", "decode")]
)
def test_C_05_vllm_loads_kvhandoff_connector_for_both_roles(
    tiny_model_dir: Path, kv_role: str, side: str
) -> None:
    from kvhandoff.integrations.vllm import KVHandoffConnector

    sched = _scheduler(tiny_model_dir, kv_role)
    connector = sched.connector
    assert isinstance(connector, KVHandoffConnector)
    assert connector.scheduler is not None and connector.scheduler.role == side
    assert connector.rank is None  # the scheduler role owns no worker state


def test_C_05_decode_request_waits_for_remote_kvs_and_registers(tiny_model_dir: Path) -> None:
    from vllm.v1.request import RequestStatus

    from kvhandoff.integrations.vllm import KVHandoffConnectorMetadata

    sched = _scheduler(tiny_model_dir, "kv_consumer")
    request = _request("cmpl-d-1", 3 * vllm_harness.BLOCK_SIZE, _decode_leg())
    sched.add_request(request)
    output = sched.schedule()

    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = output.kv_connector_metadata
    assert isinstance(meta, KVHandoffConnectorMetadata)
    registration = meta.push.push_registrations["cmpl-d-1"]
    assert len(registration.block_ids) == 3
    assert registration.remote_engine_id == "prefill-0"
    assert registration.remote_tp_size == 1  # read from vLLM's `tp_size`
    assert registration.decode_port == 5700
    assert sched.connector.has_pending_push_work()


def test_R_T01_connector_metadata_survives_a_msgpack_round_trip(tiny_model_dir: Path) -> None:
    """The scheduler and worker halves share nothing: the payload is bytes in between."""
    sched = _scheduler(tiny_model_dir, "kv_consumer")
    sched.add_request(_request("cmpl-d-2", 2 * vllm_harness.BLOCK_SIZE, _decode_leg()))
    meta = sched.schedule().kv_connector_metadata.push
    wire = msgspec.msgpack.encode(meta)
    again = msgspec.msgpack.decode(wire, type=PushConnectorMeta)
    assert again == meta
    assert set(again.push_registrations) == {"cmpl-d-2"}


@pytest.mark.parametrize("kv_role", ["kv_producer", "kv_consumer"])
def test_C_05_request_without_transfer_params_creates_no_state(
    tiny_model_dir: Path, kv_role: str
) -> None:
    from vllm.v1.request import RequestStatus

    sched = _scheduler(tiny_model_dir, kv_role)
    request = _request("cmpl-plain", vllm_harness.BLOCK_SIZE, None)
    sched.add_request(request)
    output = sched.schedule()

    assert request.status == RequestStatus.RUNNING
    push = output.kv_connector_metadata.push
    assert push.push_registrations == {} and push.push_finished_blocks == {}
    bus = sched.connector.scheduler.bus
    assert bus.counters(D_REQUEST).created == 0 and bus.counters(P_REQUEST).created == 0
    assert not sched.connector.has_pending_push_work()


def _worker_side(model_dir: str, wire: bytes, queue: Any) -> None:
    """A worker-role connector in its own process: it knows only the metadata's bytes."""
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffConnectorMetadata

    config = vllm_harness.vllm_config(
        Path(model_dir),
        kv_connector="KVHandoffConnector",
        kv_connector_module_path=MODULE,
        kv_role="kv_consumer",
    )
    worker = KVHandoffConnector(config, KVConnectorRole.WORKER, vllm_harness.kv_cache_config())
    push = msgspec.msgpack.decode(wire, type=PushConnectorMeta)
    worker.bind_connector_metadata(KVHandoffConnectorMetadata(push))
    worker.start_load_kv(None)
    seen = worker._get_connector_metadata().push
    worker.clear_connector_metadata()
    queue.put(
        (
            worker.scheduler is None,
            sorted(seen.push_registrations),
            [list(r.block_ids) for r in seen.push_registrations.values()],
            worker.get_finished(set()),
        )
    )


def test_R_T01_worker_role_in_another_process_receives_the_metadata(
    tiny_model_dir: Path,
) -> None:
    sched = _scheduler(tiny_model_dir, "kv_consumer")
    sched.add_request(_request("cmpl-d-3", 2 * vllm_harness.BLOCK_SIZE, _decode_leg()))
    meta = sched.schedule().kv_connector_metadata.push
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(
        target=_worker_side, args=(str(tiny_model_dir), msgspec.msgpack.encode(meta), queue)
    )
    child.start()
    result = queue.get(timeout=240)
    child.join(timeout=60)
    assert child.exitcode == 0
    no_scheduler, request_ids, blocks, finished = result
    assert no_scheduler
    assert request_ids == ["cmpl-d-3"]
    assert blocks == [list(meta.push_registrations["cmpl-d-3"].block_ids)]
    assert finished == (None, None)  # no rank transport attached in this slice


def test_C_05_prefill_leg_is_leased_on_finish_then_freed_on_finished_sending(
    tiny_model_dir: Path,
) -> None:
    """P: vLLM's real Scheduler keeps a finished prefill leg's blocks (request_finished says
    delay), the next step's metadata hands them to the ranks, and the ranks' report of the
    send (one PushWorkerOutput per rank, carried in the worker metadata) lets vLLM free them."""
    from vllm.v1.outputs import KVConnectorOutput

    from kvhandoff.integrations.vllm import KVHandoffWorkerMetadata
    from kvhandoff.machines.push.meta import PushWorkerOutput

    sched = _scheduler(tiny_model_dir, "kv_producer")
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    request = _request("cmpl-p-1", 2 * vllm_harness.BLOCK_SIZE, params, max_tokens=1)
    sched.add_request(request)
    first = sched.schedule()
    sched.update_from_output(first, _one_token(first, ["cmpl-p-1"]))

    assert request.is_finished()
    assert sched.connector.has_pending_push_work()
    second = sched.schedule()
    blocks = second.kv_connector_metadata.push.push_finished_blocks["cmpl-p-1"]
    assert len(blocks) == 2
    assert pool.get_num_free_blocks() < free_before  # leased, not freed

    report = PushWorkerOutput(
        rank=0, step=second.kv_connector_metadata.push.step, finished_sending=("cmpl-p-1",)
    )
    kv_output = KVConnectorOutput(
        finished_sending={"cmpl-p-1"},
        kv_connector_worker_meta=KVHandoffWorkerMetadata([report]),
    )
    sched.update_from_output(second, _one_token(second, [], kv_output))
    assert not sched.connector.has_pending_push_work()
    assert pool.get_num_free_blocks() == free_before


def test_R_T02_decode_leg_runs_once_every_rank_reported_the_receive(tiny_model_dir: Path) -> None:
    """D: the rank's report (worker metadata) ends kvhandoff's request, vLLM's
    finished_recving moves it out of WAITING_FOR_REMOTE_KVS; vLLM's second
    update_state_after_alloc (0 external tokens) creates nothing."""
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import RequestStatus

    from kvhandoff.integrations.vllm import KVHandoffWorkerMetadata
    from kvhandoff.machines.push.meta import PushWorkerOutput

    sched = _scheduler(tiny_model_dir, "kv_consumer")
    request = _request("cmpl-d-4", 2 * vllm_harness.BLOCK_SIZE, _decode_leg())
    sched.add_request(request)
    first = sched.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    step = first.kv_connector_metadata.push.step
    report = PushWorkerOutput(rank=0, step=step, posted=("cmpl-d-4",))
    done = PushWorkerOutput(rank=0, step=step + 1, finished_recving=("cmpl-d-4",))
    sched.update_from_output(
        first,
        _one_token(
            first, [], KVConnectorOutput(kv_connector_worker_meta=KVHandoffWorkerMetadata([report]))
        ),
    )
    second = sched.schedule()
    kv_output = KVConnectorOutput(
        finished_recving={"cmpl-d-4"}, kv_connector_worker_meta=KVHandoffWorkerMetadata([done])
    )
    sched.update_from_output(second, _one_token(second, [], kv_output))
    assert not sched.connector.has_pending_push_work()
    third = sched.schedule()
    assert request.status == RequestStatus.RUNNING
    assert third.kv_connector_metadata.push.push_registrations == {}
    assert sched.connector.scheduler.bus.counters(D_REQUEST).created == 1


def _worker(model_dir: Path) -> tuple[Any, vllm_harness.StubRank]:
    """A worker-role connector in this process, its rank a scripted stub."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.integrations.vllm import KVHandoffConnector

    config = vllm_harness.vllm_config(
        model_dir,
        kv_connector="KVHandoffConnector",
        kv_connector_module_path=MODULE,
        kv_role="kv_consumer",
    )
    worker = KVHandoffConnector(config, KVConnectorRole.WORKER, vllm_harness.kv_cache_config())
    rank = vllm_harness.StubRank()
    worker.rank = rank
    return worker, rank


def test_R_P10_abort_on_d_while_waiting_ends_the_request_and_frees_every_block(
    tiny_model_dir: Path,
) -> None:
    """vLLM aborts a D request in WAITING_FOR_REMOTE_KVS: the connector aborts it in
    kvhandoff, the next metadata tells the ranks to drop it, and once every rank dropped it
    the scheduler half passes it to vLLM as a finished receive (vLLM held the blocks until
    then): every block is free; a late report for the request afterwards is stale in
    kvhandoff's scheduler and never reaches vLLM, which would assert on it (R-T02)."""
    from vllm.v1.request import RequestStatus

    from kvhandoff.machines.push.meta import PushWorkerOutput

    sched = _scheduler(tiny_model_dir, "kv_consumer")
    worker, rank = _worker(tiny_model_dir)
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    request = _request("cmpl-d-abort", 2 * vllm_harness.BLOCK_SIZE, _decode_leg())
    sched.add_request(request)
    first = sched.schedule()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    posted = PushWorkerOutput(rank=0, step=first.kv_connector_metadata.push.step)
    kv_output = _worker_step(worker, rank, first, posted)
    sched.update_from_output(first, _one_token(first, [], kv_output))

    sched.finish_requests("cmpl-d-abort", RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert "cmpl-d-abort" in sched.requests  # vLLM holds the blocks until the ranks let go
    assert pool.get_num_free_blocks() < free_before

    second = sched.schedule()
    step = second.kv_connector_metadata.push.step
    assert second.kv_connector_metadata.push.ended == ("cmpl-d-abort",)
    dropped = PushWorkerOutput(rank=0, step=step, ended=("cmpl-d-abort",))
    kv_output = _worker_step(worker, rank, second, dropped)
    assert not kv_output.finished_recving  # the scheduler half tells vLLM (R-T02)
    sched.update_from_output(second, _one_token(second, [], kv_output))
    assert "cmpl-d-abort" not in sched.requests
    assert pool.get_num_free_blocks() == free_before
    assert not sched.connector.has_pending_push_work()

    # A rank that finished the receive before it heard of the abort reports it late.
    third = sched.schedule()
    late = PushWorkerOutput(
        rank=0, step=third.kv_connector_metadata.push.step, finished_recving=("cmpl-d-abort",)
    )
    late_output = _worker_step(worker, rank, third, late)
    assert late_output.finished_recving == {"cmpl-d-abort"}
    sched.update_from_output(third, _one_token(third, [], late_output))  # vLLM does not assert
    assert sched.connector.scheduler.stale_reports == 1
    assert pool.get_num_free_blocks() == free_before
    assert not sched.requests


def test_R_P12_failed_receive_ends_the_request_with_finished_error_and_frees_every_block(
    tiny_model_dir: Path,
) -> None:
    """A rank reports a failed receive: the worker-role connector reports the request as
    finished and failed, with its blocks as load errors, in the same step; under vLLM's
    default `kv_load_failure_policy="fail"` the Scheduler ends it FINISHED_ERROR (before it
    hands the connector the ranks' outputs, so kvhandoff takes its abort path) and, the
    rank having let go of it, the scheduler half releases it in that same step: every
    block is free, and nothing is left for the ranks to drop."""
    from vllm.v1.request import RequestStatus

    from kvhandoff.machines.push.meta import PushWorkerOutput

    sched = _scheduler(tiny_model_dir, "kv_consumer")
    assert sched.vllm_config.kv_transfer_config.kv_load_failure_policy == "fail"
    worker, rank = _worker(tiny_model_dir)
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    request = _request("cmpl-d-fail", 2 * vllm_harness.BLOCK_SIZE, _decode_leg())
    sched.add_request(request)
    first = sched.schedule()
    blocks = set(first.kv_connector_metadata.push.push_registrations["cmpl-d-fail"].block_ids)
    failed = PushWorkerOutput(
        rank=0,
        step=first.kv_connector_metadata.push.step,
        failed_recving={"cmpl-d-fail": "transfer_error"},
        invalid_block_ids=tuple(sorted(blocks)),  # what a rank reports with a failure
    )
    kv_output = _worker_step(worker, rank, first, failed)
    assert kv_output.finished_recving == {"cmpl-d-fail"}
    assert kv_output.failed_recving == {"cmpl-d-fail"}
    assert kv_output.invalid_block_ids == blocks
    engine_outputs = sched.update_from_output(first, _one_token(first, [], kv_output))

    assert request.status == RequestStatus.FINISHED_ERROR
    finished = [o for outs in engine_outputs.values() for o in outs.outputs]
    assert [o.request_id for o in finished] == ["cmpl-d-fail"]
    assert "cmpl-d-fail" not in sched.requests
    assert pool.get_num_free_blocks() == free_before

    assert not sched.connector.has_pending_push_work()
    second = sched.schedule()
    assert second.kv_connector_metadata.push.ended == ()
    idle = PushWorkerOutput(rank=0, step=second.kv_connector_metadata.push.step)
    sched.update_from_output(
        second, _one_token(second, [], _worker_step(worker, rank, second, idle))
    )
    assert sched.connector.scheduler.stale_reports == 0
    assert pool.get_num_free_blocks() == free_before


def test_R_P12_failed_receive_is_recomputed_under_the_recompute_policy(
    tiny_model_dir: Path,
) -> None:
    """Under `kv_load_failure_policy="recompute"` the same failed receive sends the request
    back to WAITING with nothing computed: vLLM prefills it locally (the connector does not
    ask P again), it runs to the end, and every block is free."""
    from vllm.v1.request import RequestStatus

    from kvhandoff.machines.push.d_request import D_REQUEST
    from kvhandoff.machines.push.meta import PushWorkerOutput

    prompt_len = 2 * vllm_harness.BLOCK_SIZE
    sched = _scheduler(tiny_model_dir, "kv_consumer", failure_policy="recompute")
    worker, rank = _worker(tiny_model_dir)
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    request = _request("cmpl-d-redo", prompt_len, _decode_leg(), max_tokens=1)
    sched.add_request(request)
    first = sched.schedule()
    failed = PushWorkerOutput(
        rank=0,
        step=first.kv_connector_metadata.push.step,
        failed_recving={"cmpl-d-redo": "transfer_error"},
    )
    kv_output = _worker_step(worker, rank, first, failed)
    sched.update_from_output(first, _one_token(first, [], kv_output))
    assert not request.is_finished()
    assert not sched.connector.has_pending_push_work()  # kvhandoff ended it: failed

    second = sched.schedule()
    assert request.status == RequestStatus.RUNNING
    assert second.num_scheduled_tokens["cmpl-d-redo"] == prompt_len  # a local prefill
    assert second.kv_connector_metadata.push.push_registrations == {}
    sched.update_from_output(second, _one_token(second, ["cmpl-d-redo"]))
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert sched.connector.scheduler.bus.counters(D_REQUEST).created == 1
    assert not sched.requests
    assert pool.get_num_free_blocks() == free_before


def test_B_14_failure_counts_by_cause_reach_vllm_scheduler_stats(tiny_model_dir: Path) -> None:
    """The ranks' failures by cause, summed by kvhandoff's scheduler, come back through
    `get_kv_connector_stats` into vLLM's SchedulerStats, once per interval; a late report
    kvhandoff's scheduler finds stale is counted too."""
    from kvhandoff.machines.push.meta import FAILURE_CAUSES, PushWorkerOutput

    sched = _scheduler(tiny_model_dir, "kv_consumer")
    worker, rank = _worker(tiny_model_dir)
    sched.add_request(_request("cmpl-d-stats", vllm_harness.BLOCK_SIZE, _decode_leg()))
    first = sched.schedule()
    failed = PushWorkerOutput(
        rank=0,
        step=first.kv_connector_metadata.push.step,
        failed_recving={"cmpl-d-stats": "transfer_error"},
        failures={"transfer_error": 1, "handshake": 2},
    )
    kv_output = _worker_step(worker, rank, first, failed)
    outputs = sched.update_from_output(first, _one_token(first, [], kv_output))
    stats = next(iter(outputs.values())).scheduler_stats.kv_connector_stats
    assert set(FAILURE_CAUSES) <= set(stats)
    assert stats["transfer_error"] == 1 and stats["handshake"] == 2
    assert stats["timeout"] == 0 and stats["peer_gone"] == 0 and stats["stale_reports"] == 0

    second = sched.schedule()
    late = PushWorkerOutput(
        rank=0,
        step=second.kv_connector_metadata.push.step,
        finished_recving=("cmpl-d-stats",),
        failures={"timeout": 1},
    )
    kv_output = _worker_step(worker, rank, second, late)
    outputs = sched.update_from_output(second, _one_token(second, [], kv_output))
    stats = next(iter(outputs.values())).scheduler_stats.kv_connector_stats
    assert stats["transfer_error"] == 0 and stats["handshake"] == 0  # this interval only
    assert stats["timeout"] == 1 and stats["stale_reports"] == 1
    # vLLM took that interval: nothing moved since, so there is nothing to report.
    assert sched.connector.get_kv_connector_stats() is None


def test_R_P10_watchdog_ended_request_waits_for_vllm_abort_then_frees_every_block(
    tiny_model_dir: Path,
) -> None:
    """kvhandoff's watchdog drops a registration P never served: the ranks drop it, and
    vLLM's request keeps waiting (R-P10) until vLLM aborts it; then the connector passes
    it to vLLM at the next output (no rank holds it any more) and every block is free."""
    from vllm.v1.request import RequestStatus

    from kvhandoff.machines.push.meta import PushWorkerOutput

    sched = _scheduler(tiny_model_dir, "kv_consumer")
    worker, rank = _worker(tiny_model_dir)
    pool = sched.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    request = _request("cmpl-d-late", vllm_harness.BLOCK_SIZE, _decode_leg())
    sched.add_request(request)
    first = sched.schedule()
    kv_output = _worker_step(
        worker, rank, first, PushWorkerOutput(rank=0, step=first.kv_connector_metadata.push.step)
    )
    sched.update_from_output(first, _one_token(first, [], kv_output))

    # A virtual clock far past the watchdog: no waiting in the test.
    later = sched.connector.clock() + 2 * sched.connector.config.registration_timeout
    sched.connector.clock = lambda: later
    second = sched.schedule()
    assert second.kv_connector_metadata.push.ended == ("cmpl-d-late",)
    dropped = PushWorkerOutput(
        rank=0, step=second.kv_connector_metadata.push.step, ended=("cmpl-d-late",)
    )
    sched.update_from_output(
        second, _one_token(second, [], _worker_step(worker, rank, second, dropped))
    )
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS  # still waiting (R-P10)
    assert not sched.connector.has_pending_push_work()

    sched.finish_requests("cmpl-d-late", RequestStatus.FINISHED_ABORTED)
    assert "cmpl-d-late" in sched.requests
    third = sched.schedule()
    idle = PushWorkerOutput(rank=0, step=third.kv_connector_metadata.push.step)
    kv_output = _worker_step(worker, rank, third, idle)
    sched.update_from_output(third, _one_token(third, [], kv_output))
    assert not sched.requests
    assert pool.get_num_free_blocks() == free_before


def _holds(value: Any, needle: str, depth: int = 0) -> bool:
    """Whether `value` holds the string `needle` (in containers and msgspec Structs, a
    few levels down); any event bus counts as request state."""
    import msgspec

    from kvhandoff.machines.runtime.bus import EventBus

    if depth > 4:
        return False
    if isinstance(value, EventBus):
        return True
    if isinstance(value, str):
        return value == needle
    if isinstance(value, dict):
        return any(
            _holds(k, needle, depth + 1) or _holds(v, needle, depth + 1) for k, v in value.items()
        )
    if isinstance(value, list | tuple | set | frozenset):
        return any(_holds(item, needle, depth + 1) for item in value)
    if isinstance(value, msgspec.Struct):
        return any(_holds(getattr(value, f), needle, depth + 1) for f in value.__struct_fields__)
    return False


_HALVES = {"scheduler", "rank", "assembly"}  # kvhandoff's own halves, the one copy


def _second_copies(connector: Any, request_id: str) -> list[str]:
    return [
        name
        for name, value in vars(connector).items()
        if name not in _HALVES and _holds(value, request_id)
    ]


def test_R_T01_C_05_the_connector_keeps_no_second_copy_of_request_state(
    tiny_model_dir: Path,
) -> None:
    """Issue 26: the connector is the scheduler half. While a D request waits, while a P
    request's blocks are leased, and after a worker step, no attribute of either role's
    connector outside kvhandoff's `PushScheduler` / `PushRank` names the request (nor
    holds an event bus of its own)."""
    from kvhandoff.machines.push.meta import PushWorkerOutput

    decode = _scheduler(tiny_model_dir, "kv_consumer")
    worker, rank = _worker(tiny_model_dir)
    decode.add_request(_request("cmpl-d-one", 2 * vllm_harness.BLOCK_SIZE, _decode_leg()))
    first = decode.schedule()
    assert "cmpl-d-one" in first.kv_connector_metadata.push.push_registrations
    kv_output = _worker_step(
        worker, rank, first, PushWorkerOutput(rank=0, step=first.kv_connector_metadata.push.step)
    )
    decode.update_from_output(first, _one_token(first, [], kv_output))
    assert decode.connector.has_pending_push_work()
    assert _second_copies(decode.connector, "cmpl-d-one") == []
    assert _second_copies(worker, "cmpl-d-one") == []

    prefill = _scheduler(tiny_model_dir, "kv_producer")
    params = {"do_remote_decode": True, "do_remote_prefill": False}
    prefill.add_request(_request("cmpl-p-one", 2 * vllm_harness.BLOCK_SIZE, params, max_tokens=1))
    out = prefill.schedule()
    prefill.update_from_output(out, _one_token(out, ["cmpl-p-one"]))
    assert prefill.connector.has_pending_push_work()
    assert _second_copies(prefill.connector, "cmpl-p-one") == []
