"""`KVHandoffECConnector` at TP=2 with each worker rank in a process of its own (R-E03,
R-T06, R-T01, R-E07): a producer and a consumer engine, each a scheduler-role connector
in the test process (vLLM's factory builds it, its `/dev/shm` region, NIXL agent and ZMQ
side channel with it) and two worker-role connectors in other processes, attached to that
region by name. Each step the scheduler's metadata goes down to both ranks as msgpack
bytes and both ranks' worker metadata come back as bytes, aggregated as vLLM aggregates
them (`KVHandoffECWorkerMetadata.aggregate`).

The producer's two ranks both get vLLM's `save_caches`: only TP rank 0 writes the region,
and only it reports the save's transfer id (the one participating rank). The consumer READs
the encoding over NIXL into its own region; both of its ranks load it into their own
encoder cache and report the load under the same transfer id, every byte checked in each.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import msgspec
import pytest
import torch
from ec_workers import HIDDEN, ROWS, ECWorkerProc, stub_config
from test_vllm_ec_connector import free_port, request, until

pytestmark = pytest.mark.integration

TP = 2


class TPEngine:
    """One EC engine: its scheduler-role connector here, its TP ranks in processes."""

    def __init__(self, role: str) -> None:
        from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

        engine_id = f"kvh-ec-tp-{role}-{uuid.uuid4().hex[:8]}"
        self.workers = [ECWorkerProc(role, engine_id, TP, rank) for rank in range(TP)]
        try:
            self.ranks = [w.ready() for w in self.workers]
            config = stub_config(role, engine_id, TP)
            self.sched = ECConnectorFactory.create_connector(config, ECConnectorRole.SCHEDULER)
        except BaseException:
            for worker in self.workers:
                worker.close()
            raise
        # the transfer ids each TP rank reported saved and loaded, over every step
        self.saved: dict[int, set[int]] = {rank: set() for rank in range(TP)}
        self.loaded: dict[int, set[int]] = {rank: set() for rank in range(TP)}

    def step(self, save: dict[str, torch.Tensor] | None = None) -> None:
        """One engine step: the metadata to every rank, each rank's lifecycle (the
        encoder's output saved in every rank, as vLLM calls `save_caches` on each), the
        ranks' outputs aggregated, then the scheduler's update."""
        from vllm.v1.outputs import ECConnectorOutput

        from kvhandoff.integrations.vllm import KVHandoffECWorkerMetadata
        from kvhandoff.machines.ec.meta import ECWorkerMeta

        meta = self.sched.build_connector_meta(None)
        wire = msgspec.msgpack.encode(meta.meta)
        saves = {h: t.contiguous().numpy().tobytes() for h, t in (save or {}).items()}
        outs = [w.call("step", wire, saves) for w in self.workers]
        metas = [
            KVHandoffECWorkerMetadata(msgspec.msgpack.decode(raw, type=ECWorkerMeta))
            for raw in outs
            if raw is not None
        ]
        if not metas:
            return  # vLLM calls update_connector_output with a worker output only
        merged = metas[0]
        for other in metas[1:]:
            merged = merged.aggregate(other)
        for report in merged.meta.reports:
            self.saved[report.tp_rank].update(report.saved)
            self.loaded[report.tp_rank].update(report.loaded)
        self.sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=merged))

    def close(self) -> None:
        try:
            for worker in self.workers:
                worker.close()
        finally:
            self.sched.shutdown()


@pytest.fixture
def tp_engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TPEngine, TPEngine]]:
    monkeypatch.setenv("VLLM_EC_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("VLLM_EC_SIDE_CHANNEL_PORT", str(free_port()))
    producer = TPEngine("ec_producer")
    try:
        consumer = TPEngine("ec_consumer")
    except BaseException:
        producer.close()
        raise
    try:
        yield producer, consumer
    finally:
        consumer.close()
        producer.close()


def test_R_E03_R_T06_tp2_ec_workers_in_their_own_processes_save_once_load_in_each(
    tp_engines: tuple[TPEngine, TPEngine],
) -> None:
    producer, consumer = tp_engines
    assert producer.ranks == [(0, 0), (1, 0)] and consumer.ranks == [(0, 0), (1, 0)]
    mm_hash = f"img-{uuid.uuid4().hex[:8]}"
    encoding = torch.randn(ROWS, HIDDEN, dtype=torch.float32)

    # Producer: vLLM allocates the entry; both ranks encode and save; rank 0 writes.
    p_req = request("p-1", mm_hash)
    assert producer.sched.ensure_cache_available(p_req, 0)
    producer.sched.update_state_after_alloc(p_req, 0)
    producer.step(save={mm_hash: encoding.clone()})
    until(lambda: bool(producer.saved[0]) or (producer.step(), False)[1], "save")
    assert not producer.saved[1], "TP rank 1 takes no part in a save (R-E03)"
    done, params = producer.sched.request_finished(p_req)
    assert done is False and params is not None and params[mm_hash]["size_bytes"] > 0

    # Consumer: the READ into its region, then both ranks load into their encoder caches.
    c_req = request("c-1", mm_hash, params=params)

    def available() -> bool:
        producer.step()
        consumer.step()
        return bool(consumer.sched.ensure_cache_available(c_req, 0))

    until(available, "READ from the producer")
    assert consumer.sched.has_cache_item(mm_hash)
    consumer.sched.update_state_after_alloc(c_req, 0)

    def loaded_everywhere() -> bool:
        consumer.step()
        return all(consumer.loaded.values()) and all(
            w.call("read", mm_hash) is not None for w in consumer.workers
        )

    until(loaded_everywhere, "load in both consumer ranks")
    want = encoding.numpy().tobytes()
    assert [w.call("read", mm_hash) for w in consumer.workers] == [want] * TP
    assert consumer.sched.request_finished(c_req) == (False, None)
    # A P2P producer keeps the engine stepping (as vLLM 0.33's): its requests come from
    # peers; the grant's release shows as no pin held.
    assert producer.sched.has_pending_push_work()
    grants = producer.sched.side.scheduler.producer
    until(lambda: (producer.step(), not grants.pins())[1], "release")
