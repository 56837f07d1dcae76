"""The transport interface one worker rank's push edges are written against: one
interface, two implementations — the real NIXL agent (`nixl/push_transport.py`) and the
in-memory fabric of the simulator (`kvhandoff.sim.push.transport`). One conformance suite
runs against both.

A transport is one rank's NIXL agent over that rank's KV regions. A remote engine is
named by its engine id and its ranks by their global rank (``pp_rank * tp_size +
tp_rank``): `connect` loads the agents of every rank of a remote engine (from the
`EngineHandshake` its side channel served) and prepares descriptors for the ranks this
rank moves data with, each cut into the chunks the TP mapping asks for (R-T03).
`connect` runs on the handshake executor; everything else on the writer thread, except
`send_notif` for heartbeats and `poll` / `release` (main thread), as the seed prescribes,
and `progress` (main thread, first in every engine step). A batched WRITE (B-13) is
driven by the writer alone (`complete_writes` polls it and sends its completion notifs,
R-P08); the main thread's `poll` reads the outcome the writer published and its
`release` hands the handle to the writer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.protocol.errors import KvHandoffError
from kvhandoff.protocol.handshake import EngineHandshake, HandshakePayload
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk

XferState = Literal["DONE", "PROC", "ERR"]


def peer_gone(exc: BaseException) -> bool:
    """Whether a transport error says the peer itself is gone (its agents must be
    forgotten and re-handshaked, B-08), as opposed to a failure of one operation."""
    return bool(getattr(exc, "peer_gone", False))


@dataclass(frozen=True, slots=True)
class RankInfo:
    """What a handshake taught us about one rank of a remote engine."""

    rank: int
    agent_name: str
    physical_blocks_per_logical: int
    capacity: int
    """The smallest block count of the regions routed to it (0: notifs only)."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What a completed handshake taught us about a remote engine."""

    engine_id: str
    tp_size: int
    pp_size: int
    extensions: frozenset[str]
    ranks: tuple[RankInfo, ...]

    def agent(self, rank: int) -> str:
        return self.ranks[rank].agent_name

    def rank_of(self, agent_name: str) -> int | None:
        for info in self.ranks:
            if info.agent_name == agent_name:
                return info.rank
        return None


Routes = Mapping[int, tuple[int, int]]
"""Remote rank -> (chunks per local block, chunks per remote block) for data transfers."""


class TransferHandle(Protocol):
    """An opaque posted transfer."""


class PushTransport(Protocol):
    engine_id: str

    @property
    def agent_name(self) -> str:
        """This rank's NIXL agent name (what peers see as the sender of its notifs)."""
        ...

    def handshake_payload(self) -> HandshakePayload:
        """What this rank tells peers about itself (served by the engine's side channel)."""
        ...

    def advertise(self, extensions: Sequence[str], auth_key_id: str) -> None:
        """The kvhandoff extensions and cluster key id this rank's payload carries."""
        ...

    def fetch_handshake(
        self, host: str, port: int, timeout_s: float, ranks: Sequence[tuple[int, int]]
    ) -> list[bytes]:
        """The encoded payload of each (pp_rank, tp_rank) of a remote engine, one
        side-channel request each (runs on the handshake executor)."""
        ...

    def connect(self, engine: EngineHandshake, routes: Routes) -> EngineInfo:
        """Check compatibility, load every rank's agent and prepare descriptors for the
        ranks in `routes` (executor)."""
        ...

    def forget(self, engine_id: str) -> None:
        """Drop a remote engine's agents and descriptors; the next use re-handshakes."""
        ...

    def engine(self, engine_id: str) -> EngineInfo | None: ...

    def identify(self, agent_name: str) -> tuple[str, int] | None:
        """(engine id, rank) of a loaded agent, or None for an agent of no known engine."""
        ...

    def send_notif(self, engine_id: str, rank: int, message: bytes) -> None: ...

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        """(sender agent name, message) pairs that arrived since the last call."""
        ...

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
        """WRITE `local_chunk` of local physical blocks into `remote_chunk` of the remote
        rank's, in every routed region; `notif` reaches the peer after the bytes landed.
        A transport may queue it until `flush_writes` (B-13)."""
        ...

    def flush_writes(self) -> list[tuple[str, KvHandoffError]]:
        """B-13: post the WRITEs `write_blocks` queued since the last flush, one transfer
        per remote rank; a handle's `poll` says "PROC" until its WRITE was flushed. Returns
        (engine id, error) for each transfer that failed to post (its handles poll "ERR").
        The writer thread flushes at the end of every writer pass."""
        ...

    write_poll_interval_s: float | None
    """How soon the writer polls again while WRITEs are in flight; None: the writer's own
    `push_writer_poll_interval_ms` (a transport whose transfers end within microseconds,
    a CUDA IPC launch, asks for less)."""

    def complete_writes(self, now: float) -> int:
        """Writer thread, each pass: settle the batched WRITEs whose transfer ended (a
        landed one's completion notifs leave here, after its bytes) and cancel those the
        main thread released in flight. Returns how many are still in flight: the writer
        polls again after its self-poll interval while any is (R-P07)."""
        ...

    def bind_bus(self, bus: EventBus) -> None:
        """The writer's bus: the transport's batched WRITEs (`push.write_batch`) run on
        it, so one thread owns every lifecycle of the rank's writer side."""
        ...

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
        """READ `remote_chunk` of the remote rank's physical blocks into `local_chunk` of
        local ones, in every routed region (pull mode, B-09); `notif` reaches the peer when
        the READ is done."""
        ...

    def poll(self, handle: TransferHandle) -> XferState: ...

    def progress(self) -> None:
        """Main thread, first thing in every engine step: a transport that completes
        transfers itself (the CUDA IPC path) launches what is queued and sends the
        completion notifs of what has finished, before the step spends its time on the
        writer's reports; NIXL transfers progress on their own (nothing to do)."""
        ...

    def release(self, handle: TransferHandle) -> None: ...
