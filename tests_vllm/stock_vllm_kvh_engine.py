"""A kvhandoff engine built from kvhandoff's own halves, for the interop tests (C-01, C-02).

The peer of a stock vLLM engine (`stock_vllm_push`), with the same test-facing surface
(`add_prefill`, `add_decode`, `step`, `read`, `legs`, ...), laid out as an engine lays it
out (R-T01): kvhandoff's `PushScheduler` (push or pull mode) and the side channel serving
the rank's handshake (the vLLM integration's `serve_handshakes`) in the test process, one
worker rank in a process of its own: `PushRank` over a NIXL agent, a `NixlPushTransport`
over per-layer CPU tensors shaped as a stock vLLM CPU worker's (regions by the integration's
`kv_regions`), its writer thread and handshake executor; optionally kvhandoff's fault
injection (`faults="write_fail=1"`). Scheduler and rank share nothing: each step the
scheduler's `PushConnectorMeta` goes to the rank as msgpack bytes and the rank's
`PushWorkerOutput` comes back as bytes.

No vLLM scheduler here: the engine hands out block ids itself. The transport gets vLLM's
compatibility factors of the stock engine's config (`VllmCompatFactors`: the hash, block
size, KV cache layout, attention backend), hybrid KV cache manager on as with vLLM's own
connector.
"""

from __future__ import annotations

import contextlib
import os
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from stock_vllm_common import (
    BLOCK_SHAPE,
    BLOCK_SIZE,
    CALL_TIMEOUT_S,
    LAYERS,
    Leg,
    fill_blocks,
    free_port,
    push_config,
    read_blocks,
    serve_commands,
    worker_context,
)

KVHANDOFF_DIRECT = ("kvhandoff-direct", None)
"""`connector_kind` of this engine (no vLLM connector at all)."""


def vllm_factors(model_dir: Path, mode: str) -> Any:
    """What a stock vLLM engine of this tier hashes (its config, its CPU attention backend,
    the hybrid KV cache manager on as with vLLM's own connector)."""
    from kvhandoff.protocol.vllm_compat import VllmCompatFactors

    config = push_config(model_dir, "kv_producer", "factors", {})
    return VllmCompatFactors.from_vllm_config(config, "CPU_ATTN", transfer_mode=mode)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- rank process


def _rank_main(
    conn: Connection,
    role: str,
    engine_id: str,
    num_blocks: int,
    factors: Any,
    mode: str,
    faults: str,
) -> None:
    serve_commands(
        conn,
        lambda: _Rank(role, engine_id, num_blocks, factors, mode, faults),
        lambda rank: rank.payload,
    )


class _Rank:
    def __init__(
        self,
        role: str,
        engine_id: str,
        num_blocks: int,
        factors: Any,
        mode: str,
        faults: str,
    ) -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        import secrets

        import torch

        from kvhandoff.adapters.clock import real_clock
        from kvhandoff.adapters.fault_injection import FaultPlan, faulty_transport_factory
        from kvhandoff.adapters.nixl.agent import NixlAgent
        from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
        from kvhandoff.adapters.push_rank import PushRank
        from kvhandoff.adapters.push_writer_thread import HandshakeExecutor, PushWriterThread
        from kvhandoff.integrations.vllm.nixl_rank import kv_regions
        from kvhandoff.protocol.handshake import encode_handshake

        self.caches = {
            name: torch.zeros((num_blocks, *BLOCK_SHAPE), dtype=torch.float32) for name in LAYERS
        }
        self.agent = NixlAgent(f"{engine_id}-r0-{secrets.token_hex(4)}", "UCX")
        transport_cls: type[NixlPushTransport] = NixlPushTransport
        if faults:  # e.g. "write_fail=1": kvhandoff's seeded fault injection
            transport_cls = faulty_transport_factory(FaultPlan.parse(faults), seed=0)
        self.transport = transport_cls(
            engine_id,
            self.agent,
            kv_regions(self.caches, num_blocks),
            vllm_factors=factors,  # vLLM's hash, block size, layout, attention backend
            is_decoder=role == "decode",
        )
        self.executor = HandshakeExecutor()
        self.rank = PushRank(
            role,  # type: ignore[arg-type]
            engine_id,
            self.transport,
            self.executor.submit,
            clock=real_clock,
            mode=mode,  # type: ignore[arg-type]
        )
        self.writer = PushWriterThread(self.rank).start()
        self.payload = encode_handshake(self.transport.handshake_payload())

    def step(self, meta: bytes) -> bytes:
        import msgspec

        from kvhandoff.machines.push.meta import PushConnectorMeta

        decoded = msgspec.msgpack.decode(meta, type=PushConnectorMeta)
        return msgspec.msgpack.encode(self.rank.step(decoded))

    def fill(self, fills: list[tuple[int, int, int]]) -> None:
        fill_blocks(self.caches, fills)

    def read(self, blocks: list[int]) -> list[bytes]:
        return read_blocks(self.caches, blocks)

    def state(self) -> dict[str, Any]:
        from kvhandoff.machines.rank.worker import RANK_KINDS

        rank = self.rank
        return {
            "live": {k.name: rank.bus.counters(k).live for k in RANK_KINDS},
            "rejected_notifs": rank.rejected_notifs(),
            "failed_transfers": rank.failed_transfers,
            "writer_alive": self.writer.alive,
        }

    def close(self) -> None:
        self.writer.stop()
        self.executor.shutdown()
        self.agent.close()


