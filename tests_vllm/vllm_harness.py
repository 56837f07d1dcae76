"""Building vLLM 0.33's real engine parts on CPU for the tier's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

BLOCK_SIZE = 32  # vLLM's CPU attention backend rejects 16
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def vllm_config(
    model_dir: Path,
    *,
    kv_connector: str,
    kv_role: str,
    kv_connector_module_path: str | None = None,
    extra_config: dict[str, Any] | None = None,
    kv_load_failure_policy: str = "fail",
    engine_id: str | None = None,
    kv_buffer_device: str = "cpu",
) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0)
    scheduler = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(
        block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, enable_prefix_caching=True
    )
    cache.kv_cache_layout = "LBHNC"  # set explicitly: the CPU worker supports this one
    transfer = KVTransferConfig(
        kv_connector=kv_connector,
        kv_connector_module_path=kv_connector_module_path,
        kv_role=kv_role,
        kv_buffer_device=kv_buffer_device,
        kv_connector_extra_config=extra_config or {},
        kv_load_failure_policy=kv_load_failure_policy,
        **({"engine_id": engine_id} if engine_id is not None else {}),
    )
    return VllmConfig(
        scheduler_config=scheduler,
        model_config=model,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )


def kv_cache_config(
    num_blocks: int = 100,
    layers: tuple[str, ...] = LAYERS,
    heads: int = 2,
    head_size: int = 16,
) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=head_size, dtype=torch.float32
    )
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(list(layers), spec)],
    )


def scheduler(config: Any, num_blocks: int = 100) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache_config(num_blocks),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


class StubRank:
    """A rank whose outputs the test scripts: the worker-role connector's own logic (block
    bookkeeping, failed receives) runs for real; no transport is needed to show it."""

    def __init__(self) -> None:
        self.metas: list[Any] = []
        self.outputs: list[Any] = []

    def start_load_kv(self, meta: Any) -> None:
        self.metas.append(meta)

    def get_finished(self) -> Any:
        return self.outputs.pop(0)


def worker_step(worker: Any, rank: StubRank, scheduler_output: Any, report: Any) -> Any:
    """vLLM's worker lifecycle for one step (the model-runner mixin's order): bind the
    metadata, start_load_kv, then the transfer results, load errors and worker metadata."""
    from vllm.v1.outputs import KVConnectorOutput

    worker.bind_connector_metadata(scheduler_output.kv_connector_metadata)
    worker.start_load_kv(None)
    rank.outputs.append(report)
    results = worker.get_transfer_results(scheduler_output.finished_req_ids)
    output = KVConnectorOutput(
        finished_sending=results.finished_sending,
        finished_recving=results.finished_recving,
        failed_recving=results.failed_recving,
        invalid_block_ids=worker.get_block_ids_with_load_errors(),
        kv_connector_worker_meta=worker.build_connector_worker_meta(),
    )
    worker.clear_connector_metadata()
    return output


def one_token(output: Any, request_ids: list[str], kv_output: Any = None) -> Any:
    """A step's model-runner output: one sampled token per scheduled request."""
    from vllm.v1.outputs import ModelRunnerOutput

    return ModelRunnerOutput(
        req_ids=request_ids,
        req_id_to_index={rid: i for i, rid in enumerate(request_ids)},
        sampled_token_ids=[[7] for _ in request_ids],
        kv_connector_output=kv_output,
    )


# -- worker-role connectors over real NIXL, one process each ----------------------------------

KV_HEADS = 2
HEAD_SIZE = 16


def block_values(request_id: str, layer: int, ordinal: int, rank: int, shape: Any) -> Any:
    """What P's "model" wrote into block `ordinal` of a request in `layer`, on TP rank
    `rank` whose block has `shape`: a per-(request, layer, block) base plus each element's
    index counted across the engine's ranks (rank `r`'s block follows rank `r - 1`'s). A
    transfer cuts blocks into contiguous chunks by TP ratio (R-T03), so the same formula
    holds on D at any TP size; exact in float32 (every value below 2**24)."""
    import hashlib

    import torch

    count = 1
    for size in shape:
        count *= int(size)
    digest = hashlib.blake2b(f"{request_id}/{layer}/{ordinal}".encode(), digest_size=2)
    base = (int.from_bytes(digest.digest(), "little") % 2048) * 8192
    assert count * (rank + 1) <= 8192, "the pattern's element index outgrew its range"
    first = base + rank * count
    return torch.arange(first, first + count, dtype=torch.float32).reshape(tuple(shape))


