"""One engine (P or D) of push mode in one process: its scheduler and its worker ranks.

In an engine the scheduler half runs in the scheduler process and each TP/PP rank in a
process of its own (R-T01); they share nothing but the msgspec records of
`kvhandoff.machines.push.meta`. `PushSide` keeps that shape inside one process, for the
demo, the benchmarks, the soak and the simulator: a `PushScheduler` and one `PushRank`
per rank (`config.tp_size * config.pp_size` of them, each with its own transport), and
the engine's side channel serving each rank's handshake payload, one request per rank
(`rank_payload`). Every engine entry point reads the injected clock once and passes
`now` down:

    side = PushSide("decode", LocalEngine("decode-0", host, port), [transport], submit)
    side.update_state_after_alloc(request_id, block_ids, kv_transfer_params)
    side.request_finished(request_id, block_ids, kv_transfer_params)   # P
    output = side.step()   # build_connector_meta -> every rank -> update_connector_output

It owns no thread: each rank's `writer_pass()` is one pass of its writer loop, called by
its writer thread (`push_writer_thread`) or by a deterministic simulator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvhandoff.adapters.clock import real_clock, wall_clock
from kvhandoff.adapters.push_rank import PushRank
from kvhandoff.adapters.push_rank_writer import HandshakeJob
from kvhandoff.adapters.push_transport import PushTransport
from kvhandoff.adapters.trace import open_trace
from kvhandoff.adapters.trace_config import TraceConfig, trace_settings
from kvhandoff.adapters.zmq.side_channel import SideChannelServer
from kvhandoff.machines.push.meta import PushConnectorMeta, PushConnectorOutput
from kvhandoff.machines.push.scheduler import LocalEngine, Mode, PushScheduler, Role
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    EngineHandshake,
    encode_handshake,
)
from kvhandoff.protocol.push_config import PushConfig


def engine_handshake(engine_id: str, ranks: Sequence[PushRank]) -> EngineHandshake:
    """What the engine's side channel serves: every rank's payload, in rank order."""
    payloads = tuple(rank.transport.handshake_payload() for rank in ranks)
    return EngineHandshake(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION, engine_id=engine_id, ranks=payloads
    )


class PushSide:
    """P or D: the scheduler and every worker rank of one engine, in one process."""

    def __init__(
        self,
        role: Role,
        engine: LocalEngine,
        transports: PushTransport | Sequence[PushTransport],
        submit_handshake: Callable[[HandshakeJob], None],
        *,
        config: PushConfig | None = None,
        clock: Clock = real_clock,
        physical_blocks_per_logical: int = 1,
        mode: Mode = "push",
        trace: TraceConfig | None = None,
        wall: Clock | None = None,
    ) -> None:
        """`wall`: the wall clock sealed notifs are stamped and checked with (S-05), and a
        pull lease's end is told in (B-09); the system's by default (the simulator passes
        its virtual clock)."""
        self.role = role
        self.mode = mode
        self.engine = engine
        self.config = config or PushConfig()
        self.clock = clock
        self.wall_clock = wall_clock if wall is None else wall
        listed = [transports] if not isinstance(transports, Sequence) else list(transports)
        if len(listed) != self.config.world_size:
            raise LocalProtocolError(
                f"{len(listed)} transports for TP {self.config.tp_size} x PP"
                f" {self.config.pp_size} ranks"
            )
        self.scheduler = PushScheduler(role, engine, self.config, mode, now=clock())
        self.ranks = [
            PushRank(
                role,
                engine.engine_id,
                transport,
                submit_handshake,
                config=self.config,
                clock=clock,
                rank=index,
                mode=mode,
                physical_blocks_per_logical=physical_blocks_per_logical,
                **({} if wall is None else {"wall": wall}),
            )
            for index, transport in enumerate(listed)
        ]
        # The transition trace of every bus (off unless `trace` or KVHANDOFF_TRACE names a
        # target): the scheduler's, and each rank's main-thread and writer buses.
        self.trace = open_trace(trace_settings(trace, clock), engine.engine_id)
        if self.trace is not None:
            self.trace.attach_tree(self, proc=engine.engine_id, role=role)
        self._meta: PushConnectorMeta | None = None

    # -- the side channel ----------------------------------------------------------------

    def handshake(self) -> EngineHandshake:
        return engine_handshake(self.engine.engine_id, self.ranks)

    def rank_payload(self, pp_rank: int, tp_rank: int) -> bytes | None:
        """One rank's encoded payload, as the side channel serves it; None for no such
        rank (C-01: one request per rank)."""
        tp_size, pp_size = self.config.tp_size, self.config.pp_size
        if not (0 <= tp_rank < tp_size and 0 <= pp_rank < pp_size):
            return None
        return encode_handshake(
            self.ranks[pp_rank * tp_size + tp_rank].transport.handshake_payload()
        )

    def serve(self, host: str, port: int) -> SideChannelServer:
        """Serve the engine's handshake on the ZMQ side channel (R-P15, C-01)."""
        return SideChannelServer(host, port, self.rank_payload)

    # -- engine entry points (main thread) -----------------------------------------------

    def update_state_after_alloc(
        self,
        request_id: str,
        block_ids: Sequence[int],
        kv_transfer_params: Mapping[str, Any] | None,
    ) -> None:
        now = self.clock()
        self.scheduler.update_state_after_alloc(request_id, block_ids, kv_transfer_params, now)

    def request_finished(
        self,
        request_id: str,
        block_ids: Sequence[int],
        kv_transfer_params: Mapping[str, Any] | None,
        *,
        finished_normally: bool = True,
    ) -> tuple[bool, dict[str, Any] | None]:
        now = self.clock()
        return self.scheduler.request_finished(
            request_id,
            block_ids,
            kv_transfer_params,
            now,
            finished_normally=finished_normally,
            wall=self.wall_clock() if self.mode == "pull" else None,  # pull's lease deadline
        )

    def abort(self, request_id: str) -> None:
        """D: the engine's request-level abort path."""
        self.scheduler.abort(request_id, self.clock())

    def step(self) -> PushConnectorOutput:
        """One engine step at one `now`: build_connector_meta, every rank's
        start_load_kv and get_finished, update_connector_output."""
        now = self.clock()
        meta = self.scheduler.build_connector_meta(now)
        outputs = [rank.step(meta, now) for rank in self.ranks]
        return self.scheduler.update_connector_output(outputs, now)

    # The same step as the engine calls it, one hook at a time.

    def build_connector_meta(self) -> PushConnectorMeta:
        self._meta = self.scheduler.build_connector_meta(self.clock())
        return self._meta

    def start_load_kv(self, meta: PushConnectorMeta) -> None:
        for rank in self.ranks:
            rank.start_load_kv(meta)

    def get_finished(self) -> PushConnectorOutput:
        """Every rank's get_finished, aggregated by the scheduler (R-T02)."""
        outputs = [rank.get_finished() for rank in self.ranks]
        return self.scheduler.update_connector_output(outputs, self.clock())

    # -- the writer threads' work, for a simulator or a test ------------------------------

    def writer_pass(self) -> int:
        return sum(rank.writer_pass() for rank in self.ranks)

    # -- observation -------------------------------------------------------------------------

    @property
    def failed_transfers(self) -> int:
        return sum(rank.failed_transfers for rank in self.ranks)

    def rejected_notifs(self) -> int:
        return sum(rank.rejected_notifs() for rank in self.ranks)

    def stats(self) -> dict[str, int]:
        """Failures by cause (B-14), across the ranks, as the scheduler aggregated them."""
        return self.scheduler.stats()
