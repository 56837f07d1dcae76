"""P -> D through kvhandoff's `KVHandoffConnector` and through vLLM 0.33's own
`NixlPushConnector`, the same requests and KV layout, under vLLM's real Schedulers (issue
28): `bench/vllm_gpu.sh` runs it on the GPU machine, `--device cpu` runs it here.

Each engine is vLLM's v1 Scheduler in this process and one worker process holding the
worker-role connector, built by vLLM's `ensure_kv_transfer_initialized` as in
`stock_vllm_worker` (the harness's engines: `stock_vllm_push.VllmPushEngine`), with KV
tensors of the geometry asked for (`--layers`, `--heads`, `--head-dim`, float32) on
`--device`: one tensor per layer, `[blocks, heads, block_size, 2 * head_dim]`, the layer
layout of vLLM's CPU attention backend, which both connectors register as they find it.

vLLM runs on its CPU platform in every process (`VLLM_TARGET_DEVICE=cpu`): the `.py`
files carried to the GPU machine hold no compiled kernels (`vllm._C*`), which vLLM's CUDA
platform imports first. What differs from a CUDA engine, printed in the JSON (`differs`):
the attention backend is CPU_ATTN (its layout above, not FlashAttention's
`[2, blocks, block_size, heads, head_dim]`); with `--device cuda` the tensors are CUDA
tensors registered as VRAM (`kv_buffer_device: cuda`), which vLLM's NIXL utilities allow
for a CUDA platform only, so the worker adds "cuda" to the CPU platform's NIXL buffer
devices; no model forward: a prefill step "computes" its KV by writing a per-block pattern.

Measured per connector: from P's `request_finished` (vLLM's Scheduler calling the
connector when the prefill leg ends) to D's `finished_recving` (the step whose connector
output reports the request), p50/p99 in ms, and GB/s = bytes pushed / (first
`request_finished` to last `finished_recving`). D's leg is added as soon as P's ends
(the proxy's hand-off), for both connectors alike. A raw NIXL WRITE of `--raw-mib` between
two agents of one process is the ceiling. Every D block is checked against P's pattern
(on the device), both engines drain to every block free; one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, ClassVar

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from stock_vllm_common import KVHANDOFF, STOCK, Leg
from stock_vllm_worker import WorkerProcess

import vllm_harness

CONNECTORS = {"kvhandoff": KVHANDOFF, "vllm": STOCK, "kvhandoff_nixl": KVHANDOFF}
EXTRA: dict[str, dict[str, Any]] = {"kvhandoff_nixl": {"cuda_ipc": False}}
"""`kvhandoff_nixl`: kvhandoff's connector with CUDA IPC off, NIXL VRAM WRITEs only (the
fallback path, on the same transport vLLM's connector uses)."""


# --------------------------------------------------------------------------- worker side