# --------------------------------------------------------------------------- the engine


class KvhandoffEngine:
    """kvhandoff's scheduler half here, its worker rank in a process (see the module)."""

    connector_kind = KVHANDOFF_DIRECT

    def __init__(
        self,
        model_dir: Path,
        role: str,
        engine_id: str,
        *,
        mode: str = "push",
        num_blocks: int = 64,
        faults: str = "",
    ) -> None:
        from kvhandoff.adapters.clock import real_clock
        from kvhandoff.integrations.vllm.nixl_rank import serve_handshakes
        from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler
        from kvhandoff.protocol.push_config import PushConfig

        self.role, self.engine_id, self.mode = role, engine_id, mode
        self.num_blocks = num_blocks
        self.host = "127.0.0.1"
        self.port = free_port()
        self.clock = real_clock
        self.factors = vllm_factors(model_dir, mode)
        context = worker_context()
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_rank_main,
            args=(
                child,
                role,
                engine_id,
                num_blocks,
                self.factors,
                mode,
                faults,
            ),
            name=f"kvhandoff-rank-{engine_id}",
            daemon=True,
        )
        self.process.start()
        child.close()
        try:
            payload = self._answer("ready")
            engine = LocalEngine(engine_id, self.host, self.port)
            self.side_channel = serve_handshakes(engine, [payload], 1)
            self.scheduler = PushScheduler(
                role,  # type: ignore[arg-type]
                engine,
                PushConfig(),
                mode,  # type: ignore[arg-type]
                now=self.clock(),
            )
        except BaseException:
            self._stop()
            raise
        self.free = list(range(1, num_blocks))  # block 0 stays unused, as vLLM's null block
        self.legs: dict[str, Leg] = {}
        self.errors: list[str] = []

    # -- the rank process

    def _answer(self, expect: str = "ok") -> Any:
        if not self.conn.poll(CALL_TIMEOUT_S):
            raise TimeoutError(f"kvhandoff rank {self.engine_id} did not answer")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"kvhandoff rank {self.engine_id} exited") from None
        if kind == "error":
            raise RuntimeError(f"kvhandoff rank {self.engine_id} failed:\n{value}")
        assert kind == expect, (kind, expect)
        return value

    def _call(self, cmd: str, *args: Any) -> Any:
        self.conn.send((cmd, args))
        return self._answer()

    # -- requests (the engine's own block manager: first free blocks)

    def _alloc(self, prompt_len: int) -> list[int]:
        n = -(-prompt_len // BLOCK_SIZE)
        assert len(self.free) >= n, "out of blocks"
        blocks, self.free = self.free[:n], self.free[n:]
        return blocks

    def add_prefill(self, request_id: str, tag: int, prompt_len: int) -> Leg:
        """P: the prefill "computes" its KV (the pattern), finishes, and is leased."""
        leg = Leg(request_id, tag, self._alloc(prompt_len))
        self.legs[request_id] = leg
        self._call("fill", [(b, tag, k) for k, b in enumerate(leg.blocks)])
        params = {"do_remote_decode": True, "do_remote_prefill": False}
        delay, leg.params = self.scheduler.request_finished(
            request_id, leg.blocks, params, self.clock()
        )
        assert delay, "a finished prefill with blocks is leased"
        leg.finished = True
        return leg

    def add_decode(
        self,
        request_id: str,
        tag: int,
        prompt_len: int,
        params: dict[str, Any],
        max_tokens: int = 2,
    ) -> Leg:
        leg = Leg(request_id, tag, self._alloc(prompt_len))
        self.legs[request_id] = leg
        self.scheduler.update_state_after_alloc(request_id, leg.blocks, dict(params), self.clock())
        return leg

    # -- stepping

    def step(self) -> Any:
        import msgspec

        from kvhandoff.machines.push.meta import PushWorkerOutput

        meta = self.scheduler.build_connector_meta(self.clock())
        raw = self._call("step", msgspec.msgpack.encode(meta))
        output = msgspec.msgpack.decode(raw, type=PushWorkerOutput)
        result = self.scheduler.update_connector_output([output], self.clock())
        for rid in result.finished_sending:
            leg = self.legs[rid]
            leg.finished_sending = True
            self.free.extend(leg.blocks)
        failed = set(result.failed_recving)
        if failed:
            self.errors.append(f"failed {sorted(failed)}")
        for rid in set(result.finished_recving) | failed:
            # D decodes and finishes at once: its blocks go back to the free list (their
            # bytes stay until another request takes them; the test reads them first)
            leg = self.legs[rid]
            leg.finished_recving = leg.finished = True
            self.free.extend(leg.blocks)
        return result

    # -- state

    def read(self, blocks: list[int]) -> list[bytes]:
        return list(self._call("read", list(blocks)))

    def worker_state(self) -> dict[str, Any]:
        return dict(self._call("state"))

    def free_blocks(self) -> int:
        return len(self.free)

    def all_blocks_free(self) -> bool:
        return len(set(self.free)) == self.num_blocks - 1

    def has_work(self) -> bool:
        return bool(self.scheduler.has_pending_push_work())

    def _stop(self) -> None:
        if self.process.is_alive():
            with contextlib.suppress(OSError, EOFError, RuntimeError, TimeoutError):
                self._call("close")
        self.conn.close()
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=30)

    def close(self) -> None:
        try:
            side_channel = getattr(self, "side_channel", None)
            if side_channel is not None:
                side_channel.close()
        finally:
            self._stop()
