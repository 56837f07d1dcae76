"""GPU-side throughput of the encoder-cache copy primitives, timed with CUDA events.

Where `kvhandoff bench ec` times the whole engine (host work included, submit to poll),
this times only the device work of each primitive on `--blocks` rows of `--block-size`
bytes between device memory and a host-registered buffer, scattered over a region twice
that size (medians of `--reps`):

- dma: one `copy_` of all the bytes (the pinned-copy baseline);
- dma_runs: one `copy_` per encoding of 512 contiguous rows;
- index_<word>: `index_copy_` (save) / `index_select` (load) on the region's device
  mapping, all rows in one launch, moving `complex128` (16-byte) or `int64` words;
- index_items: the same, one launch per encoding of 512 rows (what the engine does);
- triton: a row-copy Triton kernel (one program per row), when Triton imports.

Run on a GPU machine: `python3 -m kvhandoff.bench.probes.ec_kernel [--json]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch

from kvhandoff.adapters.cuda.runtime import DeviceArray

_cuda: Any = torch.cuda


def _time(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = _cuda.Event(enable_timing=True), _cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(float(start.elapsed_time(end)) / 1e3)
    return statistics.median(times)


def _triton_copy() -> Callable[..., None] | None:
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None

    @triton.jit  # type: ignore[untyped-decorator]
    def rows_kernel(
        dst: Any, src: Any, idx: Any, W: tl.constexpr, BLOCK: tl.constexpr, SCATTER: tl.constexpr
    ) -> None:
        row = tl.program_id(0)
        block = tl.load(idx + row)
        offs = tl.arange(0, BLOCK)
        mask = offs < W
        if SCATTER:
            x = tl.load(src + row * W + offs, mask=mask)
            tl.store(dst + block * W + offs, x, mask=mask)
        else:
            x = tl.load(src + block * W + offs, mask=mask)
            tl.store(dst + row * W + offs, x, mask=mask)

    def launch(dst: torch.Tensor, src: torch.Tensor, idx: torch.Tensor, scatter: bool) -> None:
        width = dst.shape[1]
        block = triton.next_power_of_2(width)
        rows_kernel[(idx.numel(),)](dst, src, idx, width, block, scatter, num_warps=4)

    return launch


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n, bs = args.blocks, args.block_size
    nbytes = n * bs
    region = torch.empty(2 * nbytes, dtype=torch.uint8)
    region.fill_(0)
    cudart = _cuda.cudart()
    assert cudart.cudaHostRegister(region.data_ptr(), region.numel(), 3) == cudart.cudaError.success
    mapped = torch.as_tensor(DeviceArray(region.data_ptr(), region.numel()), device="cuda")
    rows_u8 = mapped.view(2 * n, bs)
    host_rows = region.view(2 * n, bs)
    dev = torch.randint(0, 256, (n, bs), dtype=torch.uint8, device="cuda")
    index = torch.randperm(2 * n, device="cuda")[:n].contiguous()
    items = [index[i : i + 512] for i in range(0, n, 512)]
    out: dict[str, dict[str, float]] = {}

    def gbps(seconds: float) -> float:
        return round(float(nbytes) / seconds / 1e9, 2)

    def add(name: str, save: Callable[[], object], load: Callable[[], object]) -> None:
        out[name] = {"save": gbps(_time(save, args.reps)), "load": gbps(_time(load, args.reps))}
        print(f"{name:>16}: save {out[name]['save']:7.2f} GB/s, load {out[name]['load']:7.2f} GB/s")

    flat_host = region[:nbytes]
    flat_dev = dev.view(-1)
    add(
        "dma",
        lambda: flat_host.copy_(flat_dev, non_blocking=True),
        lambda: flat_dev.copy_(flat_host, non_blocking=True),
    )

    def runs(save: bool) -> None:
        for i in range(0, n, 512):
            h, d = host_rows[i : i + 512], dev[i : i + 512]
            (h.copy_(d, non_blocking=True) if save else d.copy_(h, non_blocking=True))

    add("dma_runs", lambda: runs(True), lambda: runs(False))
    for word in (torch.complex128, torch.int64):
        reg_w, dev_w = rows_u8.view(word), dev.view(word)
        name = f"index_{str(word).split('.')[-1]}"

        def save_words(r: torch.Tensor = reg_w, d: torch.Tensor = dev_w) -> object:
            return r.index_copy_(0, index, d)

        def load_words(r: torch.Tensor = reg_w, d: torch.Tensor = dev_w) -> object:
            return torch.index_select(r, 0, index, out=d)

        add(name, save_words, load_words)
    reg_w, dev_w = rows_u8.view(torch.complex128), dev.view(torch.complex128)

    def per_item(save: bool) -> None:
        for i, idx in enumerate(items):
            part = dev_w[i * 512 : i * 512 + idx.numel()]
            if save:
                reg_w.index_copy_(0, idx, part)
            else:
                torch.index_select(reg_w, 0, idx, out=part)

    add("index_items", lambda: per_item(True), lambda: per_item(False))
    triton_copy = _triton_copy()
    if triton_copy is not None:
        reg_i, dev_i = rows_u8.view(torch.int64), dev.view(torch.int64)
        check = dev_i.clone()
        triton_copy(reg_i, dev_i, index, True)
        triton_copy(check, reg_i, index, False)
        _cuda.synchronize()
        print("triton bytes ok:", bool(torch.equal(check, dev_i)))
        add(
            "triton",
            lambda: triton_copy(reg_i, dev_i, index, True),
            lambda: triton_copy(dev_i, reg_i, index, False),
        )
    else:
        print("triton: not importable")
    if args.json:
        print(json.dumps(out))
    cudart.cudaHostUnregister(region.data_ptr())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
