"""R-E05 on CUDA: `CudaCopyEngine` saves and loads token rows with the bytes verified.

Every copy method is checked on scattered and contiguous blocks, with row sizes that
select 16-, 8- and 2-byte words. Skipped, with the reason, where CUDA or cuda-python (the
`gpu` extra: `cuda.bindings` for the runtime calls, `cuda.core` for the row kernel) is
absent.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvhandoff.adapters.cuda import bindings
from kvhandoff.adapters.shm.region import SharedRegion
from kvhandoff.machines.ec.meta import CopyItem

if not torch.cuda.is_available():
    pytest.skip(
        f"CUDA not available: torch {torch.__version__} (CUDA build {torch.version.cuda}) "
        "sees no GPU; the CUDA copy engine runs on a GPU machine",
        allow_module_level=True,
    )
if not bindings.available():
    pytest.skip(
        "cuda-python is not installed: the CUDA copy engine needs kvhandoff[gpu]",
        allow_module_level=True,
    )

from kvhandoff.adapters.cuda.ec_copy import CudaCopyEngine, runs_of

pytestmark = pytest.mark.gpu

NUM_BLOCKS = 96


MakeRegion = Callable[[int], SharedRegion]


@pytest.fixture
def region_of() -> Iterator[MakeRegion]:
    made: list[SharedRegion] = []

    def make(block_size: int) -> SharedRegion:
        name = f"kvhandoff_ec_test_{secrets.token_hex(6)}.mmap"
        region = SharedRegion.create(name, NUM_BLOCKS * block_size)
        made.append(region)
        return region

    yield make
    for region in made:
        region.unlink()
        with contextlib.suppress(Exception):  # a tensor outlived the test: exit unmaps it
            region.close()


def _wait(engine: CudaCopyEngine, batch_id: int) -> bool:
    """Poll until the batch is reported (a hang guard, not a timing check)."""
    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        for done_id, ok in engine.poll():
            assert done_id == batch_id
            return ok
    raise AssertionError(f"batch {batch_id} never reported")


def _layout(contiguous: bool) -> list[list[int]]:
    """Blocks of three encodings (5, 17 and 40 tokens) inside the region."""
    sizes = (5, 17, 40)
    if contiguous:
        order = list(range(NUM_BLOCKS))
    else:
        gen = torch.Generator().manual_seed(7)
        order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    out, start = [], 0
    for size in sizes:
        out.append(order[start : start + size])
        start += size
    return out


def _bytes(tensor: torch.Tensor, block_size: int) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8).view(-1, block_size).cpu()


METHODS = ["auto", "row_kernel", "kernel", "runs", "per_block", "batch_memcpy"]
OPTIONAL = {"batch_memcpy", "row_kernel"}  # skipped, with the reason, where unavailable
# (dtype, hidden): 8 KiB rows (16-byte words), 8200-byte rows (8-byte words), 6-byte rows.
ROWS = [(torch.bfloat16, 4096), (torch.float32, 2050), (torch.float16, 3)]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("contiguous", [False, True], ids=["scattered", "contiguous"])
@pytest.mark.parametrize("dtype,hidden", ROWS, ids=["8KiB", "8200B", "6B"])
def test_R_E05_cuda_save_then_load_round_trips_bytes(
    region_of: MakeRegion, method: str, contiguous: bool, dtype: torch.dtype, hidden: int
) -> None:
    block_size = hidden * torch.tensor([], dtype=dtype).element_size()
    region = region_of(block_size)
    host = region.as_tensor()
    rows = host[: NUM_BLOCKS * block_size].view(NUM_BLOCKS, block_size)
    try:
        # first_rows=3: the first encoding is split over two groups (3 + 2 rows).
        engine = CudaCopyEngine(host, block_size, method=method, first_rows=3)  # type: ignore[arg-type]
    except Exception as exc:  # an optional method this machine may lack
        if method in OPTIONAL:
            pytest.skip(f"{method} unavailable here: {exc}")
        raise
    try:
        layout = _layout(contiguous)
        items = [CopyItem(f"mm-{i}", tuple(b), len(b)) for i, b in enumerate(layout)]
        # Sources computed on the caller's stream right before the save: the engine's
        # stream must wait for them.
        halves = block_size // 2
        cache = {
            item.mm_hash: torch.randint(
                -(2**15), 2**15, (item.num_tokens, halves), dtype=torch.int16, device="cuda"
            ).view(dtype)
            for item in items
        }
        rows.zero_()
        engine.submit(1, "save", items, cache)
        assert _wait(engine, 1) is True
        for item in items:
            expected = _bytes(cache[item.mm_hash], block_size)
            got = rows[torch.tensor(item.blocks)]
            assert torch.equal(got, expected), f"{method}: save of {item.mm_hash} differs"

        pattern = torch.randint(0, 256, (NUM_BLOCKS, block_size), dtype=torch.uint8)
        rows.copy_(pattern)
        for tensor in cache.values():
            tensor.view(torch.uint8).fill_(0xA5)
        engine.submit(2, "load", items, cache)
        assert _wait(engine, 2) is True
        for item in items:
            expected = pattern[torch.tensor(item.blocks)]
            got = _bytes(cache[item.mm_hash], block_size)
            assert torch.equal(got, expected), f"{method}: load of {item.mm_hash} differs"
        assert engine.in_flight() == 0
    finally:
        engine.close()
        del rows, host


def _round_trip(
    engine: CudaCopyEngine,
    rows: torch.Tensor,
    items: list[CopyItem],
    cache: dict[str, torch.Tensor],
    batch_id: int,
) -> None:
    """Save `items` from `cache`, then load them back into poisoned tensors; bytes checked."""
    block_size = rows.shape[1]
    rows.zero_()
    engine.submit(batch_id, "save", items, cache)
    assert _wait(engine, batch_id) is True
    for item in items:
        expected = _bytes(cache[item.mm_hash][: item.num_tokens], block_size)
        assert torch.equal(rows[torch.tensor(item.blocks[: item.num_tokens])], expected)
    pattern = torch.randint(0, 256, tuple(rows.shape), dtype=torch.uint8)
    rows.copy_(pattern)
    for tensor in cache.values():
        tensor.view(torch.uint8).fill_(0xA5)
    engine.submit(batch_id + 1, "load", items, cache)
    assert _wait(engine, batch_id + 1) is True
    for item in items:
        got = _bytes(cache[item.mm_hash][: item.num_tokens], block_size)
        assert torch.equal(got, pattern[torch.tensor(item.blocks[: item.num_tokens])])


def test_R_E05_cuda_auto_mixes_dma_runs_and_row_kernel_spans_in_one_group(
    region_of: MakeRegion,
) -> None:
    # One group (group_rows is large) of scattered, contiguous, scattered, offset (8-byte
    # aligned rows) and contiguous items: row-kernel spans are cut by the DMA items, and
    # the word size follows the least aligned row address of a span.
    block_size = 8192
    region = region_of(block_size)
    host = region.as_tensor()
    rows = host[: NUM_BLOCKS * block_size].view(NUM_BLOCKS, block_size)
    engine = CudaCopyEngine(host, block_size, dma_min_run_blocks=4, group_rows=10_000)
    try:
        gen = torch.Generator().manual_seed(3)
        scattered = torch.randperm(48, generator=gen).tolist()
        items = [
            CopyItem("s1", tuple(scattered[:10]), 10),
            CopyItem("c1", tuple(range(50, 62)), 12),
            CopyItem("s2", tuple(scattered[10:30]), 20),
            CopyItem("odd", (*scattered[30:36], 90, 91), 6),  # 8 blocks, 6 tokens
            CopyItem("c2", tuple(range(70, 78)), 8),
        ]
        cache = {
            item.mm_hash: torch.empty(
                (item.num_tokens, block_size), dtype=torch.uint8, device="cuda"
            )
            for item in items
        }
        backing = torch.empty(6 * block_size + 8, dtype=torch.uint8, device="cuda")
        cache["odd"] = backing[8:].view(6, block_size)  # rows aligned to 8 bytes only
        for tensor in cache.values():
            tensor.copy_(torch.randint(0, 256, tuple(tensor.shape), dtype=torch.uint8))
        _round_trip(engine, rows, items, cache, 1)
        _round_trip(engine, rows, [items[1], items[0], *items[2:]], cache, 3)  # c1 first
    finally:
        engine.close()
        del rows, host


def test_R_E05_cuda_strided_saves_and_failures_after_the_first_group(
    region_of: MakeRegion,
) -> None:
    block_size = 8192
    region = region_of(block_size)
    host = region.as_tensor()
    rows = host[: NUM_BLOCKS * block_size].view(NUM_BLOCKS, block_size)
    engine = CudaCopyEngine(host, block_size, first_rows=4)
    try:
        gen = torch.Generator().manual_seed(11)
        order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        wide = torch.randint(0, 256, (2, 12, 2 * block_size), dtype=torch.uint8, device="cuda")
        strided = {"w0": wide[0, :, :block_size], "w1": wide[1, :, block_size:]}
        dense = torch.randint(0, 256, (12, block_size), dtype=torch.uint8, device="cuda")
        for batch_id, names in ((1, ("d", "w1")), (2, ("w0", "d"))):
            cache = {"d": dense, **strided}
            items = [
                CopyItem(name, tuple(order[12 * i : 12 * i + 12]), 12)
                for i, name in enumerate(names)
            ]
            rows.zero_()
            engine.submit(batch_id, "save", items, cache)
            assert _wait(engine, batch_id) is True
            for item in items:
                got = rows[torch.tensor(item.blocks)]
                assert torch.equal(got, cache[item.mm_hash].cpu()), f"save of {item.mm_hash}"
        # Failures once the first group is on the device (a missing tensor, a block
        # outside the region): the batch is reported failed and the engine goes on.
        cache = {"d": dense}
        good = CopyItem("d", tuple(order[:12]), 12)
        engine.submit(5, "save", [good, CopyItem("gone", tuple(order[12:24]), 12)], cache)
        assert _wait(engine, 5) is False
        engine.submit(6, "load", [good, CopyItem("d", (*order[12:23], NUM_BLOCKS), 12)], cache)
        assert _wait(engine, 6) is False
        _round_trip(engine, rows, [good], {"d": dense}, 7)
    finally:
        engine.close()
        del rows, host


@pytest.mark.parametrize("method", ["kernel", "row_kernel"])
def test_R_E05_cuda_without_mapped_id_buffers_uploads_the_ids(
    region_of: MakeRegion, method: str
) -> None:
    block_size = 8192
    region = region_of(block_size)
    host = region.as_tensor()
    rows = host[: NUM_BLOCKS * block_size].view(NUM_BLOCKS, block_size)
    if method == "row_kernel":
        with pytest.raises(Exception, match="row kernel unavailable"):
            CudaCopyEngine(host, block_size, method="row_kernel", mapped_ids=False)
        assert not host.is_pinned(), "a failed start leaves the region unregistered"
        return
    engine = CudaCopyEngine(host, block_size, method="kernel", mapped_ids=False)
    try:
        gen = torch.Generator().manual_seed(5)
        order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
        items = [CopyItem("a", tuple(order[:30]), 30), CopyItem("b", tuple(order[30:50]), 20)]
        cache = {
            item.mm_hash: torch.randint(
                0, 256, (item.num_tokens, block_size), dtype=torch.uint8, device="cuda"
            )
            for item in items
        }
        _round_trip(engine, rows, items, cache, 1)
    finally:
        engine.close()
        del rows, host


def test_R_E05_cuda_many_batches_on_the_stream_pool(region_of: MakeRegion) -> None:
    block_size = 8192
    region = region_of(block_size)
    host = region.as_tensor()
    rows = host[: NUM_BLOCKS * block_size].view(NUM_BLOCKS, block_size)
    engine = CudaCopyEngine(host, block_size, streams=3)
    try:
        cache = {
            f"mm-{i}": torch.randint(0, 256, (8, block_size), dtype=torch.uint8, device="cuda")
            for i in range(12)
        }
        items = [CopyItem(f"mm-{i}", tuple(range(8 * i, 8 * i + 8)), 8) for i in range(12)]
        for i, item in enumerate(items):
            engine.submit(10 + i, "save", [item], cache)
        seen: dict[int, bool] = {}
        deadline = time.monotonic() + 60.0
        while len(seen) < len(items) and time.monotonic() < deadline:
            seen.update(engine.poll())
        assert seen == {10 + i: True for i in range(12)}
        for item in items:
            assert torch.equal(rows[list(item.blocks)], cache[item.mm_hash].cpu())
    finally:
        engine.close()
        del rows, host


def test_R_E05_cuda_bad_batches_are_reported_failed(region_of: MakeRegion) -> None:
    block_size = 8192
    region = region_of(block_size)
    host = region.as_tensor()
    engine = CudaCopyEngine(host, block_size)
    try:
        cache = {"a": torch.zeros((2, block_size), dtype=torch.uint8, device="cuda")}
        engine.submit(1, "save", [CopyItem("missing", (0, 1), 2)], cache)
        engine.submit(2, "save", [CopyItem("a", (0, NUM_BLOCKS), 2)], cache)
        engine.submit(3, "load", [CopyItem("a", (0, 1, 2), 3)], cache)  # tensor too short
        engine.submit(4, "save", [CopyItem("a", (4, 5), 2)], cache)
        seen: dict[int, bool] = {}
        deadline = time.monotonic() + 60.0
        while len(seen) < 4 and time.monotonic() < deadline:
            seen.update(engine.poll())
        assert seen == {1: False, 2: False, 3: False, 4: True}
    finally:
        engine.close()
        del host


def test_R_E05_cuda_row_kernel_compiles_through_cuda_core(region_of: MakeRegion) -> None:
    # The row kernel is optional above (skipped where unavailable): where cuda.core is
    # installed it must compile and load, so a broken cuda.core path cannot hide there.
    if bindings.core() is None:
        pytest.skip("cuda.core is not installed: auto falls back to torch indexing kernels")
    region = region_of(8192)
    host = region.as_tensor()
    engine = CudaCopyEngine(host, 8192, method="row_kernel")
    try:
        assert engine.row_kernel_unavailable == ""
        assert engine.batch_unavailable == "" or "12.8" in engine.batch_unavailable
    finally:
        engine.close()
        del host


def test_runs_of_splits_block_ids_into_consecutive_runs() -> None:
    import numpy as np

    starts, lengths = runs_of(np.array([3, 4, 5, 9, 1, 2, 7], dtype=np.int64))
    assert starts.tolist() == [0, 3, 4, 6]
    assert lengths.tolist() == [3, 1, 2, 1]
