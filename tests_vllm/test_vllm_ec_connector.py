"""`KVHandoffECConnector` as vLLM 0.33 loads and drives it (C-05, R-T01).

vLLM's `ECConnectorFactory` finds the class by `ec_connector_module_path`; the class
implements every abstract method of `ECConnectorBase` with vLLM's parameter lists; and a
producer and a consumer engine, each a scheduler-role and a worker-role connector built by
vLLM's factory, move one encoding over real NIXL and ZMQ: the producer's worker saves it,
the producer's scheduler publishes it through `request_finished`, the consumer's scheduler
READs it into its region and its worker loads it into the encoder cache, every byte checked.

The `VllmConfig` is a stub carrying the fields the connector reads (vLLM's own
`ECTransferConfig` inside), as in `stock_vllm_ec.py`: a config-only text model is refused
as an `ec_producer` by vLLM's config checks, and vLLM measures encoder widths by running
the model.
"""

from __future__ import annotations

import inspect
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch

HIDDEN = 64
ROWS = 5
MODULE = "kvhandoff.integrations.vllm"
EXTRA = {
    "ec_cpu_bytes": 64 * HIDDEN * 4,
    "ec_enable_nixl": True,
    "consumer_ack_timeout_s": 5.0,
    "nixl_read_timeout_s": 10.0,
    "pin_lease_s": 10.0,
}


def ec_config(role: str, engine_id: str, **extra: Any) -> Any:
    from vllm.config import ECTransferConfig

    return ECTransferConfig(
        ec_connector="KVHandoffECConnector",
        ec_connector_module_path=MODULE,
        ec_role=role,  # type: ignore[arg-type]
        ec_connector_extra_config={**EXTRA, **extra},
        engine_id=engine_id,
    )


def stub_vllm_config(
    role: str, model_name: str = "kvhandoff-test/tiny-mm", device: str = "cpu"
) -> Any:
    ec = ec_config(role, f"kvh-ec-{role}-{uuid.uuid4().hex[:8]}")
    ec.mm_encoder_output_widths = {"image": HIDDEN}
    model = SimpleNamespace(
        dtype=torch.float32, model=model_name, get_inputs_embeds_size=lambda: HIDDEN
    )
    parallel = SimpleNamespace(
        data_parallel_index=0,
        tensor_parallel_size=1,
        prefill_context_parallel_size=1,
        rank=0,
    )
    return SimpleNamespace(
        ec_transfer_config=ec,
        model_config=model,
        parallel_config=parallel,
        device_config=SimpleNamespace(device=device),
    )


def request(req_id: str, mm_hash: str, params: Any = None) -> Any:
    """The fields of a vLLM `Request` the connector reads: one image feature with media."""
    from vllm.multimodal.inputs import PlaceholderRange

    feature = SimpleNamespace(
        identifier=mm_hash,
        modality="image",
        mm_position=PlaceholderRange(offset=0, length=ROWS),
        data=SimpleNamespace(get_data=lambda: {"image_grid_thw": torch.tensor([1, 2, 2])}),
    )
    return SimpleNamespace(request_id=req_id, mm_features=[feature], ec_transfer_params=params)


def test_C_05_vllm_loads_the_ec_connector_by_module_path() -> None:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    import kvhandoff.integrations.vllm as package

    cls = ECConnectorFactory.get_connector_class(ec_config("ec_consumer", "load-by-path"))
    assert cls is package.KVHandoffECConnector
    assert issubclass(cls, ECConnectorBase)
    assert cls.__module__ == f"{MODULE}.ec_connector"


def positional(fn: Any) -> list[str]:
    params = inspect.signature(fn).parameters.values()
    return [p.name for p in params if p.kind is not p.KEYWORD_ONLY]


def test_C_05_every_abstract_method_of_ec_connector_base_is_implemented() -> None:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase

    from kvhandoff.integrations.vllm import KVHandoffECConnector

    abstract = ECConnectorBase.__abstractmethods__
    assert sorted(abstract) == [
        "build_connector_meta",
        "has_cache_item",
        "save_caches",
        "start_load_caches",
        "update_state_after_alloc",
    ]
    assert not KVHandoffECConnector.__abstractmethods__
    implemented = {
        name
        for name, value in vars(KVHandoffECConnector).items()
        if callable(value) and name in vars(ECConnectorBase)
    }
    assert abstract <= implemented
    for name in implemented:  # vLLM's parameter names, in vLLM's order (keyword-only extras
        assert positional(getattr(KVHandoffECConnector, name)) == positional(  # aside)
            getattr(ECConnectorBase, name)
        ), name


