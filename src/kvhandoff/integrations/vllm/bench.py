"""`kvhandoff bench vllm`: the scheduler-side connector's CPU time per engine step, with
many requests in flight, kvhandoff's `KVHandoffConnector` against vLLM 0.33's own push
connector (`NixlPushConnector`, scheduler role), each under vLLM's real `Scheduler` in the
same run (issue 17, item 4).

Both sides of a push are measured. D: every request waits in `WAITING_FOR_REMOTE_KVS`
for P's push; each step the "workers" report the oldest registered receives finished and
as many new decode legs arrive. P: every request is a finished prefill leg whose blocks
are leased; each step the workers report the oldest sends finished and as many new
prefill legs arrive. The steady state keeps `requests` in flight on each side. Only the
connector's hooks that vLLM's scheduler calls are timed, with the thread's CPU clock (the
timer's own cost per call, measured in the run, is subtracted from both alike); the
workers' reports are what each connector's own worker would send (kvhandoff's carries its
`PushWorkerOutput` too). The result is the mean per engine step over both sides, and per
hook (`hooks`: µs per step of each connector's hooks on each side, from the best round; a
hook called inside another counts in its caller's).

Needs vLLM (run it with `.venv-vllm/bin/kvhandoff bench vllm --json`): it raises
`RuntimeError` naming the fix when vLLM is missing. No NIXL transfer and no model run: no
GPU, weights or tokenizer; the model is a config-only tiny Llama made in a temp dir.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["TIMED_HOOKS", "run_vllm_bench"]

BLOCK_SIZE = 32
PROMPT_TOKENS = 2 * BLOCK_SIZE
LIFETIME_STEPS = 20  # steps a request stays in flight: `requests / LIFETIME_STEPS` finish a step

# The connector's scheduler-role hooks vLLM's Scheduler calls.
TIMED_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_push_work",
    "get_kv_connector_stats",
    "take_events",
    "get_finished_count",
    "update_state_after_free",
)

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CONNECTORS = {
    "kvhandoff": ("KVHandoffConnector", "kvhandoff.integrations.vllm"),
    "vllm": ("NixlPushConnector", None),
}


def _require_vllm() -> None:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "`kvhandoff bench vllm` needs vLLM 0.33 installed: run it from the vLLM tier's"
            " environment (`make vllm-tier` builds `.venv-vllm`, then"
            " `.venv-vllm/bin/kvhandoff bench vllm --json`)"
        ) from exc


def _scheduler(model_dir: Path, which: str, kv_role: str, requests: int) -> Any:
    import torch
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    name, module = CONNECTORS[which]
    num_blocks = 4 * requests + 64
    cache = CacheConfig(
        block_size=BLOCK_SIZE, gpu_memory_utilization=0.9, enable_prefix_caching=True
    )
    cache.kv_cache_layout = "LBHNC"
    cache.num_gpu_blocks = num_blocks
    batch = max(requests, 64)
    config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=batch,
            max_num_batched_tokens=batch * PROMPT_TOKENS,
            max_model_len=1024,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        model_config=ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float32", seed=0
        ),
        cache_config=cache,
        kv_transfer_config=KVTransferConfig(
            kv_connector=name,
            kv_connector_module_path=module,
            kv_role=kv_role,
            kv_buffer_device="cpu",
            kv_connector_extra_config={"side_channel_host": "127.0.0.1"},
        ),
        device_config=DeviceConfig("cpu"),
    )
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16, dtype=torch.float32
    )
    kv_cache = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layers, spec)],
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_cache,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK_SIZE,
    )


class _Timer:
    """CPU time spent inside the connector's hooks (outermost calls only)."""

    def __init__(self, connector: Any) -> None:
        self.ns = 0
        self.calls = 0
        self.by_hook: dict[str, list[int]] = {}  # hook -> [ns, calls], outermost calls
        self._depth = 0
        for name in TIMED_HOOKS:
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, self._wrap(name, method))

    def reset(self) -> None:
        self.ns = self.calls = 0
        self.by_hook = {}

    def _wrap(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.thread_time_ns

        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return method(*args, **kwargs)
            self._depth += 1
            start = clock()
            try:
                return method(*args, **kwargs)
            finally:
                spent = clock() - start
                self.ns += spent
                self.calls += 1
                entry = self.by_hook.setdefault(name, [0, 0])
                entry[0] += spent
                entry[1] += 1
                self._depth -= 1

        return timed


class _Workload:
    """One side's engine under steady load (see the module docstring)."""

    def __init__(self, model_dir: Path, which: str, side: str, requests: int) -> None:
        self.which = which
        self.side = side
        self.sched = _scheduler(
            model_dir, which, "kv_consumer" if side == "decode" else "kv_producer", requests
        )
        self.per_step = max(1, requests // LIFETIME_STEPS)
        self.serial = 0
        self.in_flight: deque[str] = deque()  # ids handed to the workers, oldest first
        self.finished = 0
        for _ in range(requests):
            self._add()
        self.timer = _Timer(self.sched.connector)

    def _add(self) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self.serial += 1
        request_id = f"cmpl-{self.which}-{self.serial}-0"
        if self.side == "decode":
            params: dict[str, Any] = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "prefill-0",
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
                "remote_request_id": request_id,
            }
        else:
            params = {"do_remote_decode": True, "do_remote_prefill": False}
        prompt = [3 + (self.serial * 7 + t) % 990 for t in range(PROMPT_TOKENS)]
        sampling = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
        self.sched.add_request(Request(request_id, prompt, sampling, None))

    def step(self) -> None:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        sched = self.sched
        out = sched.schedule()
        meta = out.kv_connector_metadata
        push = getattr(meta, "push", meta)
        handed = push.push_registrations if self.side == "decode" else push.push_finished_blocks
        self.in_flight.extend(handed)
        done = [self.in_flight.popleft() for _ in range(min(self.per_step, len(self.in_flight)))]
        kv_output = self._report(done, push)
        request_ids = list(out.num_scheduled_tokens)
        sampled = [
            [7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
            for r in request_ids
        ]
        sched.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=request_ids,
                req_id_to_index={r: i for i, r in enumerate(request_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=kv_output if kv_output is not None else KVConnectorOutput(),
            ),
        )
        self.finished += len(done)
        for _ in done:
            self._add()

    def _report(self, done: list[str], push: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        ids = set(done)
        key = "finished_recving" if self.side == "decode" else "finished_sending"
        worker_meta = None
        if self.which == "kvhandoff":
            from kvhandoff.integrations.vllm.records import KVHandoffWorkerMetadata
            from kvhandoff.machines.push.meta import PushWorkerOutput

            if self.side == "decode":
                report = PushWorkerOutput(rank=0, step=push.step, finished_recving=tuple(done))
            else:
                report = PushWorkerOutput(rank=0, step=push.step, finished_sending=tuple(done))
            worker_meta = KVHandoffWorkerMetadata([report])
        return KVConnectorOutput(**{key: ids or None}, kv_connector_worker_meta=worker_meta)


class _Nothing:
    def get_finished_count(self) -> None:
        return None


def _timer_overhead_ns(calls: int = 20000) -> float:
    """What the timer itself adds to one timed call (two clock reads and the wrapper),
    measured around a call that does nothing; subtracted from both connectors alike."""
    target = _Nothing()
    timer = _Timer(target)
    for _ in range(calls):
        target.get_finished_count()
    return timer.ns / calls


def _measure(
    model_dir: Path, which: str, side: str, requests: int, steps: int, overhead_ns: float
) -> tuple[float, dict[str, float]]:
    """Connector CPU µs per engine step, in steady state, less the timer's own cost; and
    the same per hook."""
    load = _Workload(model_dir, which, side, requests)
    for _ in range(2 * LIFETIME_STEPS):
        load.step()
    if len(load.in_flight) < requests // 2:
        raise RuntimeError(f"{which} {side}: only {len(load.in_flight)} requests in flight")
    load.timer.reset()
    for _ in range(steps):
        load.step()
    if len(load.sched.requests) < requests // 2:
        raise RuntimeError(f"{which} {side}: only {len(load.sched.requests)} requests held")
    hooks = {
        name: round(max(0.0, ns - overhead_ns * calls) / steps / 1000.0, 2)
        for name, (ns, calls) in sorted(load.timer.by_hook.items())
    }
    return max(0.0, load.timer.ns - overhead_ns * load.timer.calls) / steps / 1000.0, hooks


def run_vllm_bench(
    requests: int = 1000,
    steps: int = 200,
    rounds: int = 3,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Both connectors, both sides, `rounds` times interleaved; the best round of each."""
    _require_vllm()
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    best: dict[tuple[str, str], float] = {}
    best_hooks: dict[tuple[str, str], dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="kvhandoff-bench-vllm-") as tmp:
        model_dir = Path(tmp)
        (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
        overhead_ns = _timer_overhead_ns()
        for round_ in range(rounds):
            for side in ("decode", "prefill"):
                for which in ("kvhandoff", "vllm") if round_ % 2 == 0 else ("vllm", "kvhandoff"):
                    us, hooks = _measure(model_dir, which, side, requests, steps, overhead_ns)
                    key = (which, side)
                    if us <= best.get(key, us):
                        best[key], best_hooks[key] = us, hooks
                    if progress is not None:
                        progress(f"round {round_ + 1}: {which} {side}: {us:.1f} us/step")
    ours = (best[("kvhandoff", "decode")] + best[("kvhandoff", "prefill")]) / 2
    theirs = (best[("vllm", "decode")] + best[("vllm", "prefill")]) / 2
    return {
        "kvhandoff_us_per_step": round(ours, 2),
        "vllm_us_per_step": round(theirs, 2),
        "ratio": round(ours / theirs, 3),
        "by_side": {
            side: {
                "kvhandoff_us_per_step": round(best[("kvhandoff", side)], 2),
                "vllm_us_per_step": round(best[("vllm", side)], 2),
            }
            for side in ("decode", "prefill")
        },
        "hooks": {
            which: {side: best_hooks[(which, side)] for side in ("decode", "prefill")}
            for which in ("kvhandoff", "vllm")
        },
        "requests_in_flight": requests,
        "steps": steps,
        "rounds": rounds,
        "timer_overhead_ns_per_call": round(overhead_ns, 1),
        "vllm_connector": "NixlPushConnector (scheduler role)",
    }
