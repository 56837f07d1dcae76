"""kvhandoff's Prometheus metrics as vLLM 0.33 exports them (B-14, S-06, C-05): the
connectors' stats travel from the worker ranks (in their own processes) and the scheduler
through vLLM's own aggregation into `SchedulerStats`, vLLM's `PrometheusStatLogger` hands
them to `build_prom_metrics`' object, and the test reads the samples back from the
prometheus registry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from connector_engines import BLOCK, P_LEG, Engine, engines
from connector_engines import d_leg as _d_leg
from connector_engines import prompt as _prompt
from connector_engines import request as _request
from connector_engines import run as _run

import vllm_harness

LENGTHS = {"cmpl-m-0": 2 * BLOCK + 3, "cmpl-m-1": 5 * BLOCK}


class Recorded:
    """The samples of one engine's vLLM Prometheus logger after its stats were recorded."""

    def __init__(self, sched: Any, stats: list[Any]) -> None:
        import prometheus_client
        from vllm.v1.metrics.loggers import PrometheusStatLogger

        self.logger = PrometheusStatLogger(sched.vllm_config)  # unregisters vllm:* first
        for scheduler_stats in stats:
            self.logger.record(scheduler_stats, None, engine_idx=0)
        self.labels = {
            "model_name": str(sched.vllm_config.model_config.served_model_name),
            "engine": "0",
        }
        self.registry = prometheus_client.REGISTRY

    def value(self, name: str, **labels: str) -> float:
        found = self.registry.get_sample_value(name, {**self.labels, **labels})
        return 0.0 if found is None else float(found)


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 1)


def _stepping(engine: Engine, stats: list[Any]) -> None:
    """Make `engine.step` keep every SchedulerStats vLLM produces."""
    engine.step = lambda: vllm_harness.engine_step(  # type: ignore[method-assign]
        engine.sched, engine.workers, engine.aggregator, stats
    )


