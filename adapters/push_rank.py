"""One worker rank of push mode, assembled: its machines, hand-offs and effect executors
(R-T01, R-P07, R-P08, B-11, S-05).

`PushRank` wires one rank's sans-IO halves to its `PushTransport`:

- the main thread's half (`worker`, `kvhandoff.machines.rank.worker`) on its own bus;
- the writer core (`writer`) on a bus of its own;
- the seed's cross-thread hand-offs, each with one producer side and one consumer:
  `writer_inbox` (main -> writer: the seed's reg-send, finished-blocks and
  evict-finished inboxes as one FIFO of typed commands, because their relative order
  matters), `handshake_results` (the executor's callbacks), `peer_lost_inbox` (heartbeats
  that found a dead peer), `pending_completion_notifs` (writer -> main: reports and
  forwarded notifs), `posted_transfers` (writer -> main: the handles of posted WRITEs),
  plus the `wake` event;
- the executors of every effect the machines return.

No lock and no shared state between the two threads: one owner per lifecycle, typed
commands in, typed reports out. It owns no thread: `writer_pass()` (from
`RankWriterSide`) is one pass of the writer loop, called by the real writer thread
(`push_writer_thread`) or by a deterministic simulator; handshakes go to an injected
`submit_handshake`. Each main-thread entry point reads the injected clock once and
first applies what the writer left for it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from collections.abc import Callable

from kvhandoff.adapters.clock import real_clock, wall_clock
from kvhandoff.adapters.push_rank_writer import (
    HandshakeJob,
    HandshakeResult,
    Posted,
    RankWriterSide,
)
from kvhandoff.adapters.push_transport import PushTransport, TransferHandle, peer_gone
from kvhandoff.machines.kv.effects import (
    DroppedRegistration,
    EvictRegistration,
    PollTransfer,
    ReleaseTransfer,
    ReportWriteError,
    RevokeLease,
    RevokeRead,
    SendRegistration,
    StageBlocks,
    StartRead,
    WakeWriter,
    WriterCommand,
)
from kvhandoff.machines.kv.events import ReadDone, ReadError, WriteDone, WriteError
from kvhandoff.machines.push.meta import PushConnectorMeta, PushWorkerOutput
from kvhandoff.machines.push.scheduler import Mode, Role
from kvhandoff.machines.push.writer import PushWriter
from kvhandoff.machines.rank.worker import PushWorker, WriterItem
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.auth import ClusterKey, NonceSource
from kvhandoff.protocol.errors import KvHandoffError
from kvhandoff.protocol.handshake import EXT_AUTH, EXT_PUSH_FAIL
from kvhandoff.protocol.notifs import encode_heartbeat
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.tp_mapping import split_rank, writers_of

log = logging.getLogger("kvhandoff.push.rank")

_COMMANDS: tuple[type[WriterCommand], ...] = (
    SendRegistration,
    StageBlocks,
    RevokeLease,
    ReportWriteError,
    EvictRegistration,
    StartRead,
    RevokeRead,
)


class PushRank(RankWriterSide):
    """One worker rank: the engine's per-step calls, the main thread's executors and
    (from `RankWriterSide`) the writer loop."""

    def __init__(
        self,
        role: Role,
        engine_id: str,
        transport: PushTransport,
        submit_handshake: Callable[[HandshakeJob], None],
        *,
        config: PushConfig | None = None,
        clock: Clock = real_clock,
        rank: int = 0,
        mode: Mode = "push",
        physical_blocks_per_logical: int = 1,
        wall: Clock = wall_clock,
    ) -> None:
        self.role = role
        self.mode = mode
        self.engine_id = engine_id
        self.rank = rank
        self.config = config or PushConfig()
        self.pp_rank, self.tp_rank = split_rank(rank, self.config.tp_size)
        self.transport = transport
        self.physical_blocks_per_logical = physical_blocks_per_logical
        self.clock = clock
        self.wall_clock = wall  # sealed notifs' freshness (S-05)
        self.nonces = NonceSource(os.urandom(8))
        self._submit_handshake = submit_handshake
        self.key = (
            ClusterKey.from_text(self.config.cluster_key) if self.config.cluster_key else None
        )
        extensions = (EXT_PUSH_FAIL,) + ((EXT_AUTH,) if self.key is not None else ())
        transport.advertise(extensions, self.key.key_id if self.key is not None else "")
        # Main thread.
        self.worker = PushWorker(role, engine_id, self.config, mode, rank=rank, now=clock())
        self.bus = self.worker.bus
        self.sending_transfers: dict[str, list[tuple[int, TransferHandle | None]]] = {}
        # Writer thread.
        self.writer = PushWriter(role, engine_id, self.config, mode, rank=rank, started_at=wall())
        self.writer_bus = self.writer.bus
        transport.bind_bus(self.writer_bus)  # B-13: its batched WRITEs are the writer's
        self.self_poll_interval_s: float | None = None
        self.writes_in_flight = 0
        """Batched WRITEs in flight after the last writer pass (it polls them, B-13)."""
        self.dropped_observers: list[Callable[[DroppedRegistration], None]] = []
        # Hand-offs (deque append/popleft are atomic: one producer side, one consumer).
        self.writer_inbox: deque[WriterCommand] = deque()
        self.handshake_results: deque[HandshakeResult] = deque()
        self.peer_lost_inbox: deque[str] = deque()
        self.pending_completion_notifs: deque[WriterItem] = deque()
        self.posted_transfers: deque[Posted] = deque()
        self.wake = threading.Event()
        self.failed_transfers = 0
        self._register_main_handlers()

    @property
    def writer_poll_interval_s(self) -> float | None:
        """How long the writer thread sleeps without a wake: its self-poll interval while
        P's finished blocks wait for a registration (R-P07) or WRITEs are in flight (the
        writer settles them, B-13); None: until woken."""
        if self.writes_in_flight:
            interval = self.transport.write_poll_interval_s or self.writer.poll_interval_s
            own = self.self_poll_interval_s
            return interval if own is None else min(own, interval)
        return self.self_poll_interval_s

    # -- engine entry points (main thread) -----------------------------------------------

    def start_load_kv(self, meta: PushConnectorMeta) -> None:
        now = self._main_now()
        self._start_load_kv(meta, now)

    def get_finished(self) -> PushWorkerOutput:
        now = self._main_now()
        return self.worker.get_finished(now, self._transfer_settled)

    def step(self, meta: PushConnectorMeta, now: float | None = None) -> PushWorkerOutput:
        """start_load_kv then get_finished at one `now` (read from the clock if None)."""
        if now is None:
            now = self._main_now()  # lets the transport progress, too
        else:
            self.transport.progress()
        self._take_writer_items(now)
        self._start_load_kv(meta, now)
        self._take_writer_items(now)
        return self.worker.get_finished(now, self._transfer_settled)

    def _start_load_kv(self, meta: PushConnectorMeta, now: float) -> None:
        self.worker.start_load_kv(meta, now)
        self._send_heartbeats(meta, now)

    def _main_now(self) -> float:
        """Let the transport progress, read the clock, then apply the writer's items (its
        reports before the machines' time moves on to `now`, see
        `PushWorker.take_writer_items`)."""
        self.transport.progress()
        now = self.clock()
        self._take_writer_items(now)
        return now

    def _take_writer_items(self, now: float) -> None:
        self._adopt_posted_transfers()
        pending = self.pending_completion_notifs
        if pending:
            items: list[WriterItem] = []
            while pending:
                items.append(pending.popleft())
            # The transport progresses between chunks of reports (IPC completions).
            self.worker.take_writer_items(items, now, self.transport.progress)

    def _register_main_handlers(self) -> None:
        bus = self.bus
        for command in _COMMANDS:
            bus.handle(command, self._to_writer)
        bus.handle(WakeWriter, lambda _i, _e: self.wake.set())
        bus.handle(PollTransfer, self._poll_transfer)
        bus.handle(ReleaseTransfer, self._release_transfer)

    def _to_writer(self, _inst: Instance[object] | None, command: WriterCommand) -> None:
        self.writer_inbox.append(command)

    def _adopt_posted_transfers(self) -> None:
        while self.posted_transfers:
            request_id, handles = self.posted_transfers.popleft()
            self.sending_transfers[request_id] = handles

    # -- transfers (polled on the main thread, as the seed says) ----------------------------

    def _transfer_settled(self, request_id: str) -> bool:
        """Whether polling `request_id` again can end it: its transfers are no longer in
        flight, or it has none here (the machine's poll then finds out)."""
        self._adopt_posted_transfers()
        handles = self.sending_transfers.get(request_id)
        if handles is None:
            return True
        transport = self.transport
        return all(handle is None or transport.poll(handle) != "PROC" for _rank, handle in handles)

    def _poll_transfer(self, _inst: Instance[object] | None, effect: PollTransfer) -> None:
        self._adopt_posted_transfers()
        handles = self.sending_transfers.get(effect.request_id)
        if handles is None:
            return
        transport = self.transport
        states = [
            (rank, "ERR" if handle is None else transport.poll(handle)) for rank, handle in handles
        ]
        if any(state == "PROC" for _rank, state in states):
            return
        del self.sending_transfers[effect.request_id]
        for _rank, handle in handles:
            self._release(handle)
        failed = tuple(rank for rank, state in states if state == "ERR")
        self.failed_transfers += len(failed)
        if self.mode == "push":
            # B-13, B-14: a batched transfer that failed to post fails its requests here.
            unposted = any(getattr(handle, "post_failed", False) for _rank, handle in handles)
            cause = "post" if unposted else "transfer_error"
            outcome: Event = WriteError(failed, cause) if failed else WriteDone()
        else:
            outcome = ReadError() if failed else ReadDone(self.wall_clock())
        self.worker.transfer_ended(effect.request_id, outcome)

    def _release_transfer(self, _inst: Instance[object] | None, effect: ReleaseTransfer) -> None:
        """The transfer timed out: free its handles (cancelling them) so none lands later."""
        self._adopt_posted_transfers()
        handles = self.sending_transfers.pop(effect.request_id, [])
        self.failed_transfers += len(handles)
        for _rank, handle in handles:
            self._release(handle)

    def _release(self, handle: TransferHandle | None) -> None:
        if handle is None:  # a READ that never posted
            return
        try:
            self.transport.release(handle)
        except KvHandoffError as exc:
            log.warning("releasing a transfer handle failed: %s", exc)

    # -- heartbeats (main thread, R-P15) ----------------------------------------------------

    def _send_heartbeats(self, meta: PushConnectorMeta, now: float) -> None:
        """One batch per P engine to the P ranks (every stage) that write into this one."""
        for engine_id, request_ids in meta.heartbeats.items():
            info = self.transport.engine(engine_id)
            if info is None or not request_ids:
                continue  # not connected (yet, or evicted): nothing to keep alive there
            message = self._seal(encode_heartbeat(request_ids))
            for rank in writers_of(self.tp_rank, self.config.tp_size, info.tp_size, info.pp_size):
                try:
                    self.transport.send_notif(engine_id, rank, message)
                except KvHandoffError as exc:
                    log.warning("heartbeat to %s rank %d failed: %s", engine_id, rank, exc)
                    if peer_gone(exc):
                        self.peer_lost_inbox.append(engine_id)  # B-08: the writer forgets it
                        self.wake.set()
                        break
        del now

    # -- observation ------------------------------------------------------------------------

    def rejected_notifs(self) -> int:
        """Notifs rejected by the writer and the main thread, and malformed bundles the
        transport dropped before splitting them (S-06)."""
        bundles = getattr(self.transport, "rejected_bundles", 0)
        return self.writer.rejected_notifs + self.worker.rejected_notifs + int(bundles)
