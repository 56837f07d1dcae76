"""The CPU copy engine (R-E05) alone and under the local tier over a real `/dev/shm` region
(R-E03, R-E04): batched saves and loads, completion through `poll()`, errors as events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvhandoff.adapters import ec_copy_cpu
from kvhandoff.adapters.ec_copy_cpu import CpuCopyEngine, as_rows
from kvhandoff.adapters.shm.region import SharedRegion
from kvhandoff.machines.ec.connector import ECCPUConnector
from kvhandoff.machines.ec.copy_batch import CopyBlocks
from kvhandoff.machines.ec.meta import CopyItem, ECRequestInfo
from kvhandoff.machines.ec.worker_region import CloseRegion
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.errors import LocalProtocolError

HIDDEN = 8
BLOCK = HIDDEN * 2  # bfloat16 rows
BLOCKS = 32


def encoder_output(tokens: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (tokens * BLOCK,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).reshape(tokens, -1)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.fixture
def region() -> torch.Tensor:
    return torch.zeros(BLOCKS * BLOCK, dtype=torch.uint8)


def test_R_E05_save_then_load_round_trips_a_batch(region: torch.Tensor) -> None:
    engine = CpuCopyEngine(region, BLOCK)
    cache = {"a": encoder_output(3, 1), "b": encoder_output(2, 2)}
    items = [CopyItem("a", (7, 2, 30), 3), CopyItem("b", (0, 31), 2)]
    engine.submit(1, "save", items, cache)
    assert engine.poll() == [(1, True)]
    assert engine.poll() == [], "each end event is reported once"
    rows = region.view(BLOCKS, BLOCK)
    assert torch.equal(rows[30], as_rows(cache["a"], BLOCK)[2]), "token 2 of a in block 30"
    out = {name: torch.empty_like(tensor) for name, tensor in cache.items()}
    engine.submit(2, "load", items, out)
    assert engine.poll() == [(2, True)]
    assert same_bytes(out["a"], cache["a"]) and same_bytes(out["b"], cache["b"])


def test_R_E05_a_batch_is_one_copy_call_per_encoding_not_one_per_block(
    region: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = CpuCopyEngine(region, BLOCK)
    calls = {"scatter": 0, "gather": 0}
    real_scatter, real_gather = ec_copy_cpu._scatter_rows, ec_copy_cpu._gather_rows

    def count_scatter(*args: Any) -> None:
        calls["scatter"] += 1
        real_scatter(*args)

    def count_gather(*args: Any) -> None:
        calls["gather"] += 1
        real_gather(*args)

    monkeypatch.setattr(ec_copy_cpu, "_scatter_rows", count_scatter)
    monkeypatch.setattr(ec_copy_cpu, "_gather_rows", count_gather)

    def no_copy(*_args: Any, **_kwargs: Any) -> None:
        raise AssertionError("a per-block (or per-run) copy_ call")

    monkeypatch.setattr(torch.Tensor, "copy_", no_copy)
    cache = {f"h{i}": encoder_output(4, i) for i in range(6)}
    items = [CopyItem(f"h{i}", tuple(range(4 * i, 4 * i + 4)), 4) for i in range(6)]
    out = {k: torch.empty_like(v) for k, v in cache.items()}
    engine.submit(1, "save", items, cache)
    engine.submit(2, "load", items, out)
    monkeypatch.undo()
    assert calls == {"scatter": 6, "gather": 6}, "one call per encoding of 4 blocks"
    assert engine.poll() == [(1, True), (2, True)]
    assert all(same_bytes(out[k], cache[k]) for k in cache)


def test_R_E05_long_runs_are_slice_copies_and_words_follow_alignment() -> None:
    # 8-byte rows: contiguous items take the run path, scattered ones the row scatter and
    # an int64 gather; a 6-byte row size falls back to 2-byte words.
    for block in (8, 6):
        region = torch.zeros(256 * block, dtype=torch.uint8)
        engine = CpuCopyEngine(region, block, run_min_blocks=4)
        gen = torch.Generator().manual_seed(block)
        cache = {
            name: torch.randint(0, 256, (tokens, block), dtype=torch.uint8, generator=gen)
            for name, tokens in (("run", 64), ("two_runs", 40), ("scattered", 30))
        }
        perm = torch.randperm(100, generator=gen).tolist()
        items = [
            CopyItem("run", tuple(range(100, 164)), 64),
            CopyItem("two_runs", (*range(200, 220), *range(170, 190)), 40),
            CopyItem("scattered", tuple(perm[:30]), 30),
        ]
        engine.submit(1, "save", items, cache)
        assert engine.poll() == [(1, True)]
        rows = region.view(-1, block)
        for item in items:
            assert torch.equal(rows[list(item.blocks)], cache[item.mm_hash])
        out = {k: torch.zeros_like(v) for k, v in cache.items()}
        engine.submit(2, "load", items, out)
        assert engine.poll() == [(2, True)]
        assert all(torch.equal(out[k], cache[k]) for k in cache)


def test_R_E05_fewer_tokens_than_blocks_copies_only_the_tokens(region: torch.Tensor) -> None:
    engine = CpuCopyEngine(region, BLOCK)
    engine.submit(1, "save", [CopyItem("a", (4, 5, 6), 2)], {"a": encoder_output(2, 3)})
    assert engine.poll() == [(1, True)]
    assert not region.view(BLOCKS, BLOCK)[6].any(), "block 6 is not touched"


@pytest.mark.parametrize(
    ("items", "cache"),
    [
        ([CopyItem("missing", (0,), 1)], {}),
        ([CopyItem("a", (0, 1), 2)], {"a": encoder_output(1, 1)}),  # too few rows
        ([CopyItem("a", (0, BLOCKS), 2)], {"a": encoder_output(2, 1)}),  # outside the region
        ([CopyItem("a", (0,), 1)], {"a": torch.zeros(1, HIDDEN + 1, dtype=torch.bfloat16)}),
        ([CopyItem("a", (0, 1), 2)], {"a": encoder_output(2, 1).t()}),  # not contiguous
    ],
)
def test_R_E05_a_bad_batch_is_reported_failed_not_raised(
    region: torch.Tensor, items: list[CopyItem], cache: dict[str, torch.Tensor]
) -> None:
    engine = CpuCopyEngine(region, BLOCK)
    engine.submit(9, "save", items, cache)
    assert engine.poll() == [(9, False)]
    assert engine.failed_batches == 1
    assert not region.any(), "a failed batch writes nothing"


def test_R_E05_release_predicate_holds_an_end_event_back(region: torch.Tensor) -> None:
    held = {"slow"}
    engine = CpuCopyEngine(
        region, BLOCK, release=lambda bid, d, items: all(i.mm_hash not in held for i in items)
    )
    cache = {"slow": encoder_output(1, 1), "fast": encoder_output(1, 2)}
    engine.submit(1, "save", [CopyItem("slow", (0,), 1)], cache)
    engine.submit(2, "save", [CopyItem("fast", (1,), 1)], cache)
    assert engine.poll() == [(2, True)]
    assert engine.pending() == 1
    held.clear()
    assert engine.poll() == [(1, True)]


def test_R_E05_misuse_is_a_local_protocol_error_and_closed_fails_batches() -> None:
    with pytest.raises(LocalProtocolError, match="flat CPU uint8"):
        CpuCopyEngine(torch.zeros(4, 4, dtype=torch.uint8), 4)
    with pytest.raises(LocalProtocolError, match="holds no block"):
        CpuCopyEngine(torch.zeros(3, dtype=torch.uint8), 4)
    engine = CpuCopyEngine(torch.zeros(16, dtype=torch.uint8), 4)
    engine.close()
    engine.submit(1, "save", [CopyItem("a", (0,), 1)], {"a": torch.zeros(1, 4, dtype=torch.uint8)})
    assert engine.poll() == [(1, False)], "a closed engine fails the batch"


# -- the local tier over a real region ------------------------------------------------------


def test_R_E03_R_E04_R_E05_local_tier_over_a_real_region(tmp_path: Path) -> None:
    """Save on a producer step, load on a later step, through the real region and the CPU
    engine; shutdown's CloseRegion unmaps and unlinks the owner's region."""
    layout = ECLayout(HIDDEN, 2, BLOCKS * BLOCK)
    config = ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role="ec_both",
        ec_connector_extra_config={"ec_cpu_bytes": BLOCKS * BLOCK},
    )
    scheduler = ECCPUConnector.scheduler(config, layout)
    worker = ECCPUConnector.worker(config, layout)
    region = SharedRegion.create(
        "kvhandoff_ec_local_dp0.mmap", layout.region_bytes, shm_dir=str(tmp_path)
    )
    tensor: torch.Tensor | None = region.as_tensor()
    assert tensor is not None
    engine = CpuCopyEngine(tensor, BLOCK)
    cache: dict[str, torch.Tensor] = {}
    closed: list[CloseRegion] = []
    worker.bus.handle(
        CopyBlocks, lambda _i, e: engine.submit(e.batch_id, e.direction, e.items, cache)
    )
    worker.bus.handle(CloseRegion, lambda _i, e: closed.append(e))
    clock = VirtualClock()
    worker.register_region(region.addr, region.size, clock.now)

    def step() -> None:
        now = clock.advance(0.01)  # one engine step
        meta = scheduler.build_connector_meta(now)
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(now)
        worker.save_caches(now)
        for batch_id, ok in engine.poll():
            worker.on_copy_done(batch_id, now, ok=ok)
        scheduler.update_connector_output(worker.build_connector_worker_meta(now), now)

    source = encoder_output(5, 42)
    cache["img"] = source
    first = ECRequestInfo("r1", ("img",), mm_tokens=(5,))
    scheduler.update_state_after_alloc(first, 0, clock.now)
    step()
    assert scheduler.cache.state("img") == "ready"
    del cache["img"]  # the GPU encoder cache let it go
    second = ECRequestInfo("r2", ("img",), mm_tokens=(5,))
    assert scheduler.ensure_cache_available(second, 0, clock.now)
    cache["img"] = torch.empty(5, HIDDEN, dtype=torch.bfloat16)
    scheduler.update_state_after_alloc(second, 0, clock.now)
    step()
    assert same_bytes(cache["img"], source)
    assert scheduler.cache.state("img") == "ready", "unpinned after the load (R-E05)"
    worker.shutdown(clock.now)
    assert closed == [CloseRegion(unlink=True)]
    engine.close()
    tensor = None
    region.close()
    assert region.unlink() and not (tmp_path / "kvhandoff_ec_local_dp0.mmap").exists()
