"""A stand-in for the NIXL transport under `IpcPushTransport` (tests of issue 18): it
records what the wrapper delegates and hands out the notifs a test queues."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvhandoff.adapters.push_transport import EngineInfo, RankInfo
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.member_routing import MemberSlot
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk


@dataclass
class StubLayout:
    slots: tuple[MemberSlot, ...]


@dataclass
class StubHandle:
    request: bytes


@dataclass
class StubNixl:
    """Connected to engine "D" (one rank, agent "d-agent") once `connected`."""

    slots: tuple[MemberSlot, ...] = ()
    engine_id: str = "P"
    agent_name: str = "p-agent"
    connected: bool = True
    inbox: list[tuple[str, bytes]] = field(default_factory=list)
    sent: list[tuple[str, int, bytes]] = field(default_factory=list)
    writes: list[tuple[str, int, tuple[int, ...], tuple[int, ...], bytes]] = field(
        default_factory=list
    )
    forgotten: list[str] = field(default_factory=list)
    peer_extensions: frozenset[str] = frozenset()
    advertised: tuple[str, ...] = ()
    bound: object = None

    @property
    def layout(self) -> StubLayout:
        return StubLayout(self.slots)

    def engine(self, engine_id: str) -> EngineInfo | None:
        if engine_id != "D" or not self.connected:
            return None
        return EngineInfo("D", 1, 1, self.peer_extensions, (RankInfo(0, "d-agent", 1, 1 << 20),))

    def connect(self, engine: object, routes: object) -> EngineInfo:
        self.connected = True
        info = self.engine("D")
        assert info is not None
        return info

    def advertise(self, extensions: Sequence[str], auth_key_id: str) -> None:
        self.advertised = tuple(extensions)

    def identify(self, agent_name: str) -> tuple[str, int] | None:
        return ("D", 0) if agent_name == "d-agent" else None

    def send_notif(self, engine_id: str, rank: int, message: bytes) -> None:
        if self.engine(engine_id) is None:
            raise LocalProtocolError(f"engine {engine_id!r} is not connected")
        self.sent.append((engine_id, rank, message))

    def send_notifs(self, engine_id: str, rank: int, messages: Sequence[bytes]) -> None:
        """Recorded one by one, as toward a peer without notif bundles."""
        for message in messages:
            self.send_notif(engine_id, rank, message)

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        inbox, self.inbox = self.inbox, []
        return inbox

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
    ) -> StubHandle:
        self.writes.append(
            (engine_id, rank, tuple(local_block_ids), tuple(remote_block_ids), notif)
        )
        return StubHandle(notif)

    def flush_writes(self) -> list[tuple[str, Exception]]:
        return []

    write_poll_interval_s: float | None = None

    def complete_writes(self, now: float) -> int:
        return 0

    def bind_bus(self, bus: object) -> None:
        self.bound = bus

    def progress(self) -> None:
        pass

    def poll(self, handle: StubHandle) -> str:
        return "DONE"

    def release(self, handle: StubHandle) -> None:
        pass

    def forget(self, engine_id: str) -> None:
        self.forgotten.append(engine_id)
        self.connected = False