def test_C_05_metadata_subclasses_vllms_and_wraps_plain_records() -> None:
    from vllm.distributed.ec_transfer.ec_connector.base import (
        ECConnectorMetadata,
        ECConnectorWorkerMetadata,
    )

    from kvhandoff.integrations.vllm import (
        KVHandoffECConnectorMetadata,
        KVHandoffECWorkerMetadata,
    )
    from kvhandoff.machines.ec.meta import CopyItem, ECConnectorMeta, ECWorkerMeta, RankReport

    meta = KVHandoffECConnectorMetadata(ECConnectorMeta(loads=(CopyItem("h", (1, 2), 2, 7),)))
    assert isinstance(meta, ECConnectorMetadata)
    wire = msgspec.msgpack.encode(meta.meta)
    assert msgspec.msgpack.decode(wire, type=ECConnectorMeta) == meta.meta
    first = KVHandoffECWorkerMetadata(ECWorkerMeta((RankReport(tp_rank=0, loaded=(7,)),)))
    second = KVHandoffECWorkerMetadata(ECWorkerMeta((RankReport(tp_rank=1, loaded=(7,)),)))
    assert isinstance(first, ECConnectorWorkerMetadata)
    both = first.aggregate(second)
    assert [r.tp_rank for r in both.meta.reports] == [0, 1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Engine:
    """One engine's scheduler-role and worker-role connectors, built by vLLM's factory and
    stepped as vLLM's scheduler and model runner call them."""

    def __init__(
        self, role: str, model_name: str = "kvhandoff-test/tiny-mm", device: str = "cpu"
    ) -> None:
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        config = stub_vllm_config(role, model_name, device)
        # vLLM builds the worker's connector first, before the scheduler makes the region.
        self.worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
        self.sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        self.cache: dict[str, torch.Tensor] = {}
        self.landed: set[str] = set()
        self.hold = False  # keep the workers' reports from the scheduler (a slow save)
        self.held: list[Any] = []

    def step(self, save: dict[str, torch.Tensor] | None = None) -> None:
        from vllm.v1.outputs import ECConnectorOutput

        meta = self.sched.build_connector_meta(None)
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_caches(self.cache)
        for mm_hash, output in (save or {}).items():
            self.cache[mm_hash] = output
            self.worker.save_caches(self.cache, mm_hash)
        out = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        if out is not None and self.hold:
            self.held.append(out)
        elif out is not None:  # vLLM calls it with a non-empty output only
            self.sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=out))
            for report in out.meta.reports:
                self.landed.update(str(t) for t in report.saved + report.loaded)

    def release(self) -> None:
        """Report what was held, as the late worker output of a slow save."""
        from vllm.v1.outputs import ECConnectorOutput

        self.hold = False
        for out in self.held:
            self.sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=out))
        self.held.clear()

    def close(self) -> None:
        self.worker.shutdown()
        self.sched.shutdown()