def patterns(tag: int, ordinals: Any, layer: int, nbytes: int, device: Any) -> Any:
    """The bytes a prefill "computes" for blocks `ordinals` (a tensor) of one request and
    one layer, one row per block: distinct per word and per (request, block, layer), made
    on the device in one go (a few kernels per layer, not one per block)."""
    import torch

    seeds = ((tag * 4099 + ordinals) * 257 + layer) * 2654435761 % (1 << 31)
    words = torch.arange(nbytes // 4, dtype=torch.int64, device=device)
    rows = (words[None, :] * 40503 + seeds[:, None]) % (1 << 31)
    return rows.to(torch.int32).view(torch.uint8)


class BenchWorkerState:
    """The worker process's state: `stock_vllm_worker`'s lifecycle, the bench's caches."""

    def __init__(self, geometry: dict[str, Any], setup: Any) -> None:
        self.g = geometry
        self.inner = setup

    def step(self, scheduler_output: Any, fills: list[tuple[int, int, int]]) -> Any:
        self.fill(fills)
        return self.inner.step(scheduler_output, [])

    def fill(self, fills: list[tuple[int, int, int]]) -> None:
        import torch

        by_tag: dict[int, list[tuple[int, int]]] = {}
        for block, tag, ordinal in fills:
            by_tag.setdefault(tag, []).append((block, ordinal))
        for tag, pairs in by_tag.items():
            for layer, name in enumerate(self.g["layers"]):
                cache = self._bytes(name)
                blocks = torch.tensor([b for b, _ in pairs], device=cache.device)
                ordinals = torch.tensor([o for _, o in pairs], device=cache.device)
                cache[blocks] = patterns(tag, ordinals, layer, cache.shape[1], cache.device)
        if fills and self.g["device"] == "cuda":
            torch.cuda.synchronize()  # the WRITE reads VRAM outside torch's streams

    def verify(self, legs: list[tuple[list[int], int]]) -> bool:
        """Every block of every leg holds its pattern (one comparison per leg and layer)."""
        import torch

        for blocks, tag in legs:
            for layer, name in enumerate(self.g["layers"]):
                cache = self._bytes(name)
                index = torch.tensor(blocks, device=cache.device)
                ordinals = torch.arange(len(blocks), device=cache.device)
                want = patterns(tag, ordinals, layer, cache.shape[1], cache.device)
                if not torch.equal(cache[index], want):
                    return False
        return True

    def _bytes(self, name: str) -> Any:
        """Layer `name`'s KV as one row of bytes per block (a view)."""
        import torch

        cache = self.inner.caches[name]
        return cache.view(torch.uint8).reshape(cache.shape[0], -1)

    def state(self) -> Any:
        return self.inner.state()

    def paths(self) -> dict[str, Any]:
        """How kvhandoff's rank WROTE (CUDA IPC or NIXL, and why IPC was refused); {} for
        vLLM's connector."""
        assembly = getattr(self.inner.connector, "assembly", None)
        ipc = None if assembly is None else assembly.ipc
        if ipc is None:
            return {} if assembly is None else {"transport": "nixl"}
        stats = ipc.stats
        return {
            "transport": "cuda_ipc wrapper",
            "ipc_writes": stats.ipc_writes,
            "nixl_writes": stats.nixl_writes,
            "kernel": stats.kernel,
            "refused": dict(stats.refused_peers),
        }

    def close(self) -> None:
        self.inner.close()


def _bench_worker_main(conn: Any, args: tuple[Any, ...], geometry: dict[str, Any]) -> None:
    from stock_vllm_common import serve_commands

    serve_commands(conn, lambda: _bench_setup(args, geometry), lambda s: s.inner.handshake)


def _bench_setup(args: tuple[Any, ...], geometry: dict[str, Any]) -> BenchWorkerState:
    """`stock_vllm_worker`'s worker with the bench's geometry and device."""
    from stock_vllm_worker import _worker_setup

    inner = _worker_setup(
        *args,
        layers=tuple(geometry["layers"]),
        heads=geometry["heads"],
        head_size=geometry["head_dim"],
        device=geometry["device"],
    )
    return BenchWorkerState(geometry, inner)


class BenchWorker(WorkerProcess):
    """`WorkerProcess` running `_bench_worker_main` (the bench's geometry and device)."""

    geometry: ClassVar[dict[str, Any]] = {}

    def __init__(self, *args: Any) -> None:
        from stock_vllm_common import worker_context

        context = worker_context()
        self.conn, child = context.Pipe()
        self.engine_id = args[2]
        self.process = context.Process(
            target=_bench_worker_main, args=(child, args, self.geometry), daemon=True
        )
        self.process.start()
        child.close()
        try:
            self.handshake = self._answer("ready")
        except BaseException:
            self.close()
            raise


# --------------------------------------------------------------------------- one connector


def run_connector(name: str, model_dir: Path, opts: argparse.Namespace) -> dict[str, Any]:
    from stock_vllm_push import VllmPushEngine

    blocks_per_request = -(-opts.prompt // vllm_harness.BLOCK_SIZE)
    # Never a block reused in a run: D allocates a block more per request than the prompt
    # fills (its first decode token), and a finished request's blocks go back to the pool.
    num_blocks = (opts.requests + opts.warmup) * (blocks_per_request + 2) + 16
    kw = {
        "num_blocks": num_blocks,
        "connector": CONNECTORS[name],
        "worker": BenchWorker,
        "extra": EXTRA.get(name),
    }
    run = uuid.uuid4().hex[:6]
    p = VllmPushEngine(model_dir, "prefill", f"{name}-p-{run}", **kw)  # type: ignore[arg-type]
    try:
        d = VllmPushEngine(model_dir, "decode", f"{name}-d-{run}", **kw)  # type: ignore[arg-type]
    except BaseException:
        p.close()
        raise
    try:
        finished_at = _time_request_finished(p.scheduler.connector)
        if opts.warmup:  # handshakes, IPC mappings, kernel builds: once per engine pair
            warmup = argparse.Namespace(**{**vars(opts), "requests": opts.warmup})
            _measure(name, p, d, warmup, blocks_per_request, finished_at, base=5000)
        return _measure(name, p, d, opts, blocks_per_request, finished_at)
    finally:
        d.close()
        p.close()


def _time_request_finished(connector: Any) -> dict[str, float]:
    """When P's scheduler called `request_finished` for each request, stamped by wrapping
    the connector's hooks (once per engine pair: every pass adds its own ids)."""
    finished_at: dict[str, float] = {}
    for hook in ("request_finished", "request_finished_all_groups"):
        original = getattr(connector, hook)

        def timed(request: Any, *a: Any, _original: Any = original) -> Any:
            finished_at.setdefault(request.request_id, time.perf_counter())
            return _original(request, *a)

        setattr(connector, hook, timed)
    return finished_at


def _measure(
    name: str,
    p: Any,
    d: Any,
    opts: argparse.Namespace,
    bpr: int,
    finished_at: dict[str, float],
    *,
    base: int = 1000,
) -> dict[str, Any]:
    """One pass of `opts.requests` requests, tagged from `base` (a warm-up pass uses
    other tags)."""
    pairs = [(f"cmpl-{name}-{i}-{uuid.uuid4().hex[:8]}", base + i) for i in range(opts.requests)]
    d_ids = {p_id: f"{p_id.rsplit('-', 1)[0]}-{uuid.uuid4().hex[:8]}" for p_id, _ in pairs}
    p_legs = {p_id: p.add_prefill(p_id, tag, opts.prompt) for p_id, tag in pairs}
    d_legs: dict[str, Leg] = {}
    p_of = {d_id: p_id for p_id, d_id in d_ids.items()}
    received_at: dict[str, float] = {}
    verified = True
    deadline = time.monotonic() + opts.timeout
    while len(received_at) < opts.requests:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: {len(received_at)} of {opts.requests} received")
        p.step()
        for p_id, leg in p_legs.items():
            if leg.finished and leg.params is not None and p_id not in d_legs:
                d_legs[p_id] = d.add_decode(d_ids[p_id], leg.tag, opts.prompt, leg.params)
        kv_output = d.step()
        now = time.perf_counter()
        landed = []
        for rid in (kv_output.finished_recving or ()) if kv_output is not None else ():
            if rid not in received_at:
                received_at[rid] = now
                landed.append(d_legs[p_of[rid]])
        if landed:  # checked at once: the request still holds its blocks
            checked = d.worker.call("verify", [(leg.blocks, leg.tag) for leg in landed])
            verified = verified and bool(checked)
    while p.has_work() or d.has_work():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: the engines did not drain")
        p.step()
        d.step()
    legs = list(d_legs.values())
    assert all(len(leg.blocks) == bpr for leg in legs), [len(leg.blocks) for leg in legs]
    all_d_blocks = [b for leg in legs for b in leg.blocks]
    paths = p.worker.call("paths")
    latencies = [(received_at[d_ids[p_id]] - finished_at[p_id]) * 1e3 for p_id in p_legs]
    span = max(received_at.values()) - min(finished_at[p_id] for p_id in p_legs)
    block_bytes = len(BenchWorker.geometry["layers"]) * BenchWorker.geometry["block_bytes"]
    total = opts.requests * bpr * block_bytes
    return {
        "gbps": round(total / span / 1e9, 3),
        "p50_ms": round(statistics.median(latencies), 3),
        "p99_ms": round(_quantile(latencies, 0.99), 3),
        "bytes": total,
        "verified": verified,
        "d_blocks_reused": len(all_d_blocks) - len(set(all_d_blocks)),
        "all_blocks_free": bool(p.all_blocks_free() and d.all_blocks_free()),
        "errors": p.errors + d.errors,
        **({"p_writes": paths} if paths else {}),
    }


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# --------------------------------------------------------------------------- raw WRITE


def _raw_bytes(nbytes: int, device: str) -> Any:
    import torch

    words = torch.arange(nbytes // 8, dtype=torch.int64, device=device)
    return (words * 2654435761 % (1 << 61)).view(torch.uint8)


def _raw_target_main(conn: Any, nbytes: int, device: str) -> None:
    """The raw WRITE's destination, in a process of its own (as D's worker is): an agent
    over one zeroed buffer; answers "check" with whether the buffer holds the pattern."""
    import torch

    from kvhandoff.adapters.nixl.agent import NixlAgent

    dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    agent = NixlAgent(f"raw-d-{uuid.uuid4().hex[:6]}", "UCX")
    try:
        agent.register_tensor(dst)
        conn.send((agent.metadata(), int(dst.data_ptr())))
        while conn.recv() == "check":
            landed = bool(torch.equal(dst, _raw_bytes(nbytes, device)))
            dst.zero_()  # before answering: the next WRITE follows the answer
            if device == "cuda":
                torch.cuda.synchronize()
            conn.send(landed)
    finally:
        agent.close()


def raw_write(mib: int, device: str, reps: int = 3) -> dict[str, Any]:
    """One NIXL WRITE of `mib` MiB (UCX) from this process into a buffer of another one,
    as the connectors' WRITEs go from P's worker to D's: the best of `reps` after one
    warm-up, the bytes checked after each."""
    import multiprocessing

    import torch

    from kvhandoff.adapters.nixl.agent import NixlAgent

    nbytes = mib << 20
    src = _raw_bytes(nbytes, device)
    if device == "cuda":
        torch.cuda.synchronize()
    mem = "VRAM" if device == "cuda" else "DRAM"
    context = multiprocessing.get_context("spawn")
    conn, child = context.Pipe()
    target = context.Process(target=_raw_target_main, args=(child, nbytes, device), daemon=True)
    target.start()
    child.close()
    a = NixlAgent(f"raw-p-{uuid.uuid4().hex[:6]}", "UCX")
    try:
        metadata, dst_ptr = conn.recv()
        a.register_tensor(src)
        peer = a.add_remote(metadata)
        local = a.prep_local_blocks([(src.data_ptr(), nbytes, 1)], mem)  # type: ignore[arg-type]
        remote = a.prep_remote_blocks(peer, [(dst_ptr, nbytes, 1)], mem)  # type: ignore[arg-type]
        times, ok = [], True
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            handle = a.write(local, [0], remote, [0], b"raw")
            while (state := a.poll(handle)) == "PROC":
                pass
            times.append(time.perf_counter() - t0)
            a.release(handle)
            assert state == "DONE", state
            conn.send("check")
            ok = ok and bool(conn.recv())
        conn.send("stop")
    finally:
        a.close()
        target.join(timeout=30)
        if target.is_alive():
            target.kill()
    return {
        "gbps": round(nbytes / min(times[1:]) / 1e9, 3),
        "bytes": nbytes,
        "verified": ok,
        "between": "two processes",
    }


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a few small requests (tests)")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--prompt", type=int, default=None, help="tokens per request")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=None)
    parser.add_argument("--raw-mib", type=int, default=None)
    parser.add_argument(
        "--warmup", type=int, default=2, help="requests pushed first, not measured (per pair)"
    )
    parser.add_argument("--connectors", default="kvhandoff,vllm,kvhandoff_nixl")
    parser.add_argument("--timeout", type=float, default=300.0)
    opts = parser.parse_args(argv)
    tiny = opts.tiny
    defaults = (4, 100, 3, 2, 16, 16) if tiny else (16, 1000, 32, 8, 128, 1024)
    for key, value in zip(
        ("requests", "prompt", "layers", "heads", "head_dim", "raw_mib"), defaults, strict=True
    ):
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    assert opts.prompt < 1024, "the harness's max_model_len is 1024"
    BenchWorker.geometry = {
        "device": opts.device,
        "layers": [f"model.layers.{i}.self_attn.attn" for i in range(opts.layers)],
        "heads": opts.heads,
        "head_dim": opts.head_dim,
        "block_bytes": opts.heads * vllm_harness.BLOCK_SIZE * 2 * opts.head_dim * 4,
    }
    from kvhandoff.integrations.vllm.bench import TINY_LLAMA

    model_dir = Path(f"/tmp/kvh-gpu-bench-model-{os.getpid()}")
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    result: dict[str, Any] = {
        "device": opts.device,
        "requests": opts.requests,
        "prompt_tokens": opts.prompt,
        "geometry": {k: v for k, v in BenchWorker.geometry.items() if k != "layers"}
        | {"layers": opts.layers, "block_size": vllm_harness.BLOCK_SIZE, "dtype": "float32"},
        "differs": [
            "vLLM on its CPU platform (no compiled kernels carried): attention backend CPU_ATTN,"
            " KV per layer [blocks, heads, block_size, 2*head_dim]",
            "no model forward: a prefill step writes a per-block pattern into its blocks",
        ]
        + (
            [
                "CUDA tensors registered as VRAM (kv_buffer_device cuda, allowed on the CPU"
                " platform by a patch of vLLM's NIXL device table in the worker)"
            ]
            if opts.device == "cuda"
            else []
        ),
    }
    for name in opts.connectors.split(","):
        result[name] = run_connector(name, model_dir, opts)
    result["raw_write"] = raw_write(opts.raw_mib, opts.device)
    kvh, vl, raw = result.get("kvhandoff"), result.get("vllm"), result["raw_write"]
    if kvh and vl:
        result["kvhandoff_over_vllm_gbps"] = round(kvh["gbps"] / vl["gbps"], 3)
        result["vllm_over_kvhandoff_p50"] = round(vl["p50_ms"] / kvh["p50_ms"], 3)
    if kvh:
        result["kvhandoff_over_raw_gbps"] = round(kvh["gbps"] / raw["gbps"], 3)
    if result.get("kvhandoff_nixl") and vl:
        result["kvhandoff_nixl_over_vllm_gbps"] = round(
            result["kvhandoff_nixl"]["gbps"] / vl["gbps"], 3
        )
    if vl:
        result["vllm_over_raw_gbps"] = round(vl["gbps"] / raw["gbps"], 3)
    ok = all(
        r["verified"] and r.get("all_blocks_free", True) and not r.get("errors")
        for r in (result.get("kvhandoff"), result.get("vllm"), result.get("kvhandoff_nixl"), raw)
        if r
    )
    result["ok"] = ok
    print(json.dumps(result), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
