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
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from kvhandoff.adapters.push_transport import PeerInfo, PushTransport, TransferHandle, peer_gone
from kvhandoff.machines.push.effects import (
    ArmSelfPoll,
    DisarmSelfPoll,
    DropRemoteAgent,
    EnqueueFinishedBlocks,
    EnqueueRead,
    EnqueueRegistration,
    ForwardToMain,
    IssueRead,
    IssueWrite,
    PollTransfer,
    QueueEviction,
    ReleaseTransfer,
    ReplayPush,
    ReplayRead,
    ReplayRegistration,
    ReportToMain,
    SendHeartbeat,
    SendPushReg,
    StartHandshake,
    WakeWriter,
)
from kvhandoff.machines.push.scheduler import (
    LocalEngine,
    Mode,
    PushConnectorOutput,
    PushScheduler,
    Role,
    register_push_machines,
)
from kvhandoff.machines.push.worker import PushWorker, WriterItem
from kvhandoff.machines.push.writer import PushWriter
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import Clock, real_clock
from kvhandoff.protocol.blocks import check_within_capacity, expand_to_physical
from kvhandoff.protocol.errors import KvHandoffError
from kvhandoff.protocol.handshake import decode_handshake
from kvhandoff.protocol.notifs import encode_completion_notif, encode_heartbeat, encode_write_failed
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import encode_push_reg

log = logging.getLogger("kvhandoff.push.side")

HandshakeJob = Callable[[], None]
HandshakeResult = tuple[str, bool, str]


