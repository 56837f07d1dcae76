"""The real push transport of one worker rank: a NIXL agent for data and notifs
(R-P06, R-P14, R-P15, R-T03, B-03, B-08).

At construction the rank's KV regions are registered once per physical allocation and
its local descriptor list is prepared in member-major order (R-P14). `connect` loads the
agent of every rank of a remote engine, and for each rank this one moves data with it
routes that rank's regions by member and prepares its descriptor list once, cut into the
chunks the TP mapping asks for (a P rank whose TP is smaller than D's writes each D rank
one chunk of its block; a larger one writes its whole block as one chunk of D's, R-T03).
Every WRITE then addresses (block, chunk) pairs by descriptor index; `write_blocks` queues
it and `flush_writes` (the end of a writer pass) posts one transfer per D rank for all
that was queued, completion notifs following once it is DONE (B-13, `push_batch.py`).
The engine's side channel (one per engine, `kvhandoff.adapters.zmq.side_channel`) serves
the ranks' payloads; this class only builds its own (`handshake_payload`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.nixl.agent import NixlAgent, PreppedBlocks, XferHandle
from kvhandoff.adapters.nixl.push_batch import BatchedWrite, NixlBatchIO, WriteBatcher
from kvhandoff.adapters.push_transport import (
    EngineInfo,
    RankInfo,
    Routes,
    TransferHandle,
    XferState,
)
from kvhandoff.adapters.zmq.side_channel import fetch_rank_handshakes
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    EngineHandshake,
    HandshakePayload,
    accept_peer,
    check_compatible,
)
from kvhandoff.protocol.member_routing import (
    LocalRegion,
    MemberLayout,
    RemoteRoute,
    derive_member_major_layout,
)
from kvhandoff.protocol.notif_bundle import (
    EXT_NOTIF_BUNDLE,
    decode_notif_bundle,
    encode_notif_bundle,
    is_notif_bundle,
)
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk
from kvhandoff.protocol.vllm_compat import VllmCompatFactors

log = logging.getLogger(__name__)


def _layout_facts(factors: VllmCompatFactors | None) -> dict[str, Any]:
    """Block size, KV layout and attention backend as a stock vLLM peer compares them."""
    if factors is None:
        return {}
    return {
        "block_size": factors.block_size,
        "kv_cache_layout": factors.kv_cache_layout,
        "attn_backend_name": factors.attn_backend_name,
    }


@dataclass(frozen=True, slots=True)
class _DataRank:
    prepped: PreppedBlocks
    route: RemoteRoute
    chunks: int  # chunks per remote block in `prepped`


@dataclass(frozen=True, slots=True)
class _Peer:
    info: EngineInfo
    data: dict[int, _DataRank]


class NixlPushTransport:
    def __init__(
        self,
        engine_id: str,
        agent: NixlAgent,
        regions: Sequence[LocalRegion],
        *,
        compatibility_hash: str | None = None,
        vllm_factors: VllmCompatFactors | None = None,
        block_size: int | None = None,
        kv_cache_layout: str | None = None,
        attn_backend_name: str | None = None,
        tp_size: int = 1,
        tp_rank: int = 0,
        pp_size: int = 1,
        pp_rank: int = 0,
        is_decoder: bool = False,
        mem: str = "DRAM",
        device_id: int = 0,
        physical_blocks_per_logical: int = 1,
        register_memory: bool = True,
    ) -> None:
        self.engine_id = engine_id
        self.agent = agent
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.pp_size, self.pp_rank = pp_size, pp_rank
        self.mem = mem
        self.device_id = device_id
        self.physical_blocks_per_logical = physical_blocks_per_logical
        if compatibility_hash is None:
            if vllm_factors is None:
                raise LocalProtocolError("a push transport needs a compatibility hash or factors")
            compatibility_hash = vllm_factors.compatibility_hash()
        self.compatibility_hash = compatibility_hash
        # C-01: the layout facts a stock vLLM peer compares at handshake time (explicit
        # arguments win over the factors').
        self.layout_facts = _layout_facts(vllm_factors)
        explicit = {
            "block_size": block_size,
            "kv_cache_layout": kv_cache_layout,
            "attn_backend_name": attn_backend_name,
        }
        self.layout_facts.update({k: v for k, v in explicit.items() if v is not None})
        self.extensions: tuple[str, ...] = ()
        self.auth_key_id = ""
        self.bundle_rejections = RejectionLog(log, what="notif bundle")
        """Malformed notif bundles dropped by `get_new_notifs` (B-13, S-01), counted per
        sender and logged rate-limited (S-06)."""
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
        self._lock = threading.Lock()  # connect runs on the executor, use on the writer
        self._local: dict[int, PreppedBlocks] = {1: self._prep_local(1)}
        self._peers: dict[str, _Peer] = {}
        self._agents: dict[str, tuple[str, int]] = {}
        self.batcher: WriteBatcher = WriteBatcher(NixlBatchIO(agent, self.send_notifs))

    @property
    def agent_name(self) -> str:
        return self.agent.name

    def _prep_local(self, chunks: int) -> PreppedBlocks:
        rows = []
        for slot in self.layout.slots:
            if slot.block_len % chunks:
                raise RemoteProtocolError(
                    f"a block of {slot.block_len} bytes does not split into {chunks} chunks"
                )
            rows.append((slot.base_addr, slot.block_len // chunks, slot.num_blocks * chunks))
        return self.agent.prep_local_blocks(rows, self.mem, self.device_id)  # type: ignore[arg-type]

    def handshake_payload(self) -> HandshakePayload:
        allocations = self.layout.allocations
        return HandshakePayload(
            protocol_version=HANDSHAKE_PROTOCOL_VERSION,
            engine_id=self.engine_id,
            agent_name=self.agent.name,
            agent_metadata=self.agent.metadata(),
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            pp_size=self.pp_size,
            pp_rank=self.pp_rank,
            kv_block_lens=tuple(a.block_len for a in allocations),
            num_blocks=tuple(a.num_blocks for a in allocations),
            region_base_addrs=tuple(a.base_addr for a in allocations),
            physical_blocks_per_logical=self.physical_blocks_per_logical,
            backend=self.agent.backend,
            compatibility_hash=self.compatibility_hash,
            region_members=self.layout.region_members,
            extensions=self.extensions,
            auth_key_id=self.auth_key_id,
            device_id=self.device_id,
            **self.layout_facts,
        )

    def advertise(self, extensions: Sequence[str], auth_key_id: str) -> None:
        """The rank's extensions, plus the ones this transport implements itself (it
        splits notif bundles, B-13)."""
        self.extensions = tuple(dict.fromkeys((*extensions, EXT_NOTIF_BUNDLE)))
        self.auth_key_id = auth_key_id

    def fetch_handshake(
        self, host: str, port: int, timeout_s: float, ranks: Sequence[tuple[int, int]]
    ) -> list[bytes]:
        return fetch_rank_handshakes(host, port, timeout_s, ranks)

    def connect(self, engine: EngineHandshake, routes: Routes) -> EngineInfo:
        local = self.handshake_payload()
        for payload in engine.ranks:
            check_compatible(local, payload, peer=engine.engine_id)
        plans: dict[int, tuple[RemoteRoute, int, int]] = {}
        for rank, (local_chunks, remote_chunks) in routes.items():
            payload = engine.ranks[rank]
            route = accept_peer(local, self.layout, payload)
            _check_chunks(self.layout, route, local_chunks, remote_chunks, engine.engine_id)
            plans[rank] = (route, local_chunks, remote_chunks)
        self.forget(engine.engine_id)
        names = [self.agent.add_remote(p.agent_metadata) for p in engine.ranks]
        data: dict[int, _DataRank] = {}
        infos = []
        for payload, name in zip(engine.ranks, names, strict=True):
            plan = plans.get(payload.rank)
            capacity = 0
            if plan is not None:
                route, local_chunks, remote_chunks = plan
                self._ensure_local(local_chunks)
                rows = [
                    (base, block_len // remote_chunks, blocks * remote_chunks)
                    for base, block_len, blocks in zip(
                        payload.region_base_addrs,
                        payload.kv_block_lens,
                        payload.num_blocks,
                        strict=True,
                    )
                ]
                prepped = self.agent.prep_remote_blocks(
                    name,
                    rows,
                    self.mem,  # type: ignore[arg-type]
                    payload.device_id,  # the GPU the peer registered them on (issue 29)
                )
                data[payload.rank] = _DataRank(prepped, route, remote_chunks)
                capacity = min(route.capacities)
            infos.append(
                RankInfo(payload.rank, name, payload.physical_blocks_per_logical, capacity)
            )
        info = EngineInfo(
            engine.engine_id, engine.tp_size, engine.pp_size, engine.extensions, tuple(infos)
        )
        with self._lock:
            self._peers[engine.engine_id] = _Peer(info, data)
            for rank_info in infos:
                self._agents[rank_info.agent_name] = (engine.engine_id, rank_info.rank)
        return info

    def _ensure_local(self, chunks: int) -> None:
        with self._lock:
            if chunks in self._local:
                return
        prepped = self._prep_local(chunks)
        with self._lock:
            self._local.setdefault(chunks, prepped)

    def forget(self, engine_id: str) -> None:
        with self._lock:
            peer = self._peers.pop(engine_id, None)
            if peer is not None:
                for rank_info in peer.info.ranks:
                    self._agents.pop(rank_info.agent_name, None)
        if peer is not None:
            for rank_info in peer.info.ranks:
                if rank_info.agent_name in self.agent.remotes:
                    self.agent.remove_remote(rank_info.agent_name)

    def engine(self, engine_id: str) -> EngineInfo | None:
        with self._lock:
            peer = self._peers.get(engine_id)
        return None if peer is None else peer.info

    def identify(self, agent_name: str) -> tuple[str, int] | None:
        with self._lock:
            return self._agents.get(agent_name)

    def _peer(self, engine_id: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(engine_id)
        if peer is None:
            raise LocalProtocolError(f"engine {engine_id!r} is not connected")
        return peer

    def _data(self, engine_id: str, rank: int) -> _DataRank:
        data = self._peer(engine_id).data.get(rank)
        if data is None:
            raise LocalProtocolError(f"rank {rank} of engine {engine_id!r} is not routed")
        return data

    def _indices(
        self,
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        local_chunk: Chunk,
        remote_chunk: Chunk,
    ) -> tuple[PreppedBlocks, Any, _DataRank, Any]:
        """Descriptor indices of the same (block, chunk)s in every routed region."""
        data = self._data(engine_id, rank)
        if data.chunks != remote_chunk.count:
            raise LocalProtocolError(
                f"rank {rank} of {engine_id!r} is prepared in {data.chunks} chunks per block"
            )
        with self._lock:
            local = self._local.get(local_chunk.count)
        if local is None:
            raise LocalProtocolError(f"no local list in {local_chunk.count} chunks per block")
        local_ids = _chunked(local_block_ids, local_chunk)
        remote_ids = _chunked(remote_block_ids, remote_chunk)
        local_idx = local.layout.indices_for_blocks(local_ids)
        remote_idx = data.prepped.layout.indices_for_blocks(remote_ids, regions=data.route.regions)
        return local, local_idx, data, remote_idx

    def send_notif(self, engine_id: str, rank: int, message: bytes) -> None:
        self.send_notifs(engine_id, rank, (message,))

    def send_notifs(self, engine_id: str, rank: int, messages: Sequence[bytes]) -> None:
        """Several notifs to one rank, in order: as one bundle when the peer advertised
        ``notif_bundle`` (B-13), else one `send_notif` each."""
        info = self._peer(engine_id).info
        if not 0 <= rank < len(info.ranks):
            raise LocalProtocolError(f"engine {engine_id!r} has no rank {rank}")
        agent_name = info.agent(rank)
        if len(messages) > 1 and EXT_NOTIF_BUNDLE in info.extensions:
            messages = encode_notif_bundle(messages)
        for message in messages:
            self.agent.send_notif(agent_name, message)

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        """The agent's new notifs, bundles (B-13) split into the notifs they carry; a
        malformed bundle is dropped whole and counted in `rejected_bundles`."""
        notifs = self.agent.get_new_notifs()
        if not any(is_notif_bundle(message) for _sender, message in notifs):
            return notifs
        split: list[tuple[str, bytes]] = []
        for sender, message in notifs:
            if not is_notif_bundle(message):
                split.append((sender, message))
                continue
            try:
                parts = decode_notif_bundle(message, peer=sender)
            except RemoteProtocolError as exc:
                self.bundle_rejections.reject(sender, exc, real_clock())
                continue
            split.extend((sender, part) for part in parts)
        return split

    @property
    def rejected_bundles(self) -> int:
        """Malformed notif bundles dropped so far."""
        return self.bundle_rejections.total

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
        local, local_idx, data, remote_idx = self._indices(
            engine_id, rank, local_block_ids, remote_block_ids, local_chunk, remote_chunk
        )
        # B-13: queued; `flush_writes` posts one transfer per D rank (`push_batch`).
        write = BatchedWrite(engine_id, rank, local, local_idx, data.prepped, remote_idx, notif)
        return self.batcher.queue(write)

    def flush_writes(self) -> list[tuple[str, KvHandoffError]]:
        """Post the WRITEs queued since the last flush, one transfer per D rank (B-13)."""
        return self.batcher.flush()

    write_poll_interval_s: float | None = None
    """NIXL transfers are polled at the writer's own interval."""

    def complete_writes(self, now: float) -> int:
        """Writer thread: settle the batched WRITEs that ended (their completion notifs
        leave here); returns how many are still in flight (B-13, R-P08)."""
        return self.batcher.complete(now)

    def bind_bus(self, bus: EventBus) -> None:
        """The writer's bus: the batched WRITEs' lifecycles run on it."""
        self.batcher.bind(bus)

    def progress(self) -> None:
        """NIXL transfers progress on their own (the agent's progress thread or polls)."""

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
        local, local_idx, data, remote_idx = self._indices(
            engine_id, rank, local_block_ids, remote_block_ids, local_chunk, remote_chunk
        )
        return self.agent.read(local, local_idx, data.prepped, remote_idx, notif)

    def poll(self, handle: TransferHandle) -> XferState:
        if isinstance(handle, BatchedWrite):
            return self.batcher.poll(handle)
        assert isinstance(handle, XferHandle)
        return self.agent.poll(handle)

    def release(self, handle: TransferHandle) -> None:
        if isinstance(handle, BatchedWrite):
            self.batcher.release(handle)
            return
        assert isinstance(handle, XferHandle)
        self.agent.release(handle)


def _chunked(block_ids: Sequence[int], chunk: Chunk) -> list[int]:
    if chunk.count == 1:
        return list(block_ids)
    return [block * chunk.count + chunk.index for block in block_ids]


def _check_chunks(
    layout: MemberLayout, route: RemoteRoute, local: int, remote: int, engine_id: str
) -> None:
    """Every member's local chunk must be exactly as long as its remote chunk (R-T03)."""
    for slot, remote_len in zip(layout.slots, route.block_lens, strict=True):
        if slot.block_len % local or remote_len % remote:
            raise RemoteProtocolError(
                f"member {slot.name!r}: blocks of {slot.block_len} / {remote_len} bytes do not"
                f" split into {local} / {remote} chunks",
                peer=engine_id,
            )
        if slot.block_len // local != remote_len // remote:
            raise RemoteProtocolError(
                f"member {slot.name!r}: a chunk of {slot.block_len // local} bytes here and"
                f" {remote_len // remote} bytes on {engine_id!r} (TP layouts disagree)",
                peer=engine_id,
            )
