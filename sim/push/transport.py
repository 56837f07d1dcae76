"""The simulator's `PushTransport`, over a `SimNetwork` (deterministic simulation ONLY).

`SimPushTransport` implements `PushTransport` exactly as `NixlPushTransport` does: the
same methods with the same meaning, the same errors for the same misuse
(`LocalProtocolError` for an unconnected peer or block ids out of range,
`RemoteProtocolError` for an incompatible or mis-routed peer). Instead of a NIXL agent
and a ZMQ side channel it has:

- block memory: regions x blocks of bytes (`bytearray`s), one region per allocation,
  each backing one or more members (layer names, R-P14), with fake addresses;
- the handshake payload of the real protocol (`protocol/handshake.py`), fetched through
  the network's side-channel table and accepted with `accept_peer` (compatibility, then
  member routing), exactly as the real transport accepts them;
- notifs and transfers posted to the network, which delivers them when told to.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvhandoff.adapters.push_transport import PeerInfo, TransferHandle, XferState
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    HandshakePayload,
    accept_peer,
)
from kvhandoff.protocol.member_routing import (
    LocalRegion,
    MemberLayout,
    RemoteRoute,
    derive_member_major_layout,
)
from kvhandoff.sim.push.errors import SimTransportError
from kvhandoff.sim.push.fabric import SimNetwork, SimTransfer

__all__ = ["SIM_BACKEND", "SimPushTransport"]

SIM_BACKEND = "SIM"


@dataclass(frozen=True, slots=True)
class _SimPeer:
    info: PeerInfo
    route: RemoteRoute
    block_lens: tuple[int, ...]


class SimPushTransport:
    """`PushTransport` over a `SimNetwork` (deterministic simulation only)."""

    def __init__(
        self,
        network: SimNetwork,
        engine_id: str,
        region_members: Sequence[Sequence[str]],
        *,
        num_blocks: int,
        block_len: int,
        compatibility_hash: str,
        tp_size: int = 1,
        tp_rank: int = 0,
        is_decoder: bool = False,
        physical_blocks_per_logical: int = 1,
        agent_name: str | None = None,
    ) -> None:
        self.network = network
        self.engine_id = engine_id
        self.agent_name = agent_name or network.new_agent_name(engine_id)
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self.block_len = block_len
        self.num_blocks = num_blocks
        self.physical_blocks_per_logical = physical_blocks_per_logical
        self.compatibility_hash = compatibility_hash
        self.alive = True
        base = network.next_address_base()
        self.regions = [
            LocalRegion(base + i * num_blocks * block_len, tuple(members), block_len, num_blocks)
            for i, members in enumerate(region_members)
        ]
        self.layout: MemberLayout = derive_member_major_layout(self.regions, is_decoder=is_decoder)
        self.memory = [bytearray(block_len * num_blocks) for _ in self.layout.allocations]
        self.inbox: deque[tuple[str, bytes]] = deque()
        self._peers: dict[str, _SimPeer] = {}
        network.attach(self)

    # -- the handshake (R-P15, R-P14) -------------------------------------------------

    def handshake_payload(self) -> HandshakePayload:
        allocations = self.layout.allocations
        return HandshakePayload(
            protocol_version=HANDSHAKE_PROTOCOL_VERSION,
            engine_id=self.engine_id,
            agent_name=self.agent_name,
            agent_metadata=b"sim-agent:" + self.agent_name.encode(),
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            kv_block_lens=tuple(a.block_len for a in allocations),
            num_blocks=tuple(a.num_blocks for a in allocations),
            region_base_addrs=tuple(a.base_addr for a in allocations),
            physical_blocks_per_logical=self.physical_blocks_per_logical,
            backend=SIM_BACKEND,
            compatibility_hash=self.compatibility_hash,
            region_members=self.layout.region_members,
        )

    def serve(self, host: str, port: int) -> None:
        self.network.serve(self, host, port)

    def fetch_handshake(self, host: str, port: int, timeout_s: float) -> bytes:
        self._check_alive("fetch_handshake")
        return self.network.fetch(self.engine_id, host, port)

    def connect(self, payload: HandshakePayload) -> PeerInfo:
        self._check_alive("connect")
        route = accept_peer(self.handshake_payload(), self.layout, payload)
        self.forget(payload.engine_id)
        info = PeerInfo(
            engine_id=payload.engine_id,
            agent_name=payload.agent_name,
            tp_size=payload.tp_size,
            physical_blocks_per_logical=payload.physical_blocks_per_logical,
            capacity=min(route.capacities),
        )
        self._peers[payload.engine_id] = _SimPeer(info, route, route.block_lens)
        return info

    def forget(self, engine_id: str) -> None:
        self._peers.pop(engine_id, None)

    def peer(self, engine_id: str) -> PeerInfo | None:
        peer = self._peers.get(engine_id)
        return None if peer is None else peer.info

    def _peer(self, engine_id: str) -> _SimPeer:
        peer = self._peers.get(engine_id)
        if peer is None:
            raise LocalProtocolError(f"engine {engine_id!r} is not connected")
        return peer

    def _check_alive(self, op: str) -> None:
        if not self.alive:
            raise SimTransportError(f"{op}: agent {self.agent_name!r} is gone")

    # -- notifs -----------------------------------------------------------------------

    def send_notif(self, engine_id: str, message: bytes) -> None:
        peer = self._peer(engine_id)
        self.network.post_notif(self, peer.info.agent_name, message)

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        self._check_alive("get_new_notifs")
        out = list(self.inbox)
        self.inbox.clear()
        return out

    # -- WRITE --------------------------------------------------------------------------

    def write_blocks(
        self,
        engine_id: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> TransferHandle:
        return self._transfer("WRITE", engine_id, local_block_ids, remote_block_ids, notif)

    def read_blocks(
        self,
        engine_id: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> TransferHandle:
        return self._transfer("READ", engine_id, local_block_ids, remote_block_ids, notif)

    def _transfer(
        self,
        op: Literal["WRITE", "READ"],
        engine_id: str,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> SimTransfer:
        peer = self._peer(engine_id)
        local, remote = tuple(local_block_ids), tuple(remote_block_ids)
        if len(local) != len(remote) or not local:
            raise LocalProtocolError(
                f"{op} needs equal, non-empty block lists (got {len(local)} and {len(remote)})"
            )
        _check_range(local, min(self.layout.capacities), "local")
        _check_range(remote, min(peer.route.capacities), f"engine {engine_id!r}")
        for slot, remote_len in zip(self.layout.slots, peer.block_lens, strict=True):
            if slot.block_len != remote_len:
                raise LocalProtocolError(
                    f"member {slot.name!r}: local block_len {slot.block_len} differs from "
                    f"{engine_id!r}'s {remote_len}"
                )
        transfer = SimTransfer(
            op=op,
            src_engine=self.engine_id,
            src_agent=self.agent_name,
            dst_engine=engine_id,
            dst_agent=peer.info.agent_name,
            local_ids=local,
            remote_ids=remote,
            pairs=tuple(
                (slot.allocation, region)
                for slot, region in zip(self.layout.slots, peer.route.regions, strict=True)
            ),
            notif=bytes(notif),
        )
        self.network.post_transfer(transfer)
        return transfer

    def poll(self, handle: TransferHandle) -> XferState:
        assert isinstance(handle, SimTransfer)
        return handle.xfer_status

    def release(self, handle: TransferHandle) -> None:
        """Free a handle; one still in flight is cancelled (its data never lands)."""
        assert isinstance(handle, SimTransfer)
        if handle.released:
            return
        if handle.xfer_status == "PROC":
            self.network.cancel(handle)
            handle.xfer_status = "ERR"
        handle.released = True

    # -- memory ---------------------------------------------------------------------------

    def block(self, allocation: int, block_id: int) -> bytearray:
        start = block_id * self.block_len
        return self.memory[allocation][start : start + self.block_len]

    def write_block(self, allocation: int, block_id: int, data: bytes) -> None:
        start = block_id * self.block_len
        self.memory[allocation][start : start + self.block_len] = data


def _check_range(ids: Sequence[int], capacity: int, whose: str) -> None:
    if min(ids) < 0 or max(ids) >= capacity:
        raise LocalProtocolError(f"block id out of range for {whose} (capacity {capacity})")
