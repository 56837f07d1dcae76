"""The vLLM connector's NIXL edges (R-T01, R-P15): a worker rank built from the KV tensors
vLLM registers, and the scheduler's side channel serving the ranks' handshake payloads.

Every wire call of the vLLM integration lives here, so a change of the push wire
(handshake payload, side channel) touches one file of the integration. No vLLM import.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.nixl.agent import NixlAgent
from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
from kvhandoff.adapters.push_rank import PushRank
from kvhandoff.adapters.push_writer_thread import HandshakeExecutor, PushWriterThread
from kvhandoff.adapters.zmq.side_channel import SideChannelServer
from kvhandoff.machines.push.scheduler import LocalEngine, Mode, Role
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.handshake import encode_handshake
from kvhandoff.protocol.member_routing import LocalRegion
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.vllm_compat import VllmCompatFactors

if TYPE_CHECKING:
    import torch

    from kvhandoff.adapters.cuda.ipc_transport import IpcPushTransport

__all__ = ["RankAssembly", "build_rank", "kv_regions", "serve_handshakes"]


def kv_regions(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[LocalRegion]:
    """One NIXL region per KV tensor (per K and V when a tensor splits them first): its
    first dimension, or its second after a leading 2, counts blocks; every block is
    contiguous (DRAM or VRAM, as the tensor lies)."""
    regions: list[LocalRegion] = []
    for name, tensor in kv_caches.items():
        if not tensor.is_contiguous():
            raise LocalProtocolError(f"KV tensor {name!r} is not contiguous")
        if tensor.shape[0] == num_blocks:
            parts = [(name, tensor)]
        elif tensor.dim() > 1 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks:
            parts = [(f"{name}.k", tensor[0]), (f"{name}.v", tensor[1])]
        else:
            raise LocalProtocolError(
                f"KV tensor {name!r} of shape {tuple(tensor.shape)} has no dimension of"
                f" {num_blocks} blocks first"
            )
        for member, part in parts:
            block_len = part.numel() * part.element_size() // num_blocks
            regions.append(LocalRegion(int(part.data_ptr()), (member,), block_len, num_blocks))
    return regions


@dataclass
class RankAssembly:
    """One worker rank over NIXL and what it started; `close` stops it all. `ipc` is the
    CUDA IPC wrapper the rank writes through when its KV is in VRAM (None: NIXL only)."""

    rank: PushRank
    agent: NixlAgent
    transport: NixlPushTransport
    writer: PushWriterThread
    executor: HandshakeExecutor
    ipc: IpcPushTransport | None = None

    def handshake_payload(self) -> bytes:
        return encode_handshake(self.transport.handshake_payload())

    def close(self) -> None:
        self.writer.stop()
        self.executor.shutdown()
        self.agent.close()


def build_rank(
    role: Role,
    engine_id: str,
    regions: Sequence[LocalRegion],
    config: PushConfig,
    factors: VllmCompatFactors,
    *,
    tp_rank: int = 0,
    mem: str = "DRAM",
    device: int = 0,
    clock: Clock = real_clock,
    mode: Mode = "push",
) -> RankAssembly:
    """A `PushRank` over a NIXL agent of its own whose regions are the rank's KV tensors,
    its writer thread and handshake executor started. With VRAM regions in push mode and
    `config.cuda_ipc`, the rank's transport is the CUDA IPC wrapper (GPU `device`): WRITEs
    to a kvhandoff D on the same host are one gather-scatter kernel per pass, NIXL the
    fallback for any other peer."""
    agent = NixlAgent(f"{engine_id}-r{tp_rank}-{secrets.token_hex(4)}", config.nixl_backend)
    try:
        transport = NixlPushTransport(
            engine_id,
            agent,
            regions,
            vllm_factors=factors,
            tp_size=config.tp_size,
            tp_rank=tp_rank,
            is_decoder=role == "decode",
            mem=mem,
            device_id=device,
        )
        ipc = None
        if mem == "VRAM" and mode == "push" and config.cuda_ipc:
            from kvhandoff.adapters.cuda.ipc_transport import IpcPushTransport

            ipc = IpcPushTransport(transport, device=device, export=role == "decode")
        executor = HandshakeExecutor()
        rank = PushRank(
            role,
            engine_id,
            transport if ipc is None else ipc,
            executor.submit,
            config=config,
            clock=clock,
            rank=tp_rank,
            mode=mode,
        )
    except BaseException:
        agent.close()
        raise
    writer = PushWriterThread(rank).start()
    return RankAssembly(rank, agent, transport, writer, executor, ipc)


def serve_handshakes(
    engine: LocalEngine, payloads: Sequence[bytes], tp_size: int
) -> SideChannelServer:
    """The engine's side channel, serving each rank's payload (global rank order,
    ``pp_rank * tp_size + tp_rank``) to whoever asks for that rank."""
    served = tuple(payloads)

    def provider(pp_rank: int, tp_rank: int) -> bytes | None:
        index = pp_rank * tp_size + tp_rank
        return served[index] if 0 <= tp_rank < tp_size and 0 <= index < len(served) else None

    return SideChannelServer(engine.host, engine.port, provider)
