"""What the CUDA IPC transport leaves to the NIXL transport it wraps (`ipc_transport.py`):
every call but the WRITE path, the connection and the notif stream goes straight through,
so a peer sees the same agent, handshake and notifs either way."""

from __future__ import annotations

from collections.abc import Sequence

from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
from kvhandoff.adapters.push_transport import EngineInfo, TransferHandle
from kvhandoff.protocol.handshake import HandshakePayload
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk


class NixlPassthrough:
    """The NIXL transport's calls, delegated unchanged to `inner`."""

    def __init__(self, inner: NixlPushTransport) -> None:
        self.inner = inner
        self.engine_id = inner.engine_id

    @property
    def agent_name(self) -> str:
        return self.inner.agent_name

    @property
    def rejected_bundles(self) -> int:
        """Malformed notif bundles the NIXL transport dropped (S-06)."""
        return self.inner.rejected_bundles

    def handshake_payload(self) -> HandshakePayload:
        return self.inner.handshake_payload()

    def fetch_handshake(
        self, host: str, port: int, timeout_s: float, ranks: Sequence[tuple[int, int]]
    ) -> list[bytes]:
        return self.inner.fetch_handshake(host, port, timeout_s, ranks)

    def engine(self, engine_id: str) -> EngineInfo | None:
        return self.inner.engine(engine_id)

    def identify(self, agent_name: str) -> tuple[str, int] | None:
        return self.inner.identify(agent_name)

    def send_notif(self, engine_id: str, rank: int, message: bytes) -> None:
        self.inner.send_notif(engine_id, rank, message)

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
        return self.inner.read_blocks(
            engine_id,
            rank,
            local_block_ids,
            remote_block_ids,
            notif,
            local_chunk=local_chunk,
            remote_chunk=remote_chunk,
        )

    def progress(self) -> None:
        self.inner.progress()
