"""`kvhandoff bench push`: one side (P or D) in its own process — KV regions, a NIXL
agent, the push side and its writer thread, stepped like an idle engine between the
parent's commands (`bench/push_child.py`).
"""

from __future__ import annotations

import json
import secrets
import time
from typing import TYPE_CHECKING, Any

from kvhandoff.bench.push_kv import BenchKV, PushBenchConfig
from kvhandoff.demo.push_role import MARK

if TYPE_CHECKING:
    from kvhandoff.adapters.cuda.ipc_transport import IpcPushTransport
    from kvhandoff.adapters.nixl.agent import NixlAgent, PreppedBlocks
    from kvhandoff.adapters.push_side import PushSide
    from kvhandoff.adapters.push_writer_thread import PushWriterThread
    from kvhandoff.machines.push.meta import PushConnectorOutput


def emit(event: str, **fields: Any) -> None:
    print(MARK + json.dumps({"event": event, **fields}), flush=True)


class BenchSide:
    """P or D: KV regions, a NIXL agent, the push side, its writer thread."""

    def __init__(self, cfg: PushBenchConfig, role: str) -> None:
        import torch

        from kvhandoff.adapters.nixl.agent import NixlAgent
        from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
        from kvhandoff.adapters.push_side import PushSide
        from kvhandoff.adapters.push_writer_thread import HandshakeExecutor, PushWriterThread
        from kvhandoff.adapters.zmq.side_channel import SideChannelServer
        from kvhandoff.machines.push.scheduler import LocalEngine
        from kvhandoff.protocol.handshake import compatibility_hash
        from kvhandoff.protocol.push_config import PushConfig

        self.cfg = cfg
        self.role = role
        self.torch = torch
        # P on GPU 0; D on `peer_device` (issue 29: 0 is both on one GPU).
        self.gpu = cfg.peer_device if role == "decode" else 0
        self.device = (
            torch.device("cuda", self.gpu) if cfg.device == "cuda" else torch.device("cpu")
        )
        if cfg.device == "cuda":
            torch.cuda.set_device(self.device)
        self.kv = BenchKV(cfg, role, self.device)
        self.engine_id = f"bench-{role}"
        self.agent: NixlAgent = NixlAgent(
            f"{self.engine_id}-{secrets.token_hex(4)}",
            cfg.backend,
            progress_thread=cfg.progress_thread,
        )
        self.nixl = NixlPushTransport(
            self.engine_id,
            self.agent,
            self.kv.regions(),
            compatibility_hash=compatibility_hash(
                "kvhandoff-bench", "bench-model", "bfloat16", cfg.block_len
            ),
            is_decoder=role == "decode",
            mem="VRAM" if cfg.device == "cuda" else "DRAM",
            device_id=self.gpu,
        )
        self.nixl.batcher.post_every = cfg.nixl_post_every
        self.transport: NixlPushTransport | IpcPushTransport = self.nixl
        if cfg.transport == "cuda_ipc":
            from kvhandoff.adapters.cuda.ipc_transport import IpcPushTransport

            self.transport = IpcPushTransport(
                self.nixl,
                device=self.gpu,
                export=role == "decode",
                launch_every=cfg.ipc_launch_every,
                poll_interval_s=cfg.ipc_poll_us * 1e-6,
                wait_launches=cfg.ipc_wait,
                kernel=cfg.ipc_kernel,  # type: ignore[arg-type]
                cross_device=cfg.ipc_cross_device,  # type: ignore[arg-type]
            )
        # The baseline buffers are registered before the side channel serves this agent's
        # metadata, so the peer loads them with the first handshake.
        words = cfg.pushed_bytes // 8
        self.baseline = torch.empty(words, dtype=torch.int64, device=self.device)
        self.agent.register_tensor(self.baseline)
        self.executor = HandshakeExecutor()
        sides: list[PushSide] = []
        self.server = SideChannelServer(
            "127.0.0.1", 0, lambda pp, tp: sides[0].rank_payload(pp, tp)
        )
        self.local_engine = LocalEngine(self.engine_id, "127.0.0.1", self.server.port)
        self.side: PushSide = PushSide(
            role,  # type: ignore[arg-type]
            self.local_engine,
            self.transport,
            self.executor.submit,
            config=PushConfig(nixl_backend=cfg.backend),
        )
        sides.append(self.side)
        self._writer_type = PushWriterThread
        self.writer: PushWriterThread | None = PushWriterThread(self.side.ranks[0]).start()
        self.suffix = secrets.token_hex(4)
        self._baseline_descs: tuple[PreppedBlocks, PreppedBlocks] | None = None

    # engine-like helpers

    def step(self) -> PushConnectorOutput:
        return self.side.step()

    def idle(self) -> None:
        time.sleep(self.cfg.step_us / 1e6)

    def sync(self) -> None:
        if self.cfg.device == "cuda":
            self.torch.cuda.synchronize(self.device)

    def client_id(self, rep: int, q: int) -> str:
        return f"cmpl-bench{rep:04d}{q:05d}-0"

    def request_id(self, rep: int, q: int) -> str:
        return f"{self.client_id(rep, q)}-{self.suffix}"

    def stop_writer(self) -> None:
        if self.writer is not None:
            self.writer.stop()
            self.writer = None

    def start_writer(self) -> None:
        if self.writer is None:
            self.writer = self._writer_type(self.side.ranks[0]).start()

    def close(self) -> None:
        self.stop_writer()
        self.executor.shutdown()
        self.server.close()
        self.agent.close()

    def counters(self) -> dict[str, Any]:
        errors = 0 if self.writer is None else self.writer.errors
        counters: dict[str, Any] = {
            "rejected_notifs": self.side.rejected_notifs(),
            "failed_transfers": self.side.failed_transfers,
            "writer_errors": errors,
        }
        batcher = getattr(getattr(self.transport, "inner", self.transport), "batcher", None)
        if batcher is not None:  # B-13: NIXL transfers posted, request WRITEs they carried
            counters.update(
                nixl_batches=batcher.batches_posted, nixl_batched_writes=batcher.writes_batched
            )
        stats = getattr(self.transport, "stats", None)
        if stats is not None:
            counters.update(
                ipc_writes=stats.ipc_writes,
                nixl_writes=stats.nixl_writes,
                ipc_launches=stats.launches,
                ipc_kernel=stats.kernel,
                ipc_refused=dict(stats.refused_peers),
                ipc_routes=dict(stats.routes),
            )
        return counters

    def deadline(self) -> float:
        return time.monotonic() + self.cfg.timeout_s
