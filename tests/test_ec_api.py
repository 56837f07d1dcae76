"""Engine-facing API of the encoder-cache tier: scheduler and worker halves (issue 4).

Configuration, gating and the local tier: the tests drive `ECScheduler`/`ECWorker`
directly at a fixed time (`NOW`). The P2P tier is tested in `test_ec_p2p_api.py`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from kvhandoff.machines.ec.connector import ECCPUConnector
from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ
from kvhandoff.machines.ec.copy_batch import CopyBlocks
from kvhandoff.machines.ec.meta import ECConnectorMeta, ECRequestInfo, ECWorkerMeta, RankReport
from kvhandoff.machines.ec.nixl_gate import NIXL_MISSING_MESSAGE
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.ec.worker import ECWorker
from kvhandoff.machines.ec.worker_region import CloseRegion
from kvhandoff.protocol.ec_config import ECRole
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.sim.ec.plane import BLOCK_BYTES, COMPAT, layout, transfer_config

META = {"image_grid_thw": [1, 4, 4]}
NOW = 0.0


def local(role: ECRole, num_blocks: int = 8) -> tuple[ECScheduler, ECWorker]:
    config = transfer_config(role, num_blocks, engine_id=f"local-{role}", p2p=False)
    lay = layout(num_blocks)
    scheduler = ECCPUConnector.scheduler(config, lay)
    worker = ECCPUConnector.worker(config, lay)
    worker.register_region(0, lay.region_bytes, NOW)
    return scheduler, worker


def run_step(
    scheduler: ECScheduler, worker: ECWorker, *, land: bool = True
) -> tuple[ECConnectorMeta, list[CopyBlocks]]:
    """One engine step; every copy lands at once unless `land` is False."""
    meta = scheduler.build_connector_meta(NOW)
    worker.bind_connector_metadata(meta)
    worker.start_load_caches(NOW)
    worker.save_caches(NOW)
    copies = [e for e in worker.drain_effects() if isinstance(e, CopyBlocks)]
    if land:
        for copy in copies:
            worker.on_copy_done(copy.batch_id, NOW)
    scheduler.update_connector_output(worker.build_connector_worker_meta(NOW), NOW)
    return meta, copies


def request(rid: str, *hashes: str, tokens: int = 2, **fields: Any) -> ECRequestInfo:
    """A request of `hashes`, each `tokens` encoder tokens long."""
    return ECRequestInfo(rid, tuple(hashes), mm_tokens=(tokens,) * len(hashes), **fields)


def alloc(scheduler: ECScheduler, rid: str, mm_hash: str, tokens: int) -> None:
    """The engine allocated `tokens` rows for `mm_hash` of request `rid`."""
    scheduler.update_state_after_alloc(request(rid, mm_hash, tokens=tokens), 0, NOW)


def encode(scheduler: ECScheduler, worker: ECWorker, rid: str, mm_hash: str, tokens: int) -> None:
    req = request(rid, mm_hash, tokens=tokens, mm_metadata={mm_hash: META})
    scheduler.update_state_after_alloc(req, 0, NOW)
    run_step(scheduler, worker)


# -- configuration and gating -------------------------------------------------------------


def test_R_E01_layout_must_match_ec_cpu_bytes() -> None:
    config = transfer_config("ec_both", 8, engine_id="e", p2p=False)
    with pytest.raises(LocalProtocolError, match="ec_cpu_bytes"):
        ECScheduler(config, layout(9))


def test_R_E01_missing_ec_cpu_bytes_raises_value_error() -> None:
    config = transfer_config("ec_both", 8, engine_id="e", p2p=False)
    bad = type(config)(
        ec_connector="ECCPUConnector", ec_role="ec_both", ec_connector_extra_config={}
    )
    with pytest.raises(ValueError, match="ec_cpu_bytes"):
        ECScheduler(bad, layout(8))


def test_R_E01_consumer_ack_timeout_s_sets_the_ack_deadline() -> None:
    config = transfer_config("ec_consumer", 16, engine_id="slow", consumer_ack_timeout_s=7.5)
    scheduler = ECScheduler(config, layout(16), compat_hash=COMPAT)
    params = {"h": {"metadata": META, "peer_host": "p", "peer_port": 1, "size_bytes": 8}}
    assert not scheduler.ensure_cache_available(
        request("r", "h", tokens=1, ec_transfer_params=params), 0, NOW
    )
    assert scheduler.bus.deadline_of(EC_CONSUMER_READ, "h") == 7.5


@pytest.mark.parametrize("half", ["scheduler", "worker"])
def test_R_E02_p2p_without_nixl_raises_runtime_error_naming_the_fix(
    half: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = importlib.util.find_spec

    def no_nixl(name: str, *args: Any) -> Any:
        return None if name.startswith("nixl") else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", no_nixl)
    config = transfer_config("ec_both", 8, engine_id="e", p2p=True)
    build = ECCPUConnector.scheduler if half == "scheduler" else ECCPUConnector.worker
    with pytest.raises(RuntimeError) as info:
        build(config, layout(8), compat_hash=COMPAT) if half == "scheduler" else build(
            config, layout(8)
        )
    assert str(info.value) == NIXL_MISSING_MESSAGE
    assert "remove ec_enable_nixl from ec_connector_extra_config" in str(info.value)


def test_R_E02_local_tier_has_no_p2p_halves() -> None:
    scheduler, _ = local("ec_both")
    assert scheduler.consumer is None and scheduler.producer is None
    with pytest.raises(LocalProtocolError, match="not a P2P consumer"):
        scheduler.on_xfer_ack(b"", NOW, peer="p:1")
    assert scheduler.request_finished(request("r", "h", mm_metadata={"h": META}), NOW) == {}


def test_R_E02_connector_name_is_checked() -> None:
    config = transfer_config("ec_both", 8, engine_id="e", p2p=False)
    other = type(config)(
        ec_connector="ECExampleConnector",
        ec_role="ec_both",
        ec_connector_extra_config=config.ec_connector_extra_config,
    )
    with pytest.raises(LocalProtocolError, match="ECCPUConnector"):
        ECCPUConnector.scheduler(other, layout(8))


@pytest.mark.parametrize(
    ("role", "encoder_only"), [("ec_producer", True), ("ec_consumer", False), ("ec_both", False)]
)
def test_R_E13_a_producer_alone_runs_encoder_only(role: ECRole, encoder_only: bool) -> None:
    scheduler, _ = local(role)
    assert scheduler.is_mm_encoder_only is encoder_only


# -- local tier: save, load, eviction -------------------------------------------------------


def test_R_E05_a_copy_the_engine_refused_fails_at_the_next_poll() -> None:
    scheduler, worker = local("ec_both")
    alloc(scheduler, "r1", "h", 3)
    _, copies = run_step(scheduler, worker, land=False)
    (copy,) = copies
    worker.on_copy_refused(copy.batch_id)  # what a CopyBlocks handler does when it raises
    assert worker.in_flight() == 1, "refused, not failed yet"
    assert worker.take_landed().failed == frozenset()
    assert worker.fail_refused(NOW) == 1
    assert worker.in_flight() == 0 and worker.fail_refused(NOW) == 0
    assert worker.take_landed().failed == {"h"}
    report = worker.build_connector_worker_meta(NOW)
    assert [r.failed_saves for r in report.reports] == [(copy.items[0].transfer_id,)]
    scheduler.update_connector_output(report, NOW)
    assert not scheduler.has_cache_item("h")


def test_R_E04_R_E05_save_then_load_round_trip_on_ec_both() -> None:
    scheduler, worker = local("ec_both")
    alloc(scheduler, "r1", "h", 3)
    assert not scheduler.has_cache_item("h"), "not ready before the save lands"
    meta, copies = run_step(scheduler, worker, land=False)
    assert [item.mm_hash for item in meta.saves] == ["h"] and meta.loads == ()
    assert [c.direction for c in copies] == ["save"]
    assert not scheduler.has_cache_item("h"), "still saving: end event not seen"
    worker.on_copy_done(copies[0].batch_id, NOW)
    assert worker.take_landed().saved == {"h"}
    scheduler.update_connector_output(worker.build_connector_worker_meta(NOW), NOW)
    assert scheduler.has_cache_item("h")
    assert scheduler.ensure_cache_available(request("r2", "h"), 0, NOW)
    assert scheduler.cache.state("h") == "pinned", "held until its load is scheduled"
    alloc(scheduler, "r2", "h", 3)
    meta, copies = run_step(scheduler, worker, land=False)
    assert [item.blocks for item in meta.loads] == [(0, 1, 2)]
    assert scheduler.cache.state("h") == "pinned", "pinned while loading"
    worker.on_copy_done(copies[0].batch_id, NOW)
    scheduler.update_connector_output(worker.build_connector_worker_meta(NOW), NOW)
    scheduler.request_finished(request("r2", "h"), NOW)
    assert scheduler.cache.state("h") == "ready"
    scheduler.cache.check()


def test_R_E04_eviction_under_pressure_is_fifo() -> None:
    scheduler, worker = local("ec_both", num_blocks=6)
    for index, mm_hash in enumerate(["a", "b", "c"]):
        encode(scheduler, worker, f"r{index}", mm_hash, 2)
    assert scheduler.ensure_cache_available(request("keep", "a"), 0, NOW)  # holds a
    encode(scheduler, worker, "r3", "d", 2)
    assert scheduler.cache.state("b") is None, "b was the oldest ready and unpinned"
    assert {scheduler.cache.state(h) for h in "acd"} == {"pinned", "ready"}
    encode(scheduler, worker, "r4", "e", 5)
    assert scheduler.cache.state("e") is None, "pinned a leaves room for 4 blocks only"
    assert scheduler.cache.state("c") == "ready", "nothing evicted for a failed reservation"
    encode(scheduler, worker, "r5", "f", 3)
    assert scheduler.cache.state("c") is None and scheduler.cache.state("d") is None
    assert scheduler.cache.state("a") == "pinned" and scheduler.cache.state("f") == "ready"
    scheduler.cache.check()


def test_R_E05_abandoned_and_failed_saves_free_their_blocks() -> None:
    scheduler, worker = local("ec_producer")
    alloc(scheduler, "r", "a", 2)
    alloc(scheduler, "r", "b", 2)
    meta = scheduler.build_connector_meta(NOW)
    worker.bind_connector_metadata(meta)
    worker.start_load_caches(NOW)
    worker.save_caches(NOW, ["a"])  # the encoder never produced b
    (copy,) = [e for e in worker.drain_effects() if isinstance(e, CopyBlocks)]
    worker.on_copy_done(copy.batch_id, NOW, ok=False)
    report = worker.build_connector_worker_meta(NOW)
    (rank,) = report.reports
    assert set(rank.failed_saves) == {item.transfer_id for item in meta.saves}
    assert not rank.saved
    scheduler.update_connector_output(report, NOW)
    assert scheduler.cache.pool.free_count == scheduler.layout.num_blocks


def test_R_E03_only_tp0_pcp0_writes_and_the_owner_unlinks() -> None:
    config = transfer_config("ec_both", 8, engine_id="e", p2p=False)
    writer = ECCPUConnector.worker(config, layout(8), tp_rank=0, pcp_rank=0)
    reader = ECCPUConnector.worker(config, layout(8), tp_rank=1, pcp_rank=0)
    other_pcp = ECCPUConnector.worker(config, layout(8), tp_rank=0, pcp_rank=1)
    scheduler = ECScheduler(config, layout(8))
    alloc(scheduler, "r", "h", 2)
    meta = scheduler.build_connector_meta(NOW)
    for worker in (writer, reader, other_pcp):
        worker.register_region(0, layout(8).region_bytes, NOW)
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(NOW)
        worker.save_caches(NOW)
    assert [type(e) for e in writer.drain_effects()] == [CopyBlocks]
    assert reader.drain_effects() == [] and other_pcp.drain_effects() == []
    for worker, unlink in ((writer, True), (reader, False)):
        worker.shutdown(NOW)
        worker.shutdown(NOW)  # idempotent
        assert worker.drain_effects() == [CloseRegion(unlink=unlink)]
        with pytest.raises(LocalProtocolError, match="register_region"):
            worker.start_load_caches(NOW)


def test_R_E03_worker_refuses_copies_before_registration_and_small_regions() -> None:
    config = transfer_config("ec_both", 8, engine_id="e", p2p=False)
    worker = ECWorker(config, layout(8))
    with pytest.raises(LocalProtocolError, match="register_region"):
        worker.save_caches(NOW)
    with pytest.raises(LocalProtocolError, match="cannot hold"):
        worker.register_region(0, BLOCK_BYTES, NOW)


# -- local tier: requests that fail or fall back ---------------------------------------


def test_B05_unservable_publication_with_rewritten_media_fails_at_once() -> None:
    scheduler, _ = local("ec_consumer")
    req = request(
        "r", "h", ec_transfer_params={"h": {"metadata": {}}}, metadata_only=frozenset("h")
    )
    assert not scheduler.ensure_cache_available(req, 0, NOW)
    assert scheduler.failure_reason("r").count("unservable") == 1
    assert scheduler.take_unavailable_requests() == {"r"}, "vLLM's call for failed requests"


def test_B05_failed_load_fails_its_request() -> None:
    scheduler, worker = local("ec_both")
    encode(scheduler, worker, "r0", "h", 2)
    req = request("r1", "h")
    assert scheduler.ensure_cache_available(req, 0, NOW)
    scheduler.update_state_after_alloc(req, 0, NOW)
    (load,) = scheduler.build_connector_meta(NOW).loads
    failed = RankReport(failed_loads=(load.transfer_id,))
    scheduler.update_connector_output(ECWorkerMeta((failed,)), NOW)
    (failure,) = scheduler.take_failed_requests()
    assert failure.request_id == "r1" and "loading" in failure.reason
    assert scheduler.cache.state("h") == "ready"


def test_R_E05_saves_of_a_step_that_never_reported_are_failed_later() -> None:
    scheduler, worker = local("ec_producer")
    alloc(scheduler, "r", "a", 2)
    meta = scheduler.build_connector_meta(NOW)
    worker.bind_connector_metadata(meta)
    worker.bind_connector_metadata(scheduler.build_connector_meta(NOW))  # no save, no report
    report = worker.build_connector_worker_meta(NOW)
    assert report.reports[0].failed_saves == (meta.saves[0].transfer_id,)
    scheduler.update_connector_output(report, NOW)
    assert scheduler.cache.state("a") is None


def test_R_E02_publication_without_p2p_is_encoded_locally() -> None:
    scheduler, _ = local("ec_consumer")
    params = {"h": {"metadata": META, "peer_host": "p", "peer_port": 1, "size_bytes": 8}}
    assert scheduler.ensure_cache_available(
        request("r", "h", tokens=1, ec_transfer_params=params), 0, NOW
    )
    assert "P2P is off" in scheduler.local_reason("r", "h")


def test_R_E05_has_pending_work_while_a_save_or_a_load_is_unconfirmed() -> None:
    """The engine keeps stepping (vLLM 0.33's `has_pending_push_work`) while a save or a
    load is dispatched but not confirmed, and stops once both are."""
    scheduler, worker = local("ec_both")
    assert not scheduler.has_pending_work(), "idle"
    alloc(scheduler, "r1", "h", 3)
    assert scheduler.has_pending_work(), "a save is planned"
    _, copies = run_step(scheduler, worker, land=False)
    assert scheduler.has_pending_work(), "the save is not confirmed"
    worker.on_copy_done(copies[0].batch_id, NOW)
    scheduler.update_connector_output(worker.build_connector_worker_meta(NOW), NOW)
    scheduler.request_finished(request("r1", "h"), NOW)
    assert not scheduler.has_pending_work(), "saved and confirmed"
    assert scheduler.ensure_cache_available(request("r2", "h"), 0, NOW)
    alloc(scheduler, "r2", "h", 3)
    _, copies = run_step(scheduler, worker, land=False)
    assert scheduler.has_pending_work(), "the load is not confirmed"
    worker.on_copy_done(copies[0].batch_id, NOW)
    scheduler.update_connector_output(worker.build_connector_worker_meta(NOW), NOW)
    scheduler.request_finished(request("r2", "h"), NOW)
    assert not scheduler.has_pending_work(), "loaded and confirmed"


def test_R_E05_the_same_mm_hash_asked_twice_in_one_step_is_loaded_once() -> None:
    """Two requests of one encoding allocated in the same step: one load (vLLM 0.33
    loads an `mm_hash` once per step), and no pin is left behind once it lands."""
    scheduler, worker = local("ec_both")
    encode(scheduler, worker, "r1", "h", 3)
    scheduler.request_finished(request("r1", "h"), NOW)
    for rid in ("r2", "r3"):
        assert scheduler.ensure_cache_available(request(rid, "h", tokens=3), 0, NOW)
        alloc(scheduler, rid, "h", 3)
    meta, _ = run_step(scheduler, worker)
    assert [item.mm_hash for item in meta.loads] == ["h"]
    assert scheduler.loads_shared == 1
    for rid in ("r2", "r3"):
        scheduler.request_finished(request(rid, "h"), NOW)
    assert scheduler.cache.state("h") == "ready", "every pin given back"
    scheduler.cache.check()