class PushSide:
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
        # Main thread.
        self.bus = EventBus(clock)
        register_push_machines(self.bus, self.config)
        self.scheduler = PushScheduler(self.bus, role, engine, self.config, mode)
        self.worker = PushWorker(self.bus, role, engine, self.config, mode)
        self._sending_transfers: dict[str, TransferHandle] = {}
        # Writer thread.
        self.writer_bus = EventBus(clock)
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

    # -- engine step (main thread) -------------------------------------------------------

    def get_finished(self) -> PushConnectorOutput:
        """The worker's get_finished, fed with what the writer left for the main thread."""
        with self._lease_lock:
            items: list[WriterItem] = []
            while self.pending_completion_notifs:
                items.append(self.pending_completion_notifs.popleft())
            self._adopt_posted_transfers()
            return self.worker.get_finished(items)

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
        """Main thread, under the lease lock (`get_finished`): no WRITE from it any more."""
        self._ended_leases.add(request_id)
        self.evict_finished_inbox.append(request_id)

    def _to_writer_reg(self, effect: EnqueueRegistration) -> None:
        self.reg_send_inbox.append(ReplayRegistration(effect.request_id, effect.registration))

    def _adopt_posted_transfers(self) -> None:
        while self._posted_transfers:
            request_id, handle = self._posted_transfers.popleft()
            self._sending_transfers[request_id] = handle

    def _poll_transfer(self, _inst: Any, effect: PollTransfer) -> None:
        self._adopt_posted_transfers()
        handle = self._sending_transfers.get(effect.request_id)
        if handle is None:
            return
        state = self.transport.poll(handle)
        if state == "PROC":
            return
        del self._sending_transfers[effect.request_id]
        self._release(handle)
        if state == "ERR":
            self.failed_transfers += 1
        op = "write" if self.mode == "push" else "read"
        outcome = "done" if state == "DONE" else "error"
        self.bus.dispatch(self.worker.polled_kind, effect.request_id, f"{op}_{outcome}")

    def _release_transfer(self, _inst: Any, effect: ReleaseTransfer) -> None:
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

    def _send_heartbeat(self, _inst: Any, effect: SendHeartbeat) -> None:
        try:
            self.transport.send_notif(effect.engine_id, encode_heartbeat(effect.request_ids))
        except KvHandoffError as exc:
            log.warning("heartbeat to %s failed: %s", effect.engine_id, exc)
            if peer_gone(exc):
                self.peer_lost_inbox.append(effect.engine_id)  # B-08: the writer forgets it
                self.wake.set()

    # -- writer loop (writer thread) ------------------------------------------------------

    def writer_pass(self) -> int:
        """Drain every inbox and the transport's notifs once; execute the effects.

        Returns how many items were handled, so a caller can tell idle from busy.
        """
        writer = self.writer
        handled = 0
        while self.peer_lost_inbox:
            writer.on_peer_lost(self.peer_lost_inbox.popleft())
            handled += 1
        while self.handshake_results:
            engine_id, ok, _detail = self.handshake_results.popleft()
            writer.on_handshake_result(engine_id, ok)
            handled += 1
        while self.evict_finished_inbox:
            evicted = self.evict_finished_inbox.popleft()
            self._rehandshaked.discard(evicted)
            writer.on_evict(evicted)  # the writer forgets it: no later WRITE to check
            with self._lease_lock:
                self._ended_leases.discard(evicted)
            handled += 1
        while self.reg_send_inbox:
            op = self.reg_send_inbox.popleft()
            writer.on_reg_send(op.request_id, op.registration)
            handled += 1
        while self.finished_blocks_inbox:
            writer.on_finished_blocks(*self.finished_blocks_inbox.popleft())
            handled += 1
        while self.deferred_push_inbox:
            writer.on_deferred_push(self.deferred_push_inbox.popleft())
            handled += 1
        while self.pull_read_inbox:
            writer.on_pull_read(self.pull_read_inbox.popleft())
            handled += 1
        try:
            notifs = self.transport.get_new_notifs()
        except KvHandoffError as exc:
            log.warning("get_new_notifs failed: %s", exc)
            notifs = []
        for peer, message in notifs:
            writer.on_notif(peer, message)
            handled += 1
        writer.expire_pending()
        self.writer_bus.fire_due()
        for effect in writer.take_effects():
            self._execute_writer_effect(effect)
        return handled

    def _execute_writer_effect(self, effect: object) -> None:
        if isinstance(effect, ReportToMain | ForwardToMain):
            self.pending_completion_notifs.append(effect)
        elif isinstance(effect, SendPushReg):
            self._send_push_reg(effect)
        elif isinstance(effect, IssueWrite):
            self._issue_write(effect)
        elif isinstance(effect, ReplayRegistration):
            self.reg_send_inbox.append(effect)
            self.wake.set()
        elif isinstance(effect, ReplayPush):
            self.deferred_push_inbox.append(effect)
            self.wake.set()
        elif isinstance(effect, ReplayRead):
            self.pull_read_inbox.append(effect)
            self.wake.set()
        elif isinstance(effect, IssueRead):
            self._issue_read(effect)
        elif isinstance(effect, StartHandshake):
            self._start_handshake(effect)
        elif isinstance(effect, DropRemoteAgent):
            self.transport.forget(effect.engine_id)
        elif isinstance(effect, ArmSelfPoll):
            self.self_poll_interval_s = effect.interval_s
        elif isinstance(effect, DisarmSelfPoll):
            self.self_poll_interval_s = None
        else:
            raise TypeError(f"no executor for writer effect {effect!r}")

    def _send_push_reg(self, effect: SendPushReg) -> None:
        reg = effect.registration
        try:
            self.transport.send_notif(reg.remote_engine_id, encode_push_reg(reg))
        except KvHandoffError as exc:
            log.warning(
                "PUSH_REG %s to %s failed: %s", effect.request_id, reg.remote_engine_id, exc
            )
            self.pending_completion_notifs.append(ReportToMain(effect.request_id, "send_failed"))
            self._forget_if_gone(reg.remote_engine_id, exc)
        else:
            self.pending_completion_notifs.append(ReportToMain(effect.request_id, "reg_sent"))

    def _forget_if_gone(self, engine_id: str, exc: BaseException) -> None:
        """B-08: when the error says the peer is gone, drop its agent so the next operation
        re-handshakes (a restarted peer has a new agent) instead of using a dead one
        forever. A failure of one operation leaves a live peer and its in-flight
        transfers alone."""
        if peer_gone(exc):
            self._peer_lost(engine_id)

    def _issue_write(self, effect: IssueWrite) -> None:
        """R-P06: expand D's logical ids, WRITE into D's memory, completion notif to D;
        only while the lease on the blocks stands (see `_lease_lock`)."""
        with self._lease_lock:
            if effect.request_id in self._ended_leases:
                reason = "its lease ended before the WRITE was posted"
                self._write_submit_failed(effect, KvHandoffError(reason))
                return
            self._post_write(effect)

    def _post_write(self, effect: IssueWrite) -> None:
        reg = effect.registration
        peer = self.transport.peer(reg.decode_engine_id)
        try:
            if peer is None:
                raise KvHandoffError(f"no connected agent for {reg.decode_engine_id}")
            if effect.sender_agent and effect.sender_agent != peer.agent_name:
                if self._rehandshake_once(effect):
                    return
                # B-08: D restarted since it registered; its blocks now belong to others.
                raise KvHandoffError(
                    f"registration {reg.request_id} came from agent {effect.sender_agent!r}, "
                    f"{reg.decode_engine_id} now runs {peer.agent_name!r}: not written"
                )
            local, remote = self._physical_pair(
                peer, effect.request_id, effect.block_ids, reg.request_id, reg.block_ids
            )
            notif = encode_completion_notif(reg.request_id, self.engine.tp_size)
        except KvHandoffError as exc:
            self._write_submit_failed(effect, exc)
            return
        try:
            handle = self.transport.write_blocks(reg.decode_engine_id, local, remote, notif)
        except KvHandoffError as exc:
            self._write_submit_failed(effect, exc)
            return
        self._rehandshaked.discard(effect.request_id)
        self._posted_transfers.append((effect.request_id, handle))
        self.pending_completion_notifs.append(ReportToMain(effect.request_id, "write_posted"))

    def _rehandshake_once(self, effect: IssueWrite) -> bool:
        """B-08: the PUSH_REG came from another agent than the one we are connected to.
        Either our connection is stale (D restarted, then registered) or the registration
        is (D registered, then restarted). Forget the agent, re-handshake and try once
        more: a registration that still disagrees with the fresh agent is stale."""
        if effect.request_id in self._rehandshaked:
            self._rehandshaked.discard(effect.request_id)
            return False
        self._rehandshaked.add(effect.request_id)
        self._peer_lost(effect.registration.decode_engine_id)
        reg, sender = effect.registration, effect.sender_agent
        self.deferred_push_inbox.append(
            ReplayPush(effect.request_id, effect.block_ids, reg, sender)
        )
        return True

    def _physical_pair(
        self,
        peer: PeerInfo,
        local_request_id: str,
        local_blocks: tuple[int, ...],
        remote_request_id: str,
        remote_blocks: tuple[int, ...],
    ) -> tuple[list[int], list[int]]:
        """R-P06: both sides' logical ids expanded to physical ones, the peer's checked
        against the capacity it registered; the two lists must pair up one to one."""
        remote = expand_to_physical(remote_blocks, peer.physical_blocks_per_logical)
        check_within_capacity(remote_request_id, remote, peer.capacity, engine_id=peer.engine_id)
        local = expand_to_physical(local_blocks, self.physical_blocks_per_logical)
        if len(local) != len(remote):
            raise KvHandoffError(
                f"{local_request_id} holds {len(local)} physical blocks here, "
                f"{remote_request_id} names {len(remote)} on {peer.engine_id}"
            )
        return local, remote

    def _issue_read(self, effect: IssueRead) -> None:
        """Pull mode (B-09): READ P's blocks into D's; the notif tells P to free its lease."""
        source = effect.source
        peer = self.transport.peer(source.prefill.engine_id)
        try:
            if peer is None:
                raise KvHandoffError(f"no connected agent for {source.prefill.engine_id}")
            local, remote = self._physical_pair(
                peer, effect.request_id, effect.block_ids, source.request_id, source.block_ids
            )
            notif = encode_completion_notif(source.request_id, self.engine.tp_size)
            handle = self.transport.read_blocks(source.prefill.engine_id, local, remote, notif)
        except KvHandoffError as exc:
            log.warning("READ for %s failed to post: %s", effect.request_id, exc)
            self.failed_transfers += 1
            self._forget_if_gone(source.prefill.engine_id, exc)
            self.pending_completion_notifs.append(
                ReportToMain(effect.request_id, "read_submit_failed")
            )
            return
        self._posted_transfers.append((effect.request_id, handle))
        self.pending_completion_notifs.append(ReportToMain(effect.request_id, "read_posted"))

    def _peer_lost(self, engine_id: str) -> None:
        """B-08: a send or WRITE to a connected peer failed. Forget its agent, so the next
        operation re-handshakes (a restarted peer has a new agent) instead of using a dead
        agent forever."""
        self.writer.on_peer_lost(engine_id)
        self.wake.set()

    def _write_submit_failed(self, effect: IssueWrite, exc: KvHandoffError) -> None:
        """R-P12: count it, no failed-recv entry here; B-06: tell D so it fails at once."""
        reg = effect.registration
        self.failed_transfers += 1
        log.warning("WRITE for %s failed to post: %s", effect.request_id, exc)
        self._forget_if_gone(reg.decode_engine_id, exc)
        try:
            self.transport.send_notif(
                reg.decode_engine_id, encode_write_failed(reg.request_id, str(exc))
            )
        except KvHandoffError as notif_exc:
            log.warning("WRITE-failed notif to %s lost: %s", reg.decode_engine_id, notif_exc)
        self.pending_completion_notifs.append(
            ReportToMain(effect.request_id, "write_submit_failed")
        )

    def _start_handshake(self, effect: StartHandshake) -> None:
        """R-P05: run on the executor; the callback only posts the result and wakes."""
        transport = self.transport
        results = self.handshake_results
        wake = self.wake
        timeout = self.config.handshake_timeout

        def job() -> None:
            endpoint = f"{effect.host}:{effect.port}"
            try:
                payload = decode_handshake(
                    transport.fetch_handshake(effect.host, effect.port, timeout), peer=endpoint
                )
                if payload.engine_id != effect.engine_id:
                    raise KvHandoffError(
                        f"{endpoint} is engine {payload.engine_id!r}, not {effect.engine_id!r}"
                    )
                transport.connect(payload)
            except Exception as exc:  # any failure fails the handshake, never the thread
                log.warning("handshake with %s at %s failed: %s", effect.engine_id, endpoint, exc)
                results.append((effect.engine_id, False, str(exc)))
            else:
                results.append((effect.engine_id, True, ""))
            wake.set()

        self._submit_handshake(job)