def until(step: Callable[[], bool], what: str, limit_s: float = 60.0) -> None:
    deadline = time.monotonic() + limit_s
    while not step():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {limit_s} s")


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Engine, Engine]]:
    monkeypatch.setenv("VLLM_EC_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("VLLM_EC_SIDE_CHANNEL_PORT", str(free_port()))
    producer = Engine("ec_producer")
    try:
        consumer = Engine("ec_consumer")
    except BaseException:
        producer.close()
        raise
    try:
        yield producer, consumer
    finally:
        consumer.close()
        producer.close()


def test_C_03_C_05_producer_saves_and_consumer_loads_through_vllms_calls(
    engines: tuple[Engine, Engine],
) -> None:
    move_one_encoding(*engines)


def move_one_encoding(producer: Engine, consumer: Engine, device: str = "cpu") -> None:
    """The producer saves and publishes one encoding, the consumer READs and loads it,
    every byte checked; the producer's grant is released. `device`: where both engines'
    encoder caches live (`bench/vllm_gpu.sh ec` runs it on CUDA)."""
    mm_hash = f"img-{uuid.uuid4().hex[:8]}"
    encoding = torch.randn(ROWS, HIDDEN, dtype=torch.float32, device=device)

    # Producer: vLLM allocates the encoder-cache entry, the runner encodes and saves it.
    p_req = request("p-1", mm_hash)
    assert producer.sched.ensure_cache_available(p_req, 0)
    producer.sched.update_state_after_alloc(p_req, 0)
    producer.step(save={mm_hash: encoding.clone()})
    until(lambda: bool(producer.landed) or (producer.step(), False)[1], "save")
    assert not producer.sched.has_cache_item(mm_hash)  # a producer never loads
    done, params = producer.sched.request_finished(p_req)
    assert done is False and params is not None
    assert params[mm_hash]["metadata"] == {"image_grid_thw": [1, 2, 2]}

    # Consumer: the request arrives with the producer's publication; vLLM defers it until
    # the READ into the consumer's region lands, then allocates and the runner loads.
    c_req = request("c-1", mm_hash, params=params)

    def available() -> bool:
        producer.step()
        consumer.step()
        return bool(consumer.sched.ensure_cache_available(c_req, 0))

    until(available, "READ from the producer")
    assert consumer.sched.has_cache_item(mm_hash)
    assert consumer.sched.take_unavailable_requests() == set()
    consumer.sched.update_state_after_alloc(c_req, 0)
    consumer.cache.clear()
    until(lambda: (consumer.step(), mm_hash in consumer.cache and consumer.landed)[1], "load")
    loaded = consumer.cache[mm_hash]
    assert loaded.shape == (ROWS, HIDDEN) and loaded.device == encoding.device
    assert torch.equal(loaded.view(torch.uint8), encoding.view(torch.uint8))
    assert consumer.sched.request_finished(c_req) == (False, None)
    # A P2P producer keeps the engine stepping (as vLLM 0.33's): its requests come from
    # peers; the grant's release shows as no pin held.
    assert producer.sched.has_pending_push_work()
    grants = producer.sched.side.scheduler.producer
    until(lambda: (producer.step(), not grants.pins())[1], "release")


def test_B_14_ec_events_reach_vllms_prometheus_metrics(engines: tuple[Engine, Engine]) -> None:
    """After one encoding moved, each scheduler-role connector's `get_ec_connector_stats`
    holds what its machines did in the interval (the producer's grant, the consumer's
    READ), and `build_prom_metrics`' object, called as vLLM's stat logger calls it,
    counts them under `vllm:kvhandoff_ec_events`; a second call with nothing new is None."""
    import prometheus_client
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from kvhandoff.integrations.vllm import KVHandoffECConnector

    producer, consumer = engines
    move_one_encoding(producer, consumer)
    unregister_vllm_metrics()
    types = {
        cls: cls
        for cls in (prometheus_client.Counter, prometheus_client.Gauge, prometheus_client.Histogram)
    }
    prom = KVHandoffECConnector.build_prom_metrics(
        producer.sched._vllm_config, types, ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]}
    )
    payloads = {}
    for engine_idx, engine in enumerate((producer, consumer)):
        stats = engine.sched.get_ec_connector_stats()
        assert stats is not None and not stats.is_empty()
        payloads[engine_idx] = stats.data
        prom.observe(stats.data, engine_idx)
        assert engine.sched.get_ec_connector_stats() is None

    def events(engine: str, event: str) -> float:
        labels = {"model_name": "m", "engine": engine, "event": event}
        value = prometheus_client.REGISTRY.get_sample_value(
            "vllm:kvhandoff_ec_events_total", labels
        )
        return 0.0 if value is None else value

    assert events("0", "producer.OK") == 1, payloads[0]
    assert events("1", "consumer.read") == 1, payloads[1]
    assert events("1", "producer.OK") == 0
    unregister_vllm_metrics()


# -- a consumer under vLLM's real Scheduler ---------------------------------------------------


def real_consumer(model_dir: Any) -> tuple[Any, Any]:
    """vLLM's real Scheduler over the config-only model with an `ec_consumer`
    `ec_transfer_config` naming this connector (vLLM builds it), and a worker-role connector.
    The model is text-only, so vLLM made no `MultiModalBudget`: the scheduler is given the
    encoder budget and encoder-cache size a small vision model would have."""
    from vllm.config import VllmConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    import vllm_harness

    base = vllm_harness.vllm_config(
        model_dir, kv_connector="NixlPushConnector", kv_role="kv_consumer"
    )
    config = VllmConfig(
        scheduler_config=base.scheduler_config,
        model_config=base.model_config,
        cache_config=base.cache_config,
        device_config=base.device_config,
        ec_transfer_config=ec_config("ec_consumer", f"kvh-ec-real-{uuid.uuid4().hex[:8]}"),
    )
    sched = vllm_harness.scheduler(config)
    sched.max_num_encoder_input_tokens = 256  # the stub budget
    sched.encoder_cache_manager = EncoderCacheManager(cache_size=256)
    try:
        worker = ECConnectorFactory.create_connector(config, ECConnectorRole.WORKER)
    except BaseException:
        sched.ec_connector.shutdown()
        raise
    return sched, worker


