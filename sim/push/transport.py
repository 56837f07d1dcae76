"""The simulator's `PushTransport`, over a `SimNetwork` (deterministic simulation ONLY).

`SimPushTransport` implements `PushTransport` exactly as `NixlPushTransport` does: the
same methods with the same meaning, the same errors for the same misuse
(`LocalProtocolError` for an unconnected peer or block ids out of range,
`RemoteProtocolError` for an incompatible or mis-routed peer). Instead of a NIXL agent it
has:

- block memory of one rank: regions x blocks of bytes (`bytearray`s), one region per
  allocation, each backing one or more members (layer names, R-P14; a PP stage owns a
  slice of them), with fake addresses; a block holds this rank's share of the heads
  (`block_len` is the engine's block length divided by its TP size, R-T03);
- the handshake payload of the real protocol (`protocol/handshake.py`), served by the
  engine through the network's side-channel table and accepted with `accept_peer`
  (compatibility, then member routing), exactly as the real transport accepts them;
- notifs and transfers posted to the network, which delivers them when told to; a
  transfer copies one chunk of each block on each side (R-T03).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvhandoff.adapters.push_transport import (
    EngineInfo,
    RankInfo,
    Routes,
    TransferHandle,
    XferState,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    EngineHandshake,
    HandshakePayload,
    accept_peer,
    check_compatible,
    engine_bundle_parts,
)
from kvhandoff.protocol.member_routing import (
    LocalRegion,
    MemberLayout,
    RemoteRoute,
    derive_member_major_layout,
)
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk
from kvhandoff.sim.push.batch import SimWriteBatcher, sim_write_batcher
from kvhandoff.sim.push.errors import SimTransportError
from kvhandoff.sim.push.fabric import SimNetwork, SimTransfer

__all__ = ["SIM_BACKEND", "SimPushTransport"]

SIM_BACKEND = "SIM"


@dataclass(frozen=True, slots=True)
class _SimRank:
    route: RemoteRoute
    chunks: tuple[int, int]  # (local, remote) chunks per block


@dataclass(frozen=True, slots=True)
class _SimPeer:
    info: EngineInfo
    data: dict[int, _SimRank]


class SimPushTransport:
    """`PushTransport` of one rank over a `SimNetwork` (deterministic simulation only)."""

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
        pp_size: int = 1,
        pp_rank: int = 0,
        is_decoder: bool = False,
        physical_blocks_per_logical: int = 1,
        agent_name: str | None = None,
    ) -> None:
        self.network = network
        self.engine_id = engine_id
        self.agent_name = agent_name or network.new_agent_name(engine_id)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.pp_size, self.pp_rank = pp_size, pp_rank
        self.block_len = block_len
        self.num_blocks = num_blocks
        self.physical_blocks_per_logical = physical_blocks_per_logical
        self.compatibility_hash = compatibility_hash
        self.extensions: tuple[str, ...] = ()
        self.auth_key_id = ""
        self.alive = True
        base = network.next_address_base()
        self.regions = [
            LocalRegion(base + i * num_blocks * block_len, tuple(members), block_len, num_blocks)
            for i, members in enumerate(region_members)
        ]
        self.layout: MemberLayout = derive_member_major_layout(
            self.regions, pp_size=pp_size, is_decoder=is_decoder
        )
        self.memory = [bytearray(block_len * num_blocks) for _ in self.layout.allocations]
        self.inbox: deque[tuple[str, bytes]] = deque()
        self._peers: dict[str, _SimPeer] = {}
        self._agents: dict[str, tuple[str, int]] = {}
        self.batcher: SimWriteBatcher = sim_write_batcher(self)
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
            pp_size=self.pp_size,
            pp_rank=self.pp_rank,
            kv_block_lens=tuple(a.block_len for a in allocations),
            num_blocks=tuple(a.num_blocks for a in allocations),
            region_base_addrs=tuple(a.base_addr for a in allocations),
            physical_blocks_per_logical=self.physical_blocks_per_logical,
            backend=SIM_BACKEND,
            compatibility_hash=self.compatibility_hash,
            region_members=self.layout.region_members,
            extensions=self.extensions,
            auth_key_id=self.auth_key_id,
        )

    def advertise(self, extensions: Sequence[str], auth_key_id: str) -> None:
        self.extensions = tuple(extensions)
        self.auth_key_id = auth_key_id

    def fetch_handshake(
        self, host: str, port: int, timeout_s: float, ranks: Sequence[tuple[int, int]]
    ) -> list[bytes]:
        """Each rank's element of the engine bundle served at host:port, as one side-channel
        request per rank would get it (a rank the engine lacks fails like a timeout)."""
        self._check_alive("fetch_handshake")
        parts = engine_bundle_parts(self.network.fetch(self.engine_id, host, port))
        tp_size = 1 + max((tp for _, tp in ranks), default=0)
        try:
            return [parts[pp * tp_size + tp] for pp, tp in ranks]
        except IndexError:
            raise SimTransportError(f"no such rank at {host}:{port}") from None

    def connect(self, engine: EngineHandshake, routes: Routes) -> EngineInfo:
        self._check_alive("connect")
        local = self.handshake_payload()
        for payload in engine.ranks:
            check_compatible(local, payload, peer=engine.engine_id)
        data: dict[int, _SimRank] = {}
        for rank, chunks in routes.items():
            route = accept_peer(local, self.layout, engine.ranks[rank])
            _check_chunks(self.layout, route, chunks, engine.engine_id)
            data[rank] = _SimRank(route, chunks)
        self.forget(engine.engine_id)
        infos = tuple(
            RankInfo(
                p.rank,
                p.agent_name,
                p.physical_blocks_per_logical,
                min(data[p.rank].route.capacities) if p.rank in data else 0,
            )
            for p in engine.ranks
        )
        info = EngineInfo(
            engine.engine_id, engine.tp_size, engine.pp_size, engine.extensions, infos
        )
        self._peers[engine.engine_id] = _SimPeer(info, data)
        for rank_info in infos:
            self._agents[rank_info.agent_name] = (engine.engine_id, rank_info.rank)
        return info

    def forget(self, engine_id: str) -> None:
        peer = self._peers.pop(engine_id, None)
        if peer is not None:
            for rank_info in peer.info.ranks:
                self._agents.pop(rank_info.agent_name, None)

    def engine(self, engine_id: str) -> EngineInfo | None:
        peer = self._peers.get(engine_id)
        return None if peer is None else peer.info

    def identify(self, agent_name: str) -> tuple[str, int] | None:
        return self._agents.get(agent_name)

    def _peer(self, engine_id: str) -> _SimPeer:
        peer = self._peers.get(engine_id)
        if peer is None:
            raise LocalProtocolError(f"engine {engine_id!r} is not connected")
        return peer

    def _check_alive(self, op: str) -> None:
        if not self.alive:
            raise SimTransportError(f"{op}: agent {self.agent_name!r} is gone")

    # -- notifs -----------------------------------------------------------------------

    def send_notif(self, engine_id: str, rank: int, message: bytes) -> None:
        info = self._peer(engine_id).info
        if not 0 <= rank < len(info.ranks):
            raise LocalProtocolError(f"engine {engine_id!r} has no rank {rank}")
        self.network.post_notif(self, info.agent(rank), message)

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        self._check_alive("get_new_notifs")
        out = list(self.inbox)
        self.inbox.clear()
        return out

    # -- WRITE / READ -----------------------------------------------------------------

    def write_blocks(
        self,
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        *,
        local_chunk: Chunk = WHOLE,
        remote_chunk: Chunk = WHOLE,
    ) -> TransferHandle:
        write = self._transfer(
            "WRITE",
            engine_id,
            rank,
            local_block_ids,
            remote_block_ids,
            notif,
            local_chunk,
            remote_chunk,
            post=False,
        )
        return self.batcher.queue(write)  # B-13: posted by `flush_writes`

    def flush_writes(self) -> list[tuple[str, KvHandoffError]]:
        """B-13: one transfer per D agent for the WRITEs queued since the last flush."""
        return self.batcher.flush()

    write_poll_interval_s: float | None = None

    def complete_writes(self, now: float) -> int:
        return self.batcher.complete(now)

    def bind_bus(self, bus: EventBus) -> None:
        self.batcher.bind(bus)

    def progress(self) -> None:
        """The network delivers transfers when the world says so: nothing to do here."""

    def read_blocks(
        self,
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        *,
        local_chunk: Chunk = WHOLE,
        remote_chunk: Chunk = WHOLE,
    ) -> TransferHandle:
        return self._transfer(
            "READ",
            engine_id,
            rank,
            local_block_ids,
            remote_block_ids,
            notif,
            local_chunk,
            remote_chunk,
        )

    def _transfer(
        self,
        op: Literal["WRITE", "READ"],
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        local_chunk: Chunk,
        remote_chunk: Chunk,
        *,
        post: bool = True,
    ) -> SimTransfer:
        peer = self._peer(engine_id)
        data = peer.data.get(rank)
        if data is None:
            raise LocalProtocolError(f"rank {rank} of engine {engine_id!r} is not routed")
        if (local_chunk.count, remote_chunk.count) != data.chunks:
            raise LocalProtocolError(f"rank {rank} of {engine_id!r} is routed in {data.chunks}")
        local, remote = tuple(local_block_ids), tuple(remote_block_ids)
        if len(local) != len(remote) or not local:
            raise LocalProtocolError(
                f"{op} needs equal, non-empty block lists (got {len(local)} and {len(remote)})"
            )
        _check_range(local, min(self.layout.capacities), "local")
        _check_range(remote, min(data.route.capacities), f"engine {engine_id!r}")
        transfer = SimTransfer(
            op=op,
            src_engine=self.engine_id,
            src_agent=self.agent_name,
            dst_engine=engine_id,
            dst_agent=peer.info.agent(rank),
            local_ids=local,
            remote_ids=remote,
            pairs=tuple(
                (slot.allocation, region)
                for slot, region in zip(self.layout.slots, data.route.regions, strict=True)
            ),
            notif=bytes(notif),
            local_chunk=local_chunk,
            remote_chunk=remote_chunk,
        )
        if post:
            self.network.post_transfer(transfer)
        return transfer

    def poll(self, handle: TransferHandle) -> XferState:
        assert isinstance(handle, SimTransfer)
        if handle.op == "WRITE":
            return self.batcher.poll(handle)
        return handle.xfer_status

    def release(self, handle: TransferHandle) -> None:
        """Free a handle; one still in flight is cancelled (its data never lands)."""
        assert isinstance(handle, SimTransfer)
        if handle.op == "WRITE":
            self.batcher.release(handle)
            return
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

    def chunk(self, allocation: int, block_id: int, chunk: Chunk) -> bytes:
        offset, length = chunk.span(self.block_len)
        start = block_id * self.block_len + offset
        return bytes(self.memory[allocation][start : start + length])

    def write_chunk(self, allocation: int, block_id: int, chunk: Chunk, data: bytes) -> None:
        offset, length = chunk.span(self.block_len)
        start = block_id * self.block_len + offset
        self.memory[allocation][start : start + length] = data[:length]


def _check_range(ids: Sequence[int], capacity: int, whose: str) -> None:
    if min(ids) < 0 or max(ids) >= capacity:
        raise LocalProtocolError(f"block id out of range for {whose} (capacity {capacity})")


def _check_chunks(
    layout: MemberLayout, route: RemoteRoute, chunks: tuple[int, int], engine_id: str
) -> None:
    local, remote = chunks
    for slot, remote_len in zip(layout.slots, route.block_lens, strict=True):
        if (
            slot.block_len % local
            or remote_len % remote
            or (slot.block_len // local != remote_len // remote)
        ):
            raise RemoteProtocolError(
                f"member {slot.name!r}: blocks of {slot.block_len} / {remote_len} bytes do not"
                f" pair up in {local} / {remote} chunks",
                peer=engine_id,
            )
