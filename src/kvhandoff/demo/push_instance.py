"""One live push instance: KV memory, a real NIXL agent, the ZMQ side channel, the
writer thread and the handshake executor around a `PushSide`, started and stopped as one.

Used by `kvhandoff run prefill|decode` and by the integration tests, which drive its
engine step themselves.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from typing import Any

from kvhandoff.adapters.nixl.agent import NixlAgent
from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
from kvhandoff.adapters.push_side import PushSide
from kvhandoff.adapters.push_writer_thread import HandshakeExecutor, PushWriterThread
from kvhandoff.demo.kv_memory import KVMemory, KVShape
from kvhandoff.machines.push.meta import PushConnectorOutput
from kvhandoff.machines.push.scheduler import SCHEDULER_KINDS, LocalEngine, Mode, Role
from kvhandoff.machines.rank.worker import RANK_KINDS
from kvhandoff.protocol.handshake import compatibility_hash
from kvhandoff.protocol.push_config import PushConfig

TransportFactory = Callable[..., NixlPushTransport]


class LivePushInstance:
    def __init__(
        self,
        role: Role,
        engine_id: str,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        config: PushConfig | None = None,
        shape: KVShape | None = None,
        transport_factory: TransportFactory = NixlPushTransport,
        mode: Mode = "push",
    ) -> None:
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.role = role
        self.config = config or PushConfig()
        self.memory = KVMemory(shape or KVShape())
        self.agent = NixlAgent(
            f"{engine_id}-{secrets.token_hex(4)}",
            self.config.nixl_backend,
            progress_thread=self.config.nixl_progress_thread,
        )
        self.transport = transport_factory(
            engine_id,
            self.agent,
            self.memory.local_regions(),
            compatibility_hash=compatibility_hash(
                "kvhandoff-demo", "demo-model", "uint8", self.memory.shape.block_len
            ),
            is_decoder=role == "decode",
        )
        self.executor = HandshakeExecutor()
        # The side channel serves what the side's ranks say, so it starts first on a port
        # of its own and learns the side once it exists.
        self._side: PushSide | None = None
        from kvhandoff.adapters.zmq.side_channel import SideChannelServer

        self.server = SideChannelServer(
            listen_host, listen_port, lambda pp, tp: self.side.rank_payload(pp, tp)
        )
        self.engine = LocalEngine(engine_id, listen_host, self.server.port)
        self._side = PushSide(
            role, self.engine, self.transport, self.executor.submit, config=self.config, mode=mode
        )
        self.writer = PushWriterThread(self.side.ranks[0]).start()

    @property
    def side(self) -> PushSide:
        assert self._side is not None, "the side channel was asked before the side existed"
        return self._side

    @property
    def port(self) -> int:
        return self.server.port

    def step(self) -> PushConnectorOutput:
        """One engine step of the connector: meta, start_load_kv, get_finished, output."""
        return self.side.step()

    def live_lifecycles(self) -> int:
        """Request lifecycles still live on the scheduler's and the rank's buses (zero
        once everything resolved)."""
        side = self.side
        rank = side.ranks[0]
        return sum(side.scheduler.bus.live(kind) for kind in SCHEDULER_KINDS) + sum(
            rank.bus.live(kind) for kind in RANK_KINDS
        )

    def counters(self) -> dict[str, Any]:
        side = self.side
        return {
            "rejected_notifs": side.rejected_notifs(),
            "failed_transfers": side.failed_transfers,
            "writer_errors": self.writer.errors,
            "metrics": {**side.scheduler.bus.metrics, **side.ranks[0].bus.metrics},
            "failures": side.stats(),
            "rejected_by_reason": self.rejected_by_reason(),
            "registrations_dropped": self.registrations_dropped(),
            "side_channel": self.side_channel_counters(),
        }

    def rejected_by_reason(self) -> dict[str, int]:
        """Notifs rejected by cause (S-06): the writer's and the main thread's, and the
        notif bundles the transport dropped whole, summed over the ranks."""
        out: dict[str, int] = {}
        for rank in self.side.ranks:
            logs = [rank.writer.rejections, rank.worker.rejections]
            bundles = getattr(rank.transport, "bundle_rejections", None)
            if bundles is not None:
                logs.append(bundles)
            for log in logs:
                for cause, count in log.reasons().items():
                    out[cause] = out.get(cause, 0) + count
        return out

    def registrations_dropped(self) -> dict[str, int]:
        """PUSH_REGs the writers' match slots let go, by reason (a duplicate changes
        nothing; a registration no request of this P matched expires)."""
        out: dict[str, int] = {}
        for rank in self.side.ranks:
            for reason, count in rank.writer.dropped.items():
                out[reason] = out.get(reason, 0) + count
        return out

    def side_channel_counters(self) -> dict[str, Any]:
        """What the ZMQ side channel served, dropped and shed (S-03, B-11, S-06)."""
        server = self.server
        return {
            "connections_accepted": server.connections_accepted,
            "connections_shed": dict(server.connections_shed),
            "requests_served": server.requests_served,
            "requests_dropped": server.requests_dropped,
            "rejected_by_reason": server.rejections.reasons(),
        }

    def close(self) -> None:
        self.writer.stop()
        self.executor.shutdown()
        self.server.close()
        self.agent.close()

    def __enter__(self) -> LivePushInstance:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