def worker_process(
    conn: Any,
    model_dir: str,
    kv_role: str,
    engine_id: str,
    extra: dict[str, Any],
    tp: int,
    rank: int,
) -> None:
    """A worker-role KVHandoffConnector in its own process: vLLM's worker lifecycle per
    step, its KV tensors in DRAM, its rank built by `register_kv_caches` over real NIXL.
    Answers the test over `conn`; only bytes and builtins cross."""
    import os

    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import msgspec
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffConnectorMetadata
    from kvhandoff.machines.push.meta import PushConnectorMeta

    config = vllm_config(
        Path(model_dir),
        kv_connector="KVHandoffConnector",
        kv_connector_module_path="kvhandoff.integrations.vllm",
        kv_role=kv_role,
        extra_config=extra,
        engine_id=engine_id,
    )
    config.parallel_config.tensor_parallel_size = tp
    config.parallel_config.rank = rank
    cache = kv_cache_config()
    worker = KVHandoffConnector(config, KVConnectorRole.WORKER, cache)
    heads = KV_HEADS // tp
    # vLLM's CUDA layer layout with K and V first, heads before tokens in a block (HND,
    # which a heterogeneous-TP transfer needs: a TP chunk of a block is a head share)
    shape = (2, cache.num_blocks, heads, BLOCK_SIZE, HEAD_SIZE)
    kv = {name: torch.zeros(shape) for name in LAYERS}
    worker.register_kv_caches(kv)
    handshake = worker.get_handshake_metadata()
    conn.send(("ready", handshake.payload, handshake.tp_rank))
    layers = [part for tensor in kv.values() for part in tensor]  # K, V of each layer
    while True:
        cmd, *args = conn.recv()
        if cmd == "step":
            push = msgspec.msgpack.decode(args[0], type=PushConnectorMeta)
            for request_id, blocks in push.push_finished_blocks.items():
                for layer, tensor in enumerate(layers):
                    for ordinal, block in enumerate(blocks):
                        shape = tensor[block].shape
                        tensor[block].copy_(block_values(request_id, layer, ordinal, rank, shape))
            worker.bind_connector_metadata(KVHandoffConnectorMetadata(push))
            worker.start_load_kv(None)
            results = worker.get_transfer_results(set(args[1]))
            invalid = worker.get_block_ids_with_load_errors()
            meta = worker.build_connector_worker_meta()
            stats = worker.get_kv_connector_stats()  # the model runner asks after each step
            worker.clear_connector_metadata()
            outputs = [msgspec.msgpack.encode(o) for o in (meta.outputs if meta else ())]
            conn.send(
                (
                    set(results.finished_sending or ()),
                    set(results.finished_recving or ()),
                    set(results.failed_recving or ()),
                    invalid,
                    outputs,
                    msgspec.msgpack.encode(stats.data) if stats is not None else None,
                )
            )
        elif cmd == "verify":
            request_id, blocks = args
            ok = all(
                torch.equal(
                    tensor[block],
                    block_values(request_id, layer, ordinal, rank, tensor[block].shape),
                )
                for layer, tensor in enumerate(layers)
                for ordinal, block in enumerate(blocks)
            )
            conn.send(ok)
        elif cmd == "stop":
            worker.shutdown()
            conn.send("stopped")
            return


