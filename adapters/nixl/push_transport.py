"""The real push transport: a NIXL agent for data and notifs, a ZMQ side channel for
handshakes (R-P06, R-P14, R-P15, B-03, B-08).

At construction the KV regions are registered once per physical allocation and the
local descriptor list is prepared once, in member-major order (R-P14). `connect` adds the
peer's agent, routes its regions by member and prepares its descriptor list once; every
WRITE then addresses blocks by descriptor index.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvhandoff.adapters.nixl.agent import NixlAgent, PreppedBlocks, XferHandle
from kvhandoff.adapters.push_transport import PeerInfo, TransferHandle, XferState
from kvhandoff.adapters.zmq.side_channel import SideChannelServer, fetch_handshake
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    HandshakePayload,
    accept_peer,
    encode_handshake,
)
from kvhandoff.protocol.member_routing import (
    LocalRegion,
    MemberLayout,
    RemoteRoute,
    derive_member_major_layout,
)


@dataclass(frozen=True, slots=True)
class _Peer:
    info: PeerInfo
    prepped: PreppedBlocks
    route: RemoteRoute


class NixlPushTransport:
    def __init__(
        self,
        engine_id: str,
        agent: NixlAgent,
        regions: Sequence[LocalRegion],
        *,
        compatibility_hash: str,
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        is_decoder: bool = False,
        mem: str = "DRAM",
        device_id: int = 0,
        physical_blocks_per_logical: int = 1,
        register_memory: bool = True,
    ) -> None:
        self.engine_id = engine_id
        self.agent = agent
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.mem = mem
        self.device_id = device_id
        self.physical_blocks_per_logical = physical_blocks_per_logical
        self.compatibility_hash = compatibility_hash
        self.layout: MemberLayout = derive_member_major_layout(
            regions, pp_size=pp_size, is_decoder=is_decoder
        )
        if mem not in ("DRAM", "VRAM"):
            raise LocalProtocolError(f"KV regions live in DRAM or VRAM, not {mem!r}")
        if register_memory:
            for alloc in self.layout.allocations:
                size = alloc.block_len * alloc.num_blocks
                if mem == "VRAM":
                    agent.register_vram(alloc.base_addr, size, device_id)
                else:
                    agent.register_dram(alloc.base_addr, size)
        self._local = agent.prep_local_blocks(
            [(s.base_addr, s.block_len, s.num_blocks) for s in self.layout.slots],
            mem,  # type: ignore[arg-type]
            device_id,
        )
        self._peers: dict[str, _Peer] = {}
        self._agent_to_engine: dict[str, str] = {}
        self._lock = threading.Lock()  # connect runs on the executor, use on the writer

    def handshake_payload(self) -> HandshakePayload:
        allocations = self.layout.allocations
        return HandshakePayload(
            protocol_version=HANDSHAKE_PROTOCOL_VERSION,
            engine_id=self.engine_id,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(),
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            kv_block_lens=tuple(a.block_len for a in allocations),
            num_blocks=tuple(a.num_blocks for a in allocations),
            region_base_addrs=tuple(a.base_addr for a in allocations),
            physical_blocks_per_logical=self.physical_blocks_per_logical,
            backend=self.agent.backend,
            compatibility_hash=self.compatibility_hash,
            region_members=self.layout.region_members,
        )

    def serve(self, host: str, port: int) -> SideChannelServer:
        """Serve this engine's handshake payload on the ZMQ side channel (R-P15)."""
        return SideChannelServer(host, port, lambda: encode_handshake(self.handshake_payload()))

    def fetch_handshake(self, host: str, port: int, timeout_s: float) -> bytes:
        return fetch_handshake(host, port, timeout_s)

    def connect(self, payload: HandshakePayload) -> PeerInfo:
        route = accept_peer(self.handshake_payload(), self.layout, payload)
        self.forget(payload.engine_id)
        agent_name = self.agent.add_remote(payload.agent_metadata)
        prepped = self.agent.prep_remote_blocks(
            agent_name,
            zip(payload.region_base_addrs, payload.kv_block_lens, payload.num_blocks, strict=True),
            self.mem,  # type: ignore[arg-type]
            self.device_id,
        )
        info = PeerInfo(
            engine_id=payload.engine_id,
            agent_name=agent_name,
            tp_size=payload.tp_size,
            physical_blocks_per_logical=payload.physical_blocks_per_logical,
            capacity=min(route.capacities),
        )
        with self._lock:
            self._peers[payload.engine_id] = _Peer(info, prepped, route)
            self._agent_to_engine[agent_name] = payload.engine_id
        return info

    def forget(self, engine_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(engine_id, None)
            if peer is not None:
                self._agent_to_engine.pop(peer.info.agent_name, None)
        if peer is not None:
            self.agent.remove_remote(peer.info.agent_name)

    def peer(self, engine_id: str) -> PeerInfo | None:
        with self._lock:
            peer = self._peers.get(engine_id)
        return None if peer is None else peer.info

    def _peer(self, engine_id: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(engine_id)
        if peer is None:
            raise LocalProtocolError(f"engine {engine_id!r} is not connected")
        return peer

    def _indices(
        self, engine_id: str, local_block_ids: Sequence[int], remote_block_ids: Sequence[int]
    ) -> tuple[_Peer, Any, Any]:
        """Descriptor indices of the same blocks in every routed region, on both sides."""
        peer = self._peer(engine_id)
        local_idx = self._local.layout.indices_for_blocks(local_block_ids)
        remote_idx = peer.prepped.layout.indices_for_blocks(
            remote_block_ids, regions=peer.route.regions
        )
        return peer, local_idx, remote_idx

    def send_notif(self, engine_id: str, message: bytes) -> None:
        self.agent.send_notif(self._peer(engine_id).info.agent_name, message)

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        return self.agent.get_new_notifs()

    def write_blocks(
        self,
        engine_id: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> TransferHandle:
        peer, local_idx, remote_idx = self._indices(engine_id, local_block_ids, remote_block_ids)
        return self.agent.write(self._local, local_idx, peer.prepped, remote_idx, notif)

    def read_blocks(
        self,
        engine_id: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> TransferHandle:
        peer, local_idx, remote_idx = self._indices(engine_id, local_block_ids, remote_block_ids)
        return self.agent.read(self._local, local_idx, peer.prepped, remote_idx, notif)

    def poll(self, handle: TransferHandle) -> XferState:
        assert isinstance(handle, XferHandle)
        return self.agent.poll(handle)

    def release(self, handle: TransferHandle) -> None:
        assert isinstance(handle, XferHandle)
        self.agent.release(handle)
