"""A stock vLLM 0.33.0 engine on CPU with its NIXL KV connector, for the interop tests
(C-01 push, C-02 pull, R-T01).

One engine is two processes, as vLLM lays it out:

- the scheduler process (here: the test process) holds vLLM's real v1 `Scheduler` with the
  scheduler-role connector (`NixlPushConnector`, or `NixlConnector` for pull); its
  handshake listener (vLLM's ZMQ ROUTER side channel) is started by
  `set_xfer_handshake_metadata_pp_aware`, fed with the payload the worker reported, as
  vLLM's engine core does;
- a worker process holds the worker-role connector, created by vLLM's
  `ensure_kv_transfer_initialized` after a one-rank gloo group is up, over real NIXL (UCX)
  with per-layer DRAM tensors `[blocks, heads, block_size, 2 * head_dim]` registered through
  `register_kv_caches()` (push: this starts vLLM's `nixl-push-writer` thread; vLLM's CPU
  worker pins the process to one core, the harness restores the affinity); every engine
  step runs through the model runner's no-forward path
  (`KVConnectorModelRunnerMixin.kv_connector_no_forward`).

The two share nothing: each step the scheduler's `SchedulerOutput` (with vLLM's
`NixlConnectorMetadata`) crosses a pipe pickled, as vLLM's executor broadcasts it to its
workers, and the worker's `KVConnectorOutput` comes back pickled. The harness stands in for
the model: a scheduled prefill "computes" its KV by writing a known pattern into its blocks
(`fill`), and a request whose prompt is complete samples one token.

Nothing here is copied from vLLM: it calls vLLM's public classes as its engine core and
model runner do.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stock_vllm_common import (
    BLOCK_SHAPE,
    BLOCK_SIZE,
    CALL_TIMEOUT_S,
    KVHANDOFF,
    LAYERS,
    STOCK,
    STOCK_PULL,
    Leg,
    block_pattern,
    free_port,
    pattern_bytes,
    push_config,
    run_until,
    worker_context,
)
from stock_vllm_worker import WorkerProcess

import vllm_harness

__all__ = [
    "BLOCK_SHAPE",
    "BLOCK_SIZE",
    "CALL_TIMEOUT_S",
    "KVHANDOFF",
    "LAYERS",
    "STOCK",
    "STOCK_PULL",
    "Leg",
    "StockVllmPushEngine",
    "VllmPushEngine",
    "block_pattern",
    "free_port",
    "pattern_bytes",
    "push_config",
    "run_until",
    "worker_context",
]


class VllmPushEngine:
    """A vLLM push engine: the real v1 Scheduler here, its worker in a process; vLLM's own
    `NixlPushConnector` (`STOCK`) or kvhandoff's connector (`KVHANDOFF`) in both roles."""

    def __init__(
        self,
        model_dir: Path,
        role: str,
        engine_id: str,
        *,
        num_blocks: int = 64,
        extra: dict[str, Any] | None = None,
        connector: tuple[str, str | None] = STOCK,
        worker: Any = None,
    ) -> None:
        """`worker`: builds the worker process (`WorkerProcess`'s arguments; the GPU
        bench's has its own KV geometry and device)."""
        assert role in ("prefill", "decode")
        self.connector_kind = connector
        self.role = role
        self.engine_id = engine_id
        self.num_blocks = num_blocks
        self.host = "127.0.0.1"
        self.port = free_port()
        kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
        extra = {"side_channel_host": self.host, "side_channel_port": self.port, **(extra or {})}
        make_worker = worker or WorkerProcess
        self.worker = make_worker(model_dir, kv_role, engine_id, num_blocks, extra, connector)
        try:
            saved = {k: os.environ.get(k) for k in _SIDE_CHANNEL_ENV}
            os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = self.host
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self.port)
            try:
                config = push_config(model_dir, kv_role, engine_id, extra, connector)
                self.scheduler = vllm_harness.scheduler(config, num_blocks)
                self.block_hasher = _block_hasher(config)
            finally:
                for key, value in saved.items():
                    if value is None:
                        os.environ.pop(key, None)
                    else:
                        os.environ[key] = value
            if connector in (STOCK, STOCK_PULL):
                port = self.scheduler.connector.connector_scheduler.side_channel_port
                assert port == self.port, (port, self.port)
            # what vLLM's engine core does once its workers registered their KV caches
            self.scheduler.connector.set_xfer_handshake_metadata_pp_aware(self.worker.handshake)
        except BaseException:
            self.worker.close()
            raise
        self.legs: dict[str, Leg] = {}
        self.steps = 0
        self.errors: list[str] = []
        self.bytes_transferred = 0  # what vLLM's NIXL telemetry counted on this engine

    # -- requests

    def add_prefill(self, request_id: str, tag: int, prompt_len: int) -> Leg:
        params = {"do_remote_decode": True, "do_remote_prefill": False}
        return self._add(request_id, tag, prompt_len, params, max_tokens=1)

    def add_decode(
        self,
        request_id: str,
        tag: int,
        prompt_len: int,
        params: dict[str, Any],
        max_tokens: int = 2,
        prompt_tag: int | None = None,
    ) -> Leg:
        """D: `prompt_tag` names an earlier request whose prompt this one repeats (a prefix
        cache hit on D)."""
        return self._add(request_id, tag, prompt_len, dict(params), max_tokens, prompt_tag)

    def _add(
        self,
        request_id: str,
        tag: int,
        prompt_len: int,
        params: dict[str, Any],
        max_tokens: int,
        prompt_tag: int | None = None,
    ) -> Leg:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=max_tokens, extra_args={"kv_transfer_params": params})
        seed = tag if prompt_tag is None else prompt_tag
        prompt = [3 + (seed * 7 + i) % 900 for i in range(prompt_len)]
        request = Request(request_id, prompt, sampling, None, block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        leg = Leg(request_id, tag)
        self.legs[request_id] = leg
        return leg

    # -- stepping

    def step(self) -> Any:
        """One engine step, as vLLM's engine core runs it (schedule, execute, update)."""
        from vllm.v1.outputs import ModelRunnerOutput

        out = self.scheduler.schedule()
        fills = self._forward_fills(out) if self.role == "prefill" else []
        kv_output = self.worker.call("step", out, fills)
        self._note_registrations(out)
        sampled = self._complete_prompts(out)
        req_ids = list(out.num_scheduled_tokens)
        model_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=[[7] if rid in sampled else [] for rid in req_ids],
            kv_connector_output=kv_output,
        )
        engine_outputs = self.scheduler.update_from_output(out, model_output)
        self.steps += 1
        if kv_output is not None:
            for rid in kv_output.finished_sending or ():
                if rid in self.legs:
                    self.legs[rid].finished_sending = True
            for rid in kv_output.finished_recving or ():
                if rid in self.legs:
                    self.legs[rid].finished_recving = True
            if kv_output.failed_recving or kv_output.invalid_block_ids:
                self.errors.append(
                    f"failed {kv_output.failed_recving} invalid {kv_output.invalid_block_ids}"
                )
            self._note_stats(kv_output.kv_connector_stats)
        for outputs in engine_outputs.values():
            for output in outputs.outputs:
                leg = self.legs.get(output.request_id)
                if leg is not None and output.finish_reason is not None:
                    leg.finished = True
                    leg.params = output.kv_transfer_params
        return kv_output

    def _note_stats(self, stats: Any) -> None:
        """vLLM's connector stats of the step: any failure it counted (failed transfer,
        notification or handshake, expired lease, notif after expiry) is an error."""
        data = getattr(stats, "data", None) or {}
        for key in _FAILURE_STATS:
            if data.get(key):
                self.errors.append(f"vLLM counted {key}: {len(data[key])}")
        self.bytes_transferred += sum(data.get("bytes_transferred") or ())

    def _forward_fills(self, out: Any) -> list[tuple[int, int, int]]:
        """The blocks this step's prefill computes, with their pattern (a stand-in for the
        model's forward writing KV)."""
        fills = []
        for rid, count in out.num_scheduled_tokens.items():
            leg = self.legs.get(rid)
            if leg is None or count <= 0:
                continue
            (blocks,) = self.scheduler.kv_cache_manager.get_block_ids(rid)
            leg.blocks = list(blocks)
            fills.extend((block, leg.tag, ordinal) for ordinal, block in enumerate(blocks))
        return fills

    def _note_registrations(self, out: Any) -> None:
        """D: the blocks each request receives into, from this step's metadata (vLLM's
        `reqs_to_recv`, push or pull; kvhandoff's registrations or pull reads)."""
        meta = out.kv_connector_metadata
        found: dict[str, list[int]] = {}
        for rid, req in getattr(meta, "reqs_to_recv", {}).items():
            (blocks,) = req.local_block_ids
            found[rid] = list(blocks)
        push = getattr(meta, "push", None)
        for table in (getattr(push, "push_registrations", {}), getattr(push, "pull_reads", {})):
            for rid, reg in table.items():
                found[rid] = list(reg.block_ids)
        for rid, blocks in found.items():
            if rid in self.legs and blocks:
                self.legs[rid].blocks = blocks

    def _complete_prompts(self, out: Any) -> set[str]:
        """Requests whose prompt is computed after this step sample a token (vLLM's
        scheduler has already advanced `num_computed_tokens` by the step's tokens)."""
        requests = self.scheduler.requests
        return {
            rid
            for rid in out.num_scheduled_tokens
            if (r := requests.get(rid)) is not None and r.num_computed_tokens >= r.num_prompt_tokens
        }

    # -- state

    def read(self, blocks: Iterable[int]) -> list[bytes]:
        return list(self.worker.call("read", list(blocks)))

    def worker_state(self) -> dict[str, Any]:
        return dict(self.worker.call("state"))

    def free_blocks(self) -> int:
        return int(self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks())

    def all_blocks_free(self) -> bool:
        return self.free_blocks() == self.num_blocks - 1  # block 0 is vLLM's null block

    def has_work(self) -> bool:
        return bool(
            self.scheduler.has_requests() or self.scheduler.connector.has_pending_push_work()
        )

    def close(self) -> None:
        try:
            self.scheduler.connector.shutdown()
        finally:
            self.worker.close()


def _block_hasher(config: Any) -> Any:
    """The request block hasher vLLM's engine core gives every request when prefix caching
    or a KV connector is on (what lets D find a prompt's blocks in its prefix cache)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(BLOCK_SIZE, hash_fn, config.num_hash_lookahead_tokens)


_FAILURE_STATS = (
    "num_failed_transfers",
    "num_failed_notifications",
    "num_failed_handshakes",
    "num_kv_expired_reqs",
    "num_notifications_after_expiry",
)
_SIDE_CHANNEL_ENV = ("VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT")


class StockVllmPushEngine(VllmPushEngine):
    """A stock vLLM 0.33.0 push engine (vLLM's `NixlPushConnector` in both roles)."""

    def __init__(self, model_dir: Path, role: str, engine_id: str, **kwargs: Any) -> None:
        super().__init__(model_dir, role, engine_id, connector=STOCK, **kwargs)
