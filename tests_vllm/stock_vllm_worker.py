"""One worker process of a vLLM engine (see `stock_vllm_push`): vLLM's worker-role KV
connector over real NIXL with per-layer DRAM tensors, stepped through the model runner's
no-forward path, answering the parent over a pipe (pickled calls, each bounded)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from stock_vllm_common import (
    CALL_TIMEOUT_S,
    LAYERS,
    fill_blocks,
    push_config,
    read_blocks,
    serve_commands,
    worker_context,
)

import vllm_harness


def _worker_main(
    conn: Connection,
    model_dir: str,
    kv_role: str,
    engine_id: str,
    num_blocks: int,
    extra: dict[str, Any],
    connector: tuple[str, str | None],
) -> None:
    """vLLM's worker-role connector in its own process; answers the parent's commands."""
    serve_commands(
        conn,
        lambda: _worker_setup(model_dir, kv_role, engine_id, num_blocks, extra, connector),
        lambda state: state.handshake,
    )


class _WorkerState:
    def __init__(self, config: Any, caches: dict[str, Any], handshake: Any, tmp: str) -> None:
        self.config = config
        self.caches = caches
        self.handshake = handshake
        self.tmp = tmp

    @property
    def connector(self) -> Any:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        return get_kv_transfer_group()

    def step(self, scheduler_output: Any, fills: list[tuple[int, int, int]]) -> Any:
        """One engine step: the "forward" writes the scheduled prefills' KV, then vLLM's
        connector lifecycle runs through the model runner's no-forward path."""
        from vllm.config import set_current_vllm_config
        from vllm.v1.worker.kv_connector_model_runner_mixin import (
            KVConnectorModelRunnerMixin,
        )

        self.fill(fills)
        with set_current_vllm_config(self.config):
            output = KVConnectorModelRunnerMixin.kv_connector_no_forward(
                scheduler_output, self.config
            )
        return output.kv_connector_output

    def fill(self, fills: list[tuple[int, int, int]]) -> None:
        fill_blocks(self.caches, fills)

    def read(self, blocks: list[int]) -> list[bytes]:
        return read_blocks(self.caches, blocks)

    def state(self) -> dict[str, Any]:
        """What the worker still holds (everything must drain after the transfers)."""
        if getattr(self.connector, "connector_worker", None) is None:
            return self._kvhandoff_state()
        worker = self.connector.connector_worker
        sending: dict[str, int] = {}
        writer = None
        if hasattr(worker, "_sending_transfers_lock"):  # push: the writer thread's WRITEs
            with worker._sending_transfers_lock:
                sending = {k: len(v) for k, v in worker._sending_transfers.items() if v}
            writer = worker._push_writer_thread
        return {
            "recving": sorted(worker._recving_metadata),
            "recving_transfers": sorted(k for k, v in worker._recving_transfers.items() if v),
            "sending": sending,
            "reqs_to_send": sorted(worker._reqs_to_send),
            "reqs_to_process": sorted(worker._reqs_to_process),
            "remote_engines": sorted(worker._remote_agents),
            "writer_alive": writer is None or writer.is_alive(),
        }

    def _kvhandoff_state(self) -> dict[str, Any]:
        from kvhandoff.machines.rank.worker import RANK_KINDS

        rank = self.connector.rank
        assert rank is not None, "register_kv_caches built no kvhandoff rank"
        return {
            "live": {k.name: rank.bus.counters(k).live for k in RANK_KINDS},
            "rejected_notifs": rank.rejected_notifs(),
            "failed_transfers": rank.failed_transfers,
        }

    def close(self) -> None:
        import torch.distributed as dist
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _worker_setup(
    model_dir: str,
    kv_role: str,
    engine_id: str,
    num_blocks: int,
    extra: dict[str, Any],
    connector: tuple[str, str | None],
    *,
    layers: tuple[str, ...] = LAYERS,
    heads: int = vllm_harness.KV_HEADS,
    head_size: int = vllm_harness.HEAD_SIZE,
    device: str = "cpu",
) -> _WorkerState:
    """The worker-role connector over per-layer KV tensors `[blocks, heads, block_size,
    2 * head_size]` on `device` (the GPU bench: CUDA tensors, registered as VRAM)."""
    os.environ["VLLM_TARGET_DEVICE"] = "cpu"
    affinity = os.sched_getaffinity(0)
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        ensure_kv_transfer_initialized,
        get_kv_transfer_group,
    )
    from vllm.distributed.parallel_state import (
        get_pp_group,
        get_tp_group,
        init_distributed_environment,
        initialize_model_parallel,
    )

    if device == "cuda":
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import utils

        # vLLM's CPU platform allows NIXL DRAM KV buffers only; these are CUDA tensors
        utils._NIXL_SUPPORTED_DEVICE["cpu"] = ("cpu", "cuda")
    config = push_config(Path(model_dir), kv_role, engine_id, extra, connector, device)
    kv_config = vllm_harness.kv_cache_config(num_blocks, layers, heads, head_size)
    tmp = tempfile.mkdtemp(prefix="stock-vllm-gloo-")
    with set_current_vllm_config(config):
        # a one-rank gloo group: no port of its own (a file rendezvous)
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{tmp}/rendezvous",
            local_rank=0,
            backend="gloo",
        )
        initialize_model_parallel(1, 1)
        ensure_kv_transfer_initialized(config, kv_config)
    # vLLM's CPU worker pins the process to one core per NUMA node for KV transfers
    os.sched_setaffinity(0, affinity)
    shape = (num_blocks, heads, vllm_harness.BLOCK_SIZE, 2 * head_size)
    caches = {name: torch.zeros(shape, dtype=torch.float32, device=device) for name in layers}
    connector = get_kv_transfer_group()
    connector.register_kv_caches(caches)
    key = (get_pp_group().rank_in_group, get_tp_group().rank_in_group)
    return _WorkerState(config, caches, {key: connector.get_handshake_metadata()}, tmp)


class WorkerProcess:
    """The parent's handle on one worker process: pickled calls over a pipe, each bounded."""

    def __init__(
        self,
        model_dir: Path,
        kv_role: str,
        engine_id: str,
        num_blocks: int,
        extra: dict[str, Any],
        connector: tuple[str, str | None],
    ) -> None:
        context = worker_context()
        self.conn, child = context.Pipe()
        self.engine_id = engine_id
        self.process = context.Process(
            target=_worker_main,
            args=(child, str(model_dir), kv_role, engine_id, num_blocks, extra, connector),
            name=f"stock-vllm-worker-{engine_id}",
            daemon=True,
        )
        self.process.start()
        child.close()
        try:
            self.handshake = self._answer("ready")
        except BaseException:
            self.close()
            raise

    def _answer(self, expect: str = "ok") -> Any:
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"vLLM worker {self.engine_id} did not answer in {CALL_TIMEOUT_S}s")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"vLLM worker {self.engine_id} exited (code {self.process.exitcode})"
            ) from None
        if kind == "error":
            raise RuntimeError(f"vLLM worker {self.engine_id} failed:\n{value}")
        assert kind == expect, (kind, expect)
        return value

    def call(self, cmd: str, *args: Any) -> Any:
        self.conn.send((cmd, args))
        return self._answer()

    def close(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, RuntimeError, TimeoutError):
                self.call("close")
        self.conn.close()
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=30)