class WorkerProc:
    """The test's end of one `worker_process`."""

    def __init__(
        self,
        model_dir: Path,
        kv_role: str,
        engine_id: str,
        extra: dict[str, Any],
        tp: int = 1,
        rank: int = 0,
    ) -> None:
        from stock_vllm_common import worker_context

        # The tier's fork server (torch and vLLM preloaded once), never a plain fork: a
        # test process that already ran NIXL/UCX or ZMQ threads cannot be forked safely.
        context = worker_context()
        self.conn, child = context.Pipe()
        self.proc = context.Process(
            target=worker_process,
            args=(child, str(model_dir), kv_role, engine_id, extra, tp, rank),
            daemon=True,
        )
        self.proc.start()
        self.payload: bytes = b""
        self.tp_rank = rank

    def ready(self) -> Any:
        from kvhandoff.integrations.vllm import KVHandoffHandshakeMetadata

        tag, payload, tp_rank = self._recv()
        assert tag == "ready"
        return KVHandoffHandshakeMetadata(payload, tp_rank)

    def _recv(self, timeout: float = 240.0) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError("the worker process did not answer")
        return self.conn.recv()

    def step(self, meta_bytes: bytes, finished: set[str]) -> Any:
        self.conn.send(("step", meta_bytes, sorted(finished)))
        return self._recv()

    def verify(self, request_id: str, blocks: list[int]) -> bool:
        self.conn.send(("verify", request_id, blocks))
        return bool(self._recv())

    def stop(self) -> None:
        """Ask the worker to shut its connector down; `join` collects it."""
        if self.proc.is_alive():
            self.conn.send(("stop",))

    def join(self) -> None:
        if self.proc.is_alive() and self.conn.poll(60.0):
            self.conn.recv()
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


def engine_step(
    sched: Any,
    workers: list[WorkerProc],
    aggregator: Any,
    stats: list[Any] | None = None,
    emitted: list[Any] | None = None,
) -> tuple[Any, Any]:
    """One engine step of a real vLLM Scheduler with its workers in other processes:
    schedule, every worker's connector lifecycle (metadata as msgpack bytes), vLLM's own
    aggregation of their outputs (`aggregator`: one `KVOutputAggregator` per engine, it
    counts ranks across steps), then the scheduler's update. Returns (scheduler output,
    the aggregated KVConnectorOutput); each step's `SchedulerStats` vLLM made is appended
    to `stats` when given (the workers' connector stats are in them, as vLLM carries
    them), and each request's `EngineCoreOutput` (what vLLM's server answers from, its
    `kv_transfer_params` included) to `emitted`."""
    import msgspec
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvhandoff.integrations.vllm import KVHandoffConnectorStats, KVHandoffWorkerMetadata
    from kvhandoff.machines.push.meta import PushWorkerOutput

    out = sched.schedule()
    wire = msgspec.msgpack.encode(out.kv_connector_metadata.push)
    request_ids = list(out.num_scheduled_tokens)
    sampled = [
        [7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
        for r in request_ids
    ]
    runner_outputs = []
    for worker in workers:
        sending, recving, failed, invalid, outputs, worker_stats = worker.step(
            wire, out.finished_req_ids
        )
        meta = KVHandoffWorkerMetadata(
            [msgspec.msgpack.decode(o, type=PushWorkerOutput) for o in outputs]
        )
        kv_output = KVConnectorOutput(
            finished_sending=sending or None,
            finished_recving=recving or None,
            failed_recving=failed,
            invalid_block_ids=invalid,
            kv_connector_worker_meta=meta,
            kv_connector_stats=(
                KVHandoffConnectorStats(data=msgspec.msgpack.decode(worker_stats))
                if worker_stats is not None
                else None
            ),
        )
        runner_outputs.append(
            ModelRunnerOutput(
                req_ids=request_ids,
                req_id_to_index={r: i for i, r in enumerate(request_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kv_output,
            )
        )
    merged = aggregator.aggregate(runner_outputs)
    kv_output = merged.kv_connector_output
    engine_outputs = sched.update_from_output(out, merged)
    if stats is not None:
        stats.extend(
            o.scheduler_stats for o in engine_outputs.values() if o.scheduler_stats is not None
        )
    if emitted is not None:
        emitted.extend(out for o in engine_outputs.values() for out in o.outputs)
    return out, kv_output
