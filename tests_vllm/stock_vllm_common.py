"""Shared pieces of the interop tier's engines (`stock_vllm_push`, `stock_vllm_worker`,
`stock_vllm_kvh_engine`): the KV geometry of the tiny model, the per-block pattern a
prefill "computes", the connector choices, the worker processes' start method, the
record of one request, and the bounded step loop."""

from __future__ import annotations

import multiprocessing
import socket
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import vllm_harness

BLOCK_SIZE = vllm_harness.BLOCK_SIZE
LAYERS = vllm_harness.LAYERS
KV_HEADS = 2
HEAD_DIM = 16
BLOCK_SHAPE = (KV_HEADS, BLOCK_SIZE, 2 * HEAD_DIM)  # one layer's block, LBHNC on CPU
BLOCK_ELEMS = KV_HEADS * BLOCK_SIZE * 2 * HEAD_DIM
CALL_TIMEOUT_S = 240.0  # bounded: a worker that does not answer fails the test by name


def free_port() -> int:
    """An ephemeral port the OS has just handed out (vLLM's listener binds a given port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def block_pattern(tag: int, ordinal: int, layer: int) -> Any:
    """The KV a prefill "computes" for block `ordinal` of request `tag` in `layer`: every
    element distinct inside the block, every (tag, ordinal, layer) its own range; exact in
    float32 (all values below 2**24)."""
    import torch

    base = ((tag * 64 + ordinal) * len(LAYERS) + layer) * BLOCK_ELEMS
    assert base + BLOCK_ELEMS < 2**24, "pattern leaves float32's exact integers"
    return (torch.arange(BLOCK_ELEMS, dtype=torch.float64) + base).float().reshape(BLOCK_SHAPE)


def fill_blocks(caches: dict[str, Any], fills: Iterable[tuple[int, int, int]]) -> None:
    """Write `block_pattern(tag, ordinal, layer)` into each (block, tag, ordinal)."""
    for block, tag, ordinal in fills:
        for layer, name in enumerate(LAYERS):
            caches[name][block].copy_(block_pattern(tag, ordinal, layer))


def read_blocks(caches: dict[str, Any], blocks: Iterable[int]) -> list[bytes]:
    """Each block's bytes, every layer in order (what a transfer must reproduce)."""
    return [b"".join(caches[name][block].numpy().tobytes() for name in LAYERS) for block in blocks]


def pattern_bytes(tag: int, ordinal: int) -> bytes:
    return b"".join(
        block_pattern(tag, ordinal, layer).numpy().tobytes() for layer in range(len(LAYERS))
    )


STOCK = ("NixlPushConnector", None)
"""vLLM 0.33.0's own push connector."""
STOCK_PULL = ("NixlConnector", None)
"""vLLM 0.33.0's own pull (READ) connector, `NixlConnector` = `NixlPullConnector`."""
KVHANDOFF = ("KVHandoffConnector", "kvhandoff.integrations.vllm")
"""kvhandoff's connector, loaded by vLLM by module path (C-05): the same engine, kvhandoff's
wire."""


def push_config(
    model_dir: Path,
    kv_role: str,
    engine_id: str,
    extra: dict[str, Any],
    connector: tuple[str, str | None] = STOCK,
    kv_buffer_device: str = "cpu",
) -> Any:
    name, module_path = connector
    config = vllm_harness.vllm_config(
        model_dir,
        kv_connector=name,
        kv_connector_module_path=module_path,
        kv_role=kv_role,
        extra_config=extra,
        kv_buffer_device=kv_buffer_device,
    )
    assert config.kv_transfer_config is not None
    config.kv_transfer_config.engine_id = engine_id
    return config


# --------------------------------------------------------------------------- worker process

# What every worker process imports first. The workers start from a fork server that
# imported these once (it runs no thread and holds no NIXL agent, ZMQ socket or torch
# thread pool, so forking it is safe): each engine then starts in about a second instead
# of re-importing torch and vLLM on two busy cores.
_PRELOAD = [
    "torch",
    "vllm.config",
    "vllm.distributed.parallel_state",
    "vllm.distributed.kv_transfer.kv_transfer_state",
    "vllm.distributed.kv_transfer.kv_connector.v1.nixl",
    "vllm.v1.worker.kv_connector_model_runner_mixin",
    "kvhandoff.adapters.push_rank",
    "kvhandoff.adapters.nixl.push_transport",
    "stock_vllm_worker",
    "stock_vllm_kvh_engine",
]


def worker_context() -> Any:
    """The multiprocessing context the engines' worker processes start from."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


@dataclass
class Leg:
    """One request on one engine, as the test follows it."""

    request_id: str
    tag: int
    blocks: list[int] = field(default_factory=list)
    params: dict[str, Any] | None = None  # P: the decode leg's kv_transfer_params
    finished: bool = False
    finished_sending: bool = False
    finished_recving: bool = False


def run_until(engines: Iterable[Any], done: Any, what: str, timeout_s: float = 180.0) -> int:
    """Step every engine in turn until `done()`; fail naming `what` after `timeout_s` (a
    bound, never a synchronisation: progress is what the steps observe)."""
    engines = list(engines)
    deadline = time.monotonic() + timeout_s
    rounds = 0
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {rounds} rounds waiting for {what}")
        for engine in engines:
            engine.step()
        rounds += 1
    return rounds


def serve_commands(conn: Connection, build: Callable[[], Any], ready: Callable[[Any], Any]) -> None:
    """A child process's loop: build its state (reporting a failure), send `ready(state)`,
    then answer `(cmd, args)` by calling `state.cmd(*args)` until `close` or EOF."""
    try:
        state = build()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ready", ready(state)))
    while True:
        try:
            cmd, args = conn.recv()
        except EOFError:
            break
        try:
            if cmd == "close":
                state.close()
                conn.send(("ok", None))
                break
            conn.send(("ok", getattr(state, cmd)(*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    conn.close()