def mm_request(req_id: str, mm_hash: str, params: Any, media: bool) -> Any:
    """A vLLM `Request`: ten prompt tokens, an image placeholder of `ROWS` tokens at 2, its
    media unless the orchestrator dropped it (`data` None), the producer's publication."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    feature = MultiModalFeatureSpec(
        data=SimpleNamespace(get_data=dict) if media else None,
        modality="image",
        identifier=mm_hash,
        mm_position=PlaceholderRange(offset=2, length=ROWS),
    )
    params = SamplingParams(max_tokens=2, extra_args={"ec_transfer_params": params})
    return Request(req_id, list(range(1, 11)), params, None, mm_features=[feature])


def run_real(
    sched: Any, worker: Any, producer: Engine, mm_hash: str, hook: Callable[[], None]
) -> tuple[Any, Any]:
    """Steps vLLM's scheduler with the worker-role lifecycle until no request is left;
    (the encoding the worker loaded, if any; the last request's finish reason)."""
    from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput

    cache: dict[str, torch.Tensor] = {}
    loaded, reason = None, None
    deadline = time.monotonic() + 60.0
    while sched.requests:
        assert time.monotonic() < deadline, "the request never finished"
        hook()
        producer.step()
        out = sched.schedule()
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        worker.bind_connector_metadata(out.ec_connector_metadata)
        worker.start_load_caches(cache)
        meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        if meta is not None and mm_hash in cache:
            loaded = cache[mm_hash].clone()
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids],
            ec_connector_output=None if meta is None else ECConnectorOutput(None, None, None, meta),
        )
        for outputs in sched.update_from_output(out, runner).values():
            for one in outputs.outputs:
                reason = one.finish_reason or reason
    return loaded, reason


CASES = {
    # case: (producer's model is the consumer's, media on the request, save reported late)
    "loads": (True, False, False),
    "not_ready_then_loads": (True, False, True),
    "incompatible_fails": (False, False, False),
    "incompatible_encodes_locally": (False, True, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_C_03_C_05_real_scheduler_drives_the_consumer(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Any, case: str
) -> None:
    """vLLM keeps the request waiting while the READ is in flight, then schedules it with
    the encoding loaded (bytes checked) and finishes it. A save the producer has not
    reported yet is answered NACK_NOT_READY and retried until it lands (R-E08). A producer
    of another model answers NACK_INCOMPAT: with no media to encode locally vLLM ends the
    request FINISHED_ERROR (B-05); with media it encodes locally and finishes normally.
    Every KV block is free at the end."""
    from vllm.v1.engine import FinishReason

    same_model, media, late = CASES[case]
    monkeypatch.setenv("VLLM_EC_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("VLLM_EC_SIDE_CHANNEL_PORT", str(free_port()))
    sched, worker = real_consumer(tiny_model_dir)
    producer = Engine("ec_producer", str(tiny_model_dir) if same_model else "another/model")
    try:
        mm_hash = f"img-{uuid.uuid4().hex[:8]}"
        encoding = torch.randn(ROWS, HIDDEN, dtype=torch.float32)
        p_req = request("p-1", mm_hash)
        producer.sched.update_state_after_alloc(p_req, 0)
        producer.hold = late
        producer.step(save={mm_hash: encoding.clone()})
        if not late:
            until(lambda: bool(producer.landed) or (producer.step(), False)[1], "save")
        _, params = producer.sched.request_finished(p_req)
        sched.add_request(mm_request("c-1", mm_hash, params, media))

        def hook() -> None:  # the late save lands once the consumer was told NACK_NOT_READY
            if producer.held and sched.ec_connector.side.counters()["metrics"].get(
                "ec.consumer.not_ready"
            ):
                producer.release()

        loaded, reason = run_real(sched, worker, producer, mm_hash, hook)
        metrics = sched.ec_connector.side.counters()["metrics"]
        if same_model:
            assert reason == FinishReason.LENGTH
            assert loaded is not None
            assert torch.equal(loaded.view(torch.uint8), encoding.view(torch.uint8))
            assert bool(metrics.get("ec.consumer.not_ready")) == late
        else:
            assert metrics.get("ec.consumer.NACK_INCOMPAT") == 1 and loaded is None
            assert reason == (FinishReason.LENGTH if media else FinishReason.ERROR)
        assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 99  # one null block
    finally:
        producer.close()
        worker.shutdown()
        sched.ec_connector.shutdown()
