"""One side (P or D) of push mode, assembled: machines, inboxes, and effect executors.

`PushSide` wires the sans-IO pieces to a `PushTransport`:

- the main-thread bus with the scheduler and worker API (`scheduler`, `worker`);
- the writer core (`writer`) on a bus of its own;
- the seed's cross-thread hand-offs: `reg_send_inbox`, `finished_blocks_inbox`,
  `deferred_push_inbox`, `evict_finished_inbox`, `handshake_results` (the executor's
  callbacks) and `pending_completion_notifs` (writer -> main), plus the `wake` event;
- the executors of every effect the machines return.

It owns no thread: `writer_pass()` is one pass of the writer loop, called by the real
writer thread (`push_writer_thread`) or by a deterministic simulator; handshakes go to an
injected `submit_handshake`, a thread pool in production and a scheduler in simulation.

The engine calls the connector through this side (`update_state_after_alloc`,
`request_finished`, `build_connector_meta`, `start_load_kv`, `get_finished`,
`update_connector_output`, `abort`, or `step` for the four calls of one engine step).
Each entry point reads the injected clock once, takes the lease lock, first applies what
the writer left on the pending-completion-notifs queue and only then moves the machines'
time to `now`: no lease expires while the report of a WRITE posted from it waits.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.push_transport import PushTransport, TransferHandle, peer_gone
from kvhandoff.adapters.push_writer_side import HandshakeJob, HandshakeResult, PushWriterSide
from kvhandoff.machines.push.effects import (
    EnqueueFinishedBlocks,
    EnqueueRead,
    EnqueueRegistration,
    PollTransfer,
    QueueEviction,
    ReleaseTransfer,
    ReplayPush,
    ReplayRead,
    ReplayRegistration,
    SendHeartbeat,
    WakeWriter,
)
from kvhandoff.machines.push.events import (
    ReadDone,
    ReadError,
    WriteDone,
    WriteError,
)
from kvhandoff.machines.push.scheduler import (
    LocalEngine,
    Mode,
    PushConnectorMeta,
    PushConnectorOutput,
    PushScheduler,
    Role,
    register_push_machines,
)
from kvhandoff.machines.push.worker import PushWorker, WriterItem
from kvhandoff.machines.push.writer import PushWriter
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.errors import KvHandoffError
from kvhandoff.protocol.notifs import encode_heartbeat
from kvhandoff.protocol.push_config import PushConfig

log = logging.getLogger("kvhandoff.push.side")


class PushSide(PushWriterSide):
    """P or D: the engine entry points, the main thread's effect executors, and (from
    `PushWriterSide`) the writer loop."""

    def __init__(
        self,
        role: Role,
        engine: LocalEngine,
        transport: PushTransport,
        submit_handshake: Callable[[HandshakeJob], None],
        *,
        config: PushConfig | None = None,
        clock: Clock = real_clock,
        physical_blocks_per_logical: int = 1,
        mode: Mode = "push",
    ) -> None:
        self.role = role
        self.mode = mode
        self.engine = engine
        self.transport = transport
        self.config = config or PushConfig()
        self.physical_blocks_per_logical = physical_blocks_per_logical
        self._submit_handshake = submit_handshake
        self.clock = clock
        # Main thread.
        self.bus = EventBus()
        register_push_machines(self.bus, self.config)
        self.scheduler = PushScheduler(self.bus, role, engine, self.config, mode)
        self.worker = PushWorker(self.bus, role, engine, self.config, mode, now=clock())
        self._sending_transfers: dict[str, TransferHandle] = {}
        # Writer thread.
        self.writer_bus = EventBus()
        self.writer = PushWriter(
            role,
            self.writer_bus,
            poll_interval_s=self.config.push_writer_poll_interval_ms / 1000.0,
            handshake_timeout=self.config.handshake_timeout,
            pending_registration_ttl=self.config.registration_timeout,
        )
        self.self_poll_interval_s: float | None = None
        # Hand-offs (deque append/popleft are atomic: one producer side, one consumer).
        self.reg_send_inbox: deque[ReplayRegistration] = deque()
        self.finished_blocks_inbox: deque[tuple[str, tuple[int, ...]]] = deque()
        self.deferred_push_inbox: deque[ReplayPush] = deque()
        self.evict_finished_inbox: deque[str] = deque()
        self.pull_read_inbox: deque[ReplayRead] = deque()  # pull mode (B-09)
        self.peer_lost_inbox: deque[str] = deque()  # main-thread sends that found a dead peer
        self.handshake_results: deque[HandshakeResult] = deque()
        self.pending_completion_notifs: deque[WriterItem] = deque()
        self._posted_transfers: deque[tuple[str, TransferHandle]] = deque()
        self.wake = threading.Event()
        self.failed_transfers = 0
        self._rehandshaked: set[str] = set()  # WRITEs retried once after a re-handshake
        # The main thread reaps expired leases (freeing their blocks) while the writer
        # posts WRITEs from them. One lock orders the two: the main thread reads the
        # writer's reports and reaps under it; the writer checks that the lease still
        # stands, posts, and reports the post under it. So either the report of a posted
        # WRITE suspends the lease before it can be reaped, or the WRITE of a reaped
        # lease is never posted (D is told at once, B-06).
        self._lease_lock = threading.Lock()
        self._ended_leases: set[str] = set()  # ended, not yet seen by the writer
        self._register_main_handlers()

    # -- engine entry points (main thread) -----------------------------------------------

    def update_state_after_alloc(
        self, request_id: str, block_ids: Sequence[int], kv_transfer_params: Mapping[str, Any]
    ) -> None:
        with self._lease_lock:
            now = self._main_now()
            self.scheduler.update_state_after_alloc(request_id, block_ids, kv_transfer_params, now)

    def request_finished(
        self, request_id: str, block_ids: Sequence[int], kv_transfer_params: Mapping[str, Any]
    ) -> tuple[bool, dict[str, Any] | None]:
        with self._lease_lock:
            now = self._main_now()
            return self.scheduler.request_finished(request_id, block_ids, kv_transfer_params, now)

    def build_connector_meta(self) -> PushConnectorMeta:
        with self._lease_lock:
            return self.scheduler.build_connector_meta(self._main_now())

    def start_load_kv(self, meta: PushConnectorMeta) -> None:
        with self._lease_lock:
            self.worker.start_load_kv(meta, self._main_now())

    def get_finished(self) -> PushConnectorOutput:
        """The worker's get_finished, after what the writer left for the main thread."""
        with self._lease_lock:
            return self.worker.get_finished((), self._main_now())

    def update_connector_output(self, output: PushConnectorOutput) -> None:
        with self._lease_lock:
            self.scheduler.update_connector_output(output, self._main_now())

    def abort(self, request_id: str) -> None:
        """D: the engine's request-level abort path."""
        with self._lease_lock:
            self.scheduler.abort(request_id, self._main_now())

    def step(self) -> PushConnectorOutput:
        """One engine step of the connector at one `now`: build_connector_meta,
        start_load_kv, get_finished, update_connector_output."""
        with self._lease_lock:
            now = self._main_now()
            meta = self.scheduler.build_connector_meta(now)
            self.worker.start_load_kv(meta, now)
            self._take_writer_items(now)
            output = self.worker.get_finished((), now)
            self.scheduler.update_connector_output(output, now)
            return output

    def _main_now(self) -> float:
        """Under the lease lock: read the clock, then apply the writer's items (its reports
        before the machines' time moves on to `now`, see `PushWorker.take_writer_items`)."""
        now = self.clock()
        self._take_writer_items(now)
        return now

    def _take_writer_items(self, now: float) -> None:
        pending = self.pending_completion_notifs
        if pending:
            items: list[WriterItem] = []
            while pending:
                items.append(pending.popleft())
            self.worker.take_writer_items(items, now)
        self._adopt_posted_transfers()

    def _register_main_handlers(self) -> None:
        bus = self.bus
        bus.handle(EnqueueRegistration, lambda _i, e: self._to_writer_reg(e))
        bus.handle(
            EnqueueFinishedBlocks,
            lambda _i, e: self.finished_blocks_inbox.append((e.request_id, e.block_ids)),
        )
        bus.handle(
            EnqueueRead,
            lambda _i, e: self.pull_read_inbox.append(
                ReplayRead(e.request_id, e.source, e.block_ids)
            ),
        )
        bus.handle(QueueEviction, lambda _i, e: self._lease_ended(e.request_id))
        bus.handle(WakeWriter, lambda _i, _e: self.wake.set())
        bus.handle(PollTransfer, self._poll_transfer)
        bus.handle(ReleaseTransfer, self._release_transfer)
        bus.handle(SendHeartbeat, self._send_heartbeat)

    def _lease_ended(self, request_id: str) -> None:
        """Main thread, under the lease lock (every entry point): no WRITE from it any more."""
        self._ended_leases.add(request_id)
        self.evict_finished_inbox.append(request_id)

    def _to_writer_reg(self, effect: EnqueueRegistration) -> None:
        self.reg_send_inbox.append(ReplayRegistration(effect.request_id, effect.registration))

    def _adopt_posted_transfers(self) -> None:
        while self._posted_transfers:
            request_id, handle = self._posted_transfers.popleft()
            self._sending_transfers[request_id] = handle

    def _poll_transfer(self, _inst: Instance[object] | None, effect: PollTransfer) -> None:
        self._adopt_posted_transfers()
        handle = self._sending_transfers.get(effect.request_id)
        if handle is None:
            return
        status = self.transport.poll(handle)
        if status == "PROC":
            return
        del self._sending_transfers[effect.request_id]
        self._release(handle)
        if status == "ERR":
            self.failed_transfers += 1
        done = status == "DONE"
        if self.mode == "push":
            outcome: Event = WriteDone() if done else WriteError()
        else:
            outcome = ReadDone() if done else ReadError()
        # Run from the poll's own transition: the bus queues it behind that one.
        self.bus.dispatch(self.worker.polled_kind, effect.request_id, outcome, self.bus.now)

    def _release_transfer(self, _inst: Instance[object] | None, effect: ReleaseTransfer) -> None:
        """A WRITE (or a pull READ) timed out: free its handle (cancelling it) so it cannot
        land later."""
        self._adopt_posted_transfers()
        handle = self._sending_transfers.pop(effect.request_id, None)
        if handle is not None:
            self.failed_transfers += 1
            self._release(handle)

    def _release(self, handle: TransferHandle) -> None:
        try:
            self.transport.release(handle)
        except KvHandoffError as exc:
            log.warning("releasing a transfer handle failed: %s", exc)

    def _send_heartbeat(self, _inst: Instance[object] | None, effect: SendHeartbeat) -> None:
        try:
            self.transport.send_notif(effect.engine_id, encode_heartbeat(effect.request_ids))
        except KvHandoffError as exc:
            log.warning("heartbeat to %s failed: %s", effect.engine_id, exc)
            if peer_gone(exc):
                self.peer_lost_inbox.append(effect.engine_id)  # B-08: the writer forgets it
                self.wake.set()