def test_B_14_transfers_bytes_and_times_reach_vllms_prometheus_registry(
    pair: tuple[Engine, Engine],
) -> None:
    """Two requests pushed over real NIXL between two real vLLM Schedulers: P's registry
    counts two sent and observes two finish-to-receive times, D's counts two received and
    two receive waits, both observe each request's KV bytes (its blocks times the block's
    bytes in vLLM's KV cache spec); no failure is counted."""
    prefill, decode = pair
    p_stats: list[Any] = []
    d_stats: list[Any] = []
    _stepping(prefill, p_stats)
    _stepping(decode, d_stats)
    for i, (rid, length) in enumerate(LENGTHS.items()):
        prefill.sched.add_request(_request(rid, _prompt(i, length), P_LEG, 1))
        decode.sched.add_request(_request(rid, _prompt(i, length), _d_leg(prefill), 2))
    run = _run(prefill, decode)
    assert run.verified == set(LENGTHS)

    spec = vllm_harness.kv_cache_config().kv_cache_groups[0].kv_cache_spec
    block_bytes = spec.page_size_bytes * len(vllm_harness.LAYERS)
    total_bytes = sum(-(-n // BLOCK) for n in LENGTHS.values()) * block_bytes

    d = Recorded(decode.sched, d_stats)
    assert d.value("vllm:kvhandoff_transfers_total", outcome="received") == 2
    assert d.value("vllm:kvhandoff_transfers_total", outcome="failed") == 0
    assert d.value("vllm:kvhandoff_receive_wait_seconds_count") == 2
    assert d.value("vllm:kvhandoff_receive_wait_seconds_sum") > 0
    assert d.value("vllm:kvhandoff_bytes_transferred_sum") == total_bytes
    assert d.value("vllm:kvhandoff_finish_to_receive_seconds_count") == 0  # a P-side metric
    for cause in ("handshake", "post", "transfer_error", "timeout", "peer_gone", "rejected"):
        assert d.value("vllm:kvhandoff_failures_total", cause=cause) == 0

    p = Recorded(prefill.sched, p_stats)
    assert p.value("vllm:kvhandoff_transfers_total", outcome="sent") == 2
    assert p.value("vllm:kvhandoff_finish_to_receive_seconds_count") == 2
    assert p.value("vllm:kvhandoff_bytes_transferred_sum") == total_bytes
    assert p.value("vllm:kvhandoff_lease_expiries_total") == 0
    assert p.value("vllm:kvhandoff_receive_wait_seconds_count") == 0


def test_B_14_failures_rejections_and_expiries_by_cause_reach_the_registry(
    tiny_model_dir: Path,
) -> None:
    """D's real vLLM Scheduler: a rank reports a failed receive and failures by cause; its
    worker connector's own stats for the interval (a refused notif, as a rank returns
    them) ride in the same KVConnectorOutput. vLLM adds them to the scheduler's, and the
    registry shows the failed transfer, each cause, the refused input by cause and the
    late report kvhandoff's scheduler ignored (stale: vLLM never sees it)."""
    from test_vllm_connector import _scheduler, _worker

    from kvhandoff.integrations.vllm import KVHandoffConnectorStats
    from kvhandoff.machines.push.meta import PushWorkerOutput

    sched = _scheduler(tiny_model_dir, "kv_consumer")
    worker, rank = _worker(tiny_model_dir)
    sched.add_request(vllm_harness_request("cmpl-d-fail"))
    first = sched.schedule()
    failed = PushWorkerOutput(
        rank=0,
        step=first.kv_connector_metadata.push.step,
        failed_recving={"cmpl-d-fail": "transfer_error"},
        failures={"transfer_error": 1, "handshake": 2},
    )
    kv_output = vllm_harness.worker_step(worker, rank, first, failed)
    kv_output.kv_connector_stats = KVHandoffConnectorStats(
        data={"lease_expiries": 0, "rejected_inputs": {"notif from an unknown agent": 2}}
    )
    stats = [_scheduler_stats(sched.update_from_output(first, _token(first, kv_output)))]
    second = sched.schedule()
    late = PushWorkerOutput(
        rank=0,
        step=second.kv_connector_metadata.push.step,
        finished_recving=("cmpl-d-fail",),
    )
    kv_output = vllm_harness.worker_step(worker, rank, second, late)
    stats.append(_scheduler_stats(sched.update_from_output(second, _token(second, kv_output))))

    got = Recorded(sched, stats)
    assert got.value("vllm:kvhandoff_transfers_total", outcome="failed") == 1
    assert got.value("vllm:kvhandoff_transfers_total", outcome="received") == 0
    assert got.value("vllm:kvhandoff_transfers_total", outcome="released") == 0  # vLLM ended
    # it for its failed load (kv_load_failure_policy="fail"): a failed transfer, not a release
    assert got.value("vllm:kvhandoff_failures_total", cause="transfer_error") == 1
    assert got.value("vllm:kvhandoff_failures_total", cause="handshake") == 2
    assert got.value("vllm:kvhandoff_failures_total", cause="timeout") == 0
    cause = "notif from an unknown agent"
    assert got.value("vllm:kvhandoff_rejected_inputs_total", cause=cause) == 2
    assert got.value("vllm:kvhandoff_dropped_reports_total", kind="stale") == 1
    assert got.value("vllm:kvhandoff_receive_wait_seconds_count") == 0  # it never arrived


def vllm_harness_request(request_id: str) -> Any:
    from test_vllm_connector import _decode_leg, _request

    return _request(request_id, BLOCK, _decode_leg())


def _token(out: Any, kv_output: Any) -> Any:
    return vllm_harness.one_token(out, [], kv_output)


def _scheduler_stats(engine_outputs: Any) -> Any:
    return next(iter(engine_outputs.values())).scheduler_stats


def test_B_14_stats_payload_adds_up_as_vllm_aggregates_it() -> None:
    """`aggregate` (vLLM's worker and scheduler sum) adds counts, counts per label and
    histogram samples; `reduce` (vLLM's log line) flattens them; an all-zero payload is
    empty, so vLLM skips it."""
    from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffConnectorStats

    rank = KVHandoffConnectorStats(
        data={"lease_expiries": 1, "rejected_inputs": {"bad": 2}, "receive_wait_s": [0.5]}
    )
    other = KVHandoffConnector.build_kv_connector_stats(
        {"lease_expiries": 2, "rejected_inputs": {"bad": 1, "late": 1}, "receive_wait_s": [1.5]}
    )
    assert other is not None
    merged = rank.aggregate(other)
    assert merged.data == {
        "lease_expiries": 3,
        "rejected_inputs": {"bad": 3, "late": 1},
        "receive_wait_s": [0.5, 1.5],
    }
    assert merged.reduce() == {
        "lease_expiries": 3,
        "receive_wait_s.avg": 1.0,
        "receive_wait_s.count": 2,
        "rejected_inputs.bad": 3,
        "rejected_inputs.late": 1,
    }
    assert KVHandoffConnectorStats(data={"timeout": 0, "rejected_inputs": {}}).is_empty()
