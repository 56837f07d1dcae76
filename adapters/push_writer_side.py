"""The writer thread's half of `PushSide`: one pass of the writer loop and the executors
of every effect the writer core returns (R-P04..R-P06, R-P12, B-06, B-08).

`PushWriterSide` is mixed into `PushSide`, which owns the state it names below (the
transport, the writer core and its bus, the cross-thread hand-offs, the lease lock). All
of it runs on the writer thread, except the handshake job, which runs on the handshake
executor and only posts its result and wakes the writer (R-P05).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from kvhandoff.adapters.push_transport import PeerInfo, PushTransport, TransferHandle, peer_gone
from kvhandoff.machines.push.effects import (
    ArmSelfPoll,
    DisarmSelfPoll,
    DropRemoteAgent,
    ForwardToMain,
    IssueRead,
    IssueWrite,
    ReplayPush,
    ReplayRead,
    ReplayRegistration,
    ReportToMain,
    SendPushReg,
    StartHandshake,
)
from kvhandoff.machines.push.events import (
    ReadPosted,
    ReadSubmitFailed,
    RegSent,
    SendFailed,
    WritePosted,
    WriteSubmitFailed,
)
from kvhandoff.machines.push.scheduler import LocalEngine
from kvhandoff.machines.push.worker import WriterItem
from kvhandoff.machines.push.writer import PushWriter
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.protocol.blocks import check_within_capacity, expand_to_physical
from kvhandoff.protocol.errors import KvHandoffError
from kvhandoff.protocol.handshake import decode_handshake
from kvhandoff.protocol.notifs import encode_completion_notif, encode_write_failed
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import encode_push_reg

log = logging.getLogger("kvhandoff.push.side")

HandshakeJob = Callable[[], None]
HandshakeResult = tuple[str, bool, str]
"""(engine id, ok, detail): what a handshake job posts for the writer."""


class PushWriterSide:
    """The writer loop's pass and effect executors (a mixin of `PushSide`)."""

    # Owned by PushSide.
    clock: Clock
    engine: LocalEngine
    config: PushConfig
    transport: PushTransport
    physical_blocks_per_logical: int
    writer: PushWriter
    writer_bus: EventBus
    self_poll_interval_s: float | None
    reg_send_inbox: deque[ReplayRegistration]
    finished_blocks_inbox: deque[tuple[str, tuple[int, ...]]]
    deferred_push_inbox: deque[ReplayPush]
    evict_finished_inbox: deque[str]
    pull_read_inbox: deque[ReplayRead]
    peer_lost_inbox: deque[str]
    handshake_results: deque[HandshakeResult]
    pending_completion_notifs: deque[WriterItem]
    wake: threading.Event
    failed_transfers: int
    _submit_handshake: Callable[[HandshakeJob], None]
    _posted_transfers: deque[tuple[str, TransferHandle]]
    _rehandshaked: set[str]
    _lease_lock: threading.Lock
    _ended_leases: set[str]

    def writer_pass(self) -> int:
        """Drain every inbox and the transport's notifs once; execute the effects.

        Reads the clock once. Returns how many items were handled, so a caller can tell
        idle from busy.
        """
        writer = self.writer
        now = self.clock()
        handled = 0
        while self.peer_lost_inbox:
            writer.on_peer_lost(self.peer_lost_inbox.popleft(), now)
            handled += 1
        while self.handshake_results:
            engine_id, ok, _detail = self.handshake_results.popleft()
            writer.on_handshake_result(engine_id, ok, now)
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
            writer.on_reg_send(op.request_id, op.registration, now)
            handled += 1
        while self.finished_blocks_inbox:
            request_id, block_ids = self.finished_blocks_inbox.popleft()
            writer.on_finished_blocks(request_id, block_ids, now)
            handled += 1
        while self.deferred_push_inbox:
            writer.on_deferred_push(self.deferred_push_inbox.popleft(), now)
            handled += 1
        while self.pull_read_inbox:
            writer.on_pull_read(self.pull_read_inbox.popleft(), now)
            handled += 1
        try:
            notifs = self.transport.get_new_notifs()
        except KvHandoffError as exc:
            log.warning("get_new_notifs failed: %s", exc)
            notifs = []
        for peer, message in notifs:
            writer.on_notif(peer, message, now)
            handled += 1
        writer.expire_pending(now)
        self.writer_bus.advance(now)  # the handshake timeouts due by now
        for effect in writer.take_effects():
            self._execute_writer_effect(effect, now)
        return handled

    def _execute_writer_effect(self, effect: Effect, now: float) -> None:
        if isinstance(effect, ReportToMain | ForwardToMain):
            self.pending_completion_notifs.append(effect)
        elif isinstance(effect, SendPushReg):
            self._send_push_reg(effect, now)
        elif isinstance(effect, IssueWrite):
            self._issue_write(effect, now)
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
            self._issue_read(effect, now)
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

    def _send_push_reg(self, effect: SendPushReg, now: float) -> None:
        reg = effect.registration
        try:
            self.transport.send_notif(reg.remote_engine_id, encode_push_reg(reg))
        except KvHandoffError as exc:
            log.warning(
                "PUSH_REG %s to %s failed: %s", effect.request_id, reg.remote_engine_id, exc
            )
            self.pending_completion_notifs.append(ReportToMain(effect.request_id, SendFailed()))
            self._forget_if_gone(reg.remote_engine_id, exc, now)
        else:
            self.pending_completion_notifs.append(ReportToMain(effect.request_id, RegSent()))

    def _forget_if_gone(self, engine_id: str, exc: BaseException, now: float) -> None:
        """B-08: when the error says the peer is gone, drop its agent so the next operation
        re-handshakes (a restarted peer has a new agent) instead of using a dead one
        forever. A failure of one operation leaves a live peer and its in-flight
        transfers alone."""
        if peer_gone(exc):
            self._peer_lost(engine_id, now)

    def _issue_write(self, effect: IssueWrite, now: float) -> None:
        """R-P06: expand D's logical ids, WRITE into D's memory, completion notif to D;
        only while the lease on the blocks stands (see `_lease_lock`)."""
        with self._lease_lock:
            if effect.request_id in self._ended_leases:
                reason = "its lease ended before the WRITE was posted"
                self._write_submit_failed(effect, KvHandoffError(reason), now)
                return
            self._post_write(effect, now)

    def _post_write(self, effect: IssueWrite, now: float) -> None:
        reg = effect.registration
        peer = self.transport.peer(reg.decode_engine_id)
        try:
            if peer is None:
                raise KvHandoffError(f"no connected agent for {reg.decode_engine_id}")
            if effect.sender_agent and effect.sender_agent != peer.agent_name:
                if self._rehandshake_once(effect, now):
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
            self._write_submit_failed(effect, exc, now)
            return
        try:
            handle = self.transport.write_blocks(reg.decode_engine_id, local, remote, notif)
        except KvHandoffError as exc:
            self._write_submit_failed(effect, exc, now)
            return
        self._rehandshaked.discard(effect.request_id)
        self._posted_transfers.append((effect.request_id, handle))
        self.pending_completion_notifs.append(ReportToMain(effect.request_id, WritePosted()))

    def _rehandshake_once(self, effect: IssueWrite, now: float) -> bool:
        """B-08: the PUSH_REG came from another agent than the one we are connected to.
        Either our connection is stale (D restarted, then registered) or the registration
        is (D registered, then restarted). Forget the agent, re-handshake and try once
        more: a registration that still disagrees with the fresh agent is stale."""
        if effect.request_id in self._rehandshaked:
            self._rehandshaked.discard(effect.request_id)
            return False
        self._rehandshaked.add(effect.request_id)
        self._peer_lost(effect.registration.decode_engine_id, now)
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

    def _issue_read(self, effect: IssueRead, now: float) -> None:
        """Pull mode (B-09): READ P's blocks into D's; the notif tells P to free its lease.
        Posted and reported under the lease lock, as a WRITE is: D's watchdog never gives
        up blocks a posted READ writes into, and a read that ended is never posted."""
        with self._lease_lock:
            self._post_read(effect, now)

    def _post_read(self, effect: IssueRead, now: float) -> None:
        source = effect.source
        peer = self.transport.peer(source.prefill.engine_id)
        try:
            if effect.request_id in self._ended_leases:
                raise KvHandoffError("the read ended before its READ was posted")
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
            self._forget_if_gone(source.prefill.engine_id, exc, now)
            self.pending_completion_notifs.append(
                ReportToMain(effect.request_id, ReadSubmitFailed())
            )
            return
        self._posted_transfers.append((effect.request_id, handle))
        self.pending_completion_notifs.append(ReportToMain(effect.request_id, ReadPosted()))

    def _peer_lost(self, engine_id: str, now: float) -> None:
        """B-08: a send or WRITE to a connected peer failed. Forget its agent, so the next
        operation re-handshakes (a restarted peer has a new agent) instead of using a dead
        agent forever."""
        self.writer.on_peer_lost(engine_id, now)
        self.wake.set()

    def _write_submit_failed(self, effect: IssueWrite, exc: KvHandoffError, now: float) -> None:
        """R-P12: count it, no failed-recv entry here; B-06: tell D so it fails at once."""
        reg = effect.registration
        self.failed_transfers += 1
        log.warning("WRITE for %s failed to post: %s", effect.request_id, exc)
        self._forget_if_gone(reg.decode_engine_id, exc, now)
        try:
            self.transport.send_notif(
                reg.decode_engine_id, encode_write_failed(reg.request_id, str(exc))
            )
        except KvHandoffError as notif_exc:
            log.warning("WRITE-failed notif to %s lost: %s", reg.decode_engine_id, notif_exc)
        self.pending_completion_notifs.append(ReportToMain(effect.request_id, WriteSubmitFailed()))

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
