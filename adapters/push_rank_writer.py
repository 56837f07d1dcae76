"""The writer thread's half of one worker rank: one pass of the writer loop and the
executors of every effect the writer core returns (R-P04..R-P06, R-P12, R-T03..R-T05,
B-08, B-10, S-04, S-05).

`RankWriterSide` is mixed into `PushRank`, which owns the state it names below (the
transport, the writer core, the hand-offs). All of it runs on the writer thread, except
the handshake job, which runs on the handshake executor and only posts its result and
wakes the writer (R-P05). Effects are executed after each input, in order, so nothing a
later input changes (a revoked lease) can overtake an earlier one's WRITE. The WRITEs a
pass issued are posted together at its end, one transfer per D rank (B-13).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from kvhandoff.adapters.pull_reads import plan_reads, read_routes
from kvhandoff.adapters.push_transport import (
    EngineInfo,
    PushTransport,
    Routes,
    TransferHandle,
    peer_gone,
)
from kvhandoff.machines.kv.effects import (
    ArmSelfPoll,
    DisarmSelfPoll,
    DroppedRegistration,
    DropRemoteAgent,
    ForwardToMain,
    IssueRead,
    IssueWrite,
    RankRegistration,
    ReplayPush,
    ReplayRegistration,
    ReportToMain,
    SendPushFail,
    SendPushReg,
    StartHandshake,
    WriterCommand,
)
from kvhandoff.machines.kv.events import (
    ReadPosted,
    ReadSubmitFailed,
    RegSent,
    SendFailed,
    WritePosted,
    WriteSubmitFailed,
)
from kvhandoff.machines.push.scheduler import Mode, Role
from kvhandoff.machines.push.writer import GATHERED_COMMANDS, PushWriter
from kvhandoff.machines.rank.worker import WriterItem
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.protocol.auth import ClusterKey, NonceSource
from kvhandoff.protocol.blocks import check_within_capacity, expand_to_physical
from kvhandoff.protocol.errors import KvHandoffError, RemoteProtocolError
from kvhandoff.protocol.handshake import EXT_PUSH_FAIL, decode_engine_handshake
from kvhandoff.protocol.notifs import encode_completion_notif, encode_write_failed
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PushRegistration, encode_push_reg
from kvhandoff.protocol.tp_mapping import check_tp_sizes, write_targets, writers_of

log = logging.getLogger("kvhandoff.push.rank")

HandshakeJob = Callable[[], None]
HandshakeResult = tuple[str, int, bool, str]
"""(engine id, attempt, ok, detail): what a handshake job posts for the writer."""
Posted = tuple[str, list[tuple[int, TransferHandle | None]]]
"""(request id, [(remote rank, handle)]): transfers the writer posted, for the main thread.
A None handle is a pull READ that failed to post beside others that did: it polls as
failed once they ended, so the blocks are reused only after every posted READ ended."""


class RankWriterSide:
    """The writer loop's pass and effect executors (a mixin of `PushRank`)."""

    # Owned by PushRank.
    role: Role
    mode: Mode
    rank: int
    tp_rank: int
    clock: Clock
    wall_clock: Clock
    config: PushConfig
    key: ClusterKey | None
    nonces: NonceSource
    transport: PushTransport
    physical_blocks_per_logical: int
    writer: PushWriter
    self_poll_interval_s: float | None
    writes_in_flight: int
    writer_inbox: deque[WriterCommand]
    peer_lost_inbox: deque[str]
    handshake_results: deque[HandshakeResult]
    pending_completion_notifs: deque[WriterItem]
    posted_transfers: deque[Posted]
    wake: threading.Event
    failed_transfers: int
    dropped_observers: list[Callable[[DroppedRegistration], None]]
    _submit_handshake: Callable[[HandshakeJob], None]

    # -- one pass of the writer loop --------------------------------------------------

    def writer_pass(self) -> int:
        """Drain every inbox and the NIXL notifs once, executing what the writer core
        asks after each input; returns how many inputs were handled."""
        writer = self.writer
        now = self.clock()
        wall = self.wall_clock() if self.key is not None else None
        handled = 0
        if self.writes_in_flight:  # B-13: what landed since the last pass notifies D first
            self.writes_in_flight = self.transport.complete_writes(now)
        while self.peer_lost_inbox:
            writer.on_peer_lost(self.peer_lost_inbox.popleft(), now)
            self._execute(now)
            handled += 1
        while self.handshake_results:
            engine_id, attempt, ok, _detail = self.handshake_results.popleft()
            writer.on_handshake_result(engine_id, attempt, ok, now)
            self._execute(now)
            handled += 1
        inbox = self.writer_inbox
        if inbox:
            writer.gather(True)
            try:
                while inbox:
                    command = inbox.popleft()
                    if not isinstance(command, GATHERED_COMMANDS) and writer.hand_over(now):
                        self._execute(now)
                    writer.on_command(command, now)
                    self._execute(now)
                    handled += 1
            finally:
                writer.gather(False)
            self._execute(now)
        try:
            notifs = self.transport.get_new_notifs()
        except KvHandoffError as exc:
            log.warning("get_new_notifs failed: %s", exc)
            notifs = []
        for peer, message in notifs:
            writer.on_notif(peer, self.transport.identify(peer), message, now, wall)
            self._execute(now)
            handled += 1
        writer.advance(now)  # pending registrations, tombstones, handshakes, idle engines
        self._execute(now)
        self._flush_writes(now)
        self.writes_in_flight = self.transport.complete_writes(now)
        return handled

    def _flush_writes(self, now: float) -> None:
        """B-13: the WRITEs this pass issued leave as one transfer per D rank. A batch that
        fails to post fails each of its requests through its handle (B-10); a peer found
        gone is forgotten (B-08)."""
        errors = self.transport.flush_writes()
        for engine_id, exc in errors:
            log.warning("batched WRITE to %s failed to post: %s", engine_id, exc)
            self._forget_if_gone(engine_id, exc, now)
        if errors:
            self._execute(now)
            self.transport.flush_writes()

    def _execute(self, now: float) -> None:
        for effect in self.writer.take_effects():
            self._execute_one(effect, now)

    def _execute_one(self, effect: Effect, now: float) -> None:
        # The two kinds every push produces first.
        if isinstance(effect, IssueWrite):
            self._issue_write(effect.op, now)
        elif isinstance(effect, ReportToMain | ForwardToMain):
            self.pending_completion_notifs.append(effect)
        elif isinstance(effect, SendPushReg):
            self._send_push_reg(effect, now)
        elif isinstance(effect, IssueRead):
            self._issue_read(effect, now)
        elif isinstance(effect, SendPushFail):
            self._send_push_fail(effect.op, effect.reason, effect.d_ranks)
        elif isinstance(effect, StartHandshake):
            self._start_handshake(effect)
        elif isinstance(effect, DropRemoteAgent):
            self.transport.forget(effect.engine_id)
        elif isinstance(effect, DroppedRegistration):
            for observe in self.dropped_observers:
                observe(effect)
        elif isinstance(effect, ArmSelfPoll):
            self.self_poll_interval_s = effect.interval_s
        elif isinstance(effect, DisarmSelfPoll):
            self.self_poll_interval_s = None
        else:
            raise TypeError(f"no executor for writer effect {effect!r}")

    def _seal(self, message: bytes) -> bytes:
        """S-05: with a cluster key every control notif leaves sealed by this agent."""
        key = self.key
        if key is None:
            return message
        agent = self.transport.agent_name
        return key.seal(agent, message, nonce=self.nonces.next(), sealed_at=self.wall_clock())

    def _report(self, request_id: str, event: object) -> None:
        self.pending_completion_notifs.append(ReportToMain(request_id, event))  # type: ignore[arg-type]

    # -- D: PUSH_REG (R-P02, R-T04) -----------------------------------------------------

    def _send_push_reg(self, effect: SendPushReg, now: float) -> None:
        """To every P rank that writes into this one, every stage of a PP producer. B-08:
        when P's agent is gone (P restarted since the handshake: an idle D sent no
        heartbeat that would have found out), forget it, re-handshake and send once more
        before the registration fails."""
        request_id, reg = effect.request_id, effect.registration
        engine = reg.remote_engine_id
        info = self.transport.engine(engine)
        failure = ""
        if info is None:
            failure = f"{engine} is not connected"
        elif (info.tp_size, info.pp_size) != (reg.remote_tp_size, reg.remote_pp_size):
            failure = (
                f"{engine} runs TP {info.tp_size} x PP {info.pp_size}, the decode leg said"
                f" {reg.remote_tp_size} x {reg.remote_pp_size}"
            )
        else:
            message = self._seal(encode_push_reg(reg))
            ranks = writers_of(self.tp_rank, reg.decode_tp_size, info.tp_size, info.pp_size)
            for rank in ranks:
                try:
                    self.transport.send_notif(engine, rank, message)
                except KvHandoffError as exc:
                    if peer_gone(exc) and not effect.retried and rank == ranks[0]:
                        log.info("PUSH_REG %s: %s is gone; re-handshaking", request_id, engine)
                        self.writer.on_peer_lost(engine, now)
                        self.writer.retry(ReplayRegistration(request_id, reg, True), now)
                        self._execute(now)
                        return
                    failure = f"rank {rank}: {exc}"
                    self._forget_if_gone(engine, exc, now)
                    break
        if failure:
            log.warning("PUSH_REG %s to %s failed: %s", request_id, engine, failure)
            self._report(request_id, SendFailed())
        else:
            self._report(request_id, RegSent())

    # -- P: the WRITEs of a matched push (R-P06, R-T03, R-T05, S-04, B-10) -------------

    def _issue_write(self, op: ReplayPush, now: float) -> None:
        transport = self.transport
        info = transport.engine(op.engine_id)
        registrations = op.registrations
        try:
            if info is None:
                raise KvHandoffError(f"no connected agents for {op.engine_id}")
            for rr in registrations:
                _check_registration(info, rr.d_rank, rr.registration)
                if not _sent_by(info, rr):
                    if self._rehandshake_once(op, now):
                        return
                    # B-08: D restarted since it registered; its blocks now belong to others.
                    raise RemoteProtocolError(
                        f"registration {rr.registration.request_id} came from agent"
                        f" {rr.sender!r}; rank {rr.d_rank} of {op.engine_id} runs"
                        f" {info.agent(rr.d_rank)!r}: not written"
                    )
        except KvHandoffError as exc:
            self._write_submit_failed(op, exc, (), now)
            return
        tp_size = self.config.tp_size
        handles: list[tuple[int, TransferHandle]] = []
        failed: list[int] = []
        last_error = ""
        for target in write_targets(tp_size, self.tp_rank, info.tp_size):
            d_rank = target.d_rank
            reg = next(rr.registration for rr in registrations if rr.d_rank == d_rank)
            try:
                local, remote = self._physical_pair(info, d_rank, op.block_ids, reg)
                notif = encode_completion_notif(reg.request_id, tp_size)
                if self.key is not None:
                    notif = self._seal(notif)
                handle = transport.write_blocks(
                    op.engine_id,
                    d_rank,
                    local,
                    remote,
                    notif,
                    local_chunk=target.local,
                    remote_chunk=target.remote,
                )
            except KvHandoffError as exc:
                log.warning("WRITE %s to rank %d failed to post: %s", op.request_id, d_rank, exc)
                failed.append(d_rank)
                last_error = str(exc)
                self._forget_if_gone(op.engine_id, exc, now)
                continue
            handles.append((d_rank, handle))
        if not handles:
            error = KvHandoffError(f"every WRITE failed to post: {last_error}")
            self._write_submit_failed(op, error, (), now)
            return
        self.writer.on_issued(op.request_id, now)
        if self.writer.has_effects:
            self._execute(now)
        if failed:
            self.failed_transfers += len(failed)
            self._send_push_fail(op, f"WRITE failed to post: {last_error}", tuple(failed))
        self.posted_transfers.append((op.request_id, handles))
        self._report(op.request_id, WritePosted(len(handles)))

    def _physical_pair(
        self, info: EngineInfo, d_rank: int, p_blocks: tuple[int, ...], reg: PushRegistration
    ) -> tuple[list[int], list[int]]:
        """R-P06, R-T05: D's logical ids and the tail of P's that D lacks, both expanded
        to physical ids; D's checked against the capacity it registered (S-04)."""
        remote_logical = reg.block_ids
        if len(remote_logical) > len(p_blocks):
            raise RemoteProtocolError(
                f"{reg.request_id} registers {len(remote_logical)} blocks; P holds {len(p_blocks)}"
            )
        local_logical = p_blocks[len(p_blocks) - len(remote_logical) :]
        rank = info.ranks[d_rank]
        remote = expand_to_physical(remote_logical, rank.physical_blocks_per_logical)
        check_within_capacity(reg.request_id, remote, rank.capacity, engine_id=info.engine_id)
        local = expand_to_physical(local_logical, self.physical_blocks_per_logical)
        if len(local) != len(remote):
            raise RemoteProtocolError(
                f"{reg.request_id}: {len(local)} physical blocks here, {len(remote)} on"
                f" {info.engine_id}"
            )
        return local, remote

    def _rehandshake_once(self, op: ReplayPush, now: float) -> bool:
        """B-08: a `PUSH_REG` came from another agent than the one we know for its rank.
        Either our connection is stale (D restarted, then registered) or the registration
        is (D registered, then restarted). Forget the agents, re-handshake and try once
        more: a registration that still disagrees with the fresh agents is stale."""
        if op.retried:
            return False
        self.writer.on_peer_lost(op.engine_id, now)
        self.writer.retry(replace(op, retried=True), now)
        self._execute(now)
        return True

    def _write_submit_failed(
        self, op: ReplayPush, exc: KvHandoffError, ranks: tuple[int, ...], now: float
    ) -> None:
        """R-P12: count it, no failed-recv entry here; B-10: tell D so it fails at once."""
        self.failed_transfers += 1
        log.warning("WRITE for %s failed to post: %s", op.request_id, exc)
        self._forget_if_gone(op.engine_id, exc, now)
        self._send_push_fail(op, str(exc), ranks)
        self.writer.on_issued(op.request_id, now)
        self._execute(now)
        cause = "peer_gone" if peer_gone(exc) else "post"
        self._report(op.request_id, WriteSubmitFailed(cause))

    def _send_push_fail(self, op: ReplayPush, reason: str, ranks: tuple[int, ...]) -> None:
        """B-10, C-04: `PUSH_FAIL` only to D ranks whose engine advertised it."""
        info = self.transport.engine(op.engine_id)
        if info is None or EXT_PUSH_FAIL not in info.extensions:
            return
        wanted = set(ranks)
        for rr in op.registrations:
            if wanted and rr.d_rank not in wanted:
                continue
            message = self._seal(encode_write_failed(rr.registration.request_id, reason))
            try:
                self.transport.send_notif(op.engine_id, rr.d_rank, message)
            except KvHandoffError as exc:
                log.warning("PUSH_FAIL to %s rank %d lost: %s", op.engine_id, rr.d_rank, exc)

    # -- pull mode (B-09) --------------------------------------------------------------

    def _issue_read(self, effect: IssueRead, now: float) -> None:
        """One READ per P rank this rank reads from (`pull_reads.plan_reads`), each carrying
        its completion notif; a READ that fails to post beside posted ones fails the
        request once those ended (B-09, R-T03)."""
        source = effect.source
        engine = source.prefill.engine_id
        try:
            local, plan = plan_reads(
                effect.request_id,
                effect.block_ids,
                source,
                self.transport.engine(engine),
                tp_size=self.config.tp_size,
                tp_rank=self.tp_rank,
                physical_blocks_per_logical=self.physical_blocks_per_logical,
            )
            notif = self._seal(encode_completion_notif(source.request_id, self.config.tp_size))
        except KvHandoffError as exc:
            self._read_submit_failed(effect.request_id, engine, exc, now)
            return
        handles: list[tuple[int, TransferHandle | None]] = []
        for read, remote in plan:
            try:
                handle = self.transport.read_blocks(
                    engine,
                    read.p_rank,
                    local,
                    remote,
                    notif,
                    local_chunk=read.local,
                    remote_chunk=read.remote,
                )
            except KvHandoffError as exc:
                if not handles:
                    self._read_submit_failed(effect.request_id, engine, exc, now)
                    return
                log.warning(
                    "READ %s from rank %d failed to post: %s", effect.request_id, read.p_rank, exc
                )
                self._forget_if_gone(engine, exc, now)
                handles.append((read.p_rank, None))
                continue
            handles.append((read.p_rank, handle))
        self.posted_transfers.append((effect.request_id, handles))
        self._report(effect.request_id, ReadPosted())

    def _read_submit_failed(
        self, request_id: str, engine: str, exc: KvHandoffError, now: float
    ) -> None:
        log.warning("READ for %s failed to post: %s", request_id, exc)
        self.failed_transfers += 1
        self._forget_if_gone(engine, exc, now)
        self._report(request_id, ReadSubmitFailed())

    # -- peers --------------------------------------------------------------------------

    def _forget_if_gone(self, engine_id: str, exc: BaseException, now: float) -> None:
        """B-08: when the error says the peer is gone, forget its agents so the next
        operation re-handshakes (a restarted peer has new agents)."""
        if peer_gone(exc):
            self.writer.on_peer_lost(engine_id, now)
            self.wake.set()

    def _routes(self, engine_tp: int) -> Routes:
        """The remote ranks this rank moves data with, and their chunks (R-T03)."""
        if self.role == "prefill" and self.mode == "push":
            check_tp_sizes(self.config.tp_size, engine_tp)
            targets = write_targets(self.config.tp_size, self.tp_rank, engine_tp)
            return {t.d_rank: (t.local.count, t.remote.count) for t in targets}
        if self.role == "decode" and self.mode == "pull":
            return read_routes(self.config.tp_size, self.tp_rank, engine_tp)
        return {}

    def _start_handshake(self, effect: StartHandshake) -> None:
        """R-P05: run on the executor; the callback only posts the result and wakes."""
        transport = self.transport
        results = self.handshake_results
        wake = self.wake
        timeout = self.config.handshake_timeout
        routes = self._routes

        def job() -> None:
            endpoint = f"{effect.host}:{effect.port}"
            tp, pp = effect.tp_size, effect.pp_size
            try:
                ranks = [(p, t) for p in range(pp) for t in range(tp)]
                engine = decode_engine_handshake(
                    transport.fetch_handshake(effect.host, effect.port, timeout, ranks),
                    peer=endpoint,
                    engine_id=effect.engine_id,
                    tp_size=tp,
                    pp_size=pp,
                )
                transport.connect(engine, routes(engine.tp_size))
            except Exception as exc:  # any failure fails the handshake, never the thread
                log.warning("handshake with %s at %s failed: %s", effect.engine_id, endpoint, exc)
                results.append((effect.engine_id, effect.attempt, False, str(exc)))
            else:
                results.append((effect.engine_id, effect.attempt, True, ""))
            wake.set()

        self._submit_handshake(job)


def _sent_by(info: EngineInfo, rr: RankRegistration) -> bool:
    """B-08: the registration came from the agent D's handshake names for its rank, or,
    from a stock vLLM D that names no rank (C-01), from one of D's agents."""
    if rr.registration.decode_tp_rank is None:
        return any(rr.sender == rank.agent_name for rank in info.ranks)
    return rr.sender == info.agent(rr.d_rank)


def _check_registration(info: EngineInfo, d_rank: int, reg: PushRegistration) -> None:
    """S-04: a registration agrees with what D's own handshake says."""
    if reg.decode_tp_size != info.tp_size or info.pp_size != 1:
        raise RemoteProtocolError(
            f"{reg.request_id} names D as TP {reg.decode_tp_size}; {info.engine_id} runs"
            f" TP {info.tp_size} x PP {info.pp_size}"
        )
    if not 0 <= d_rank < len(info.ranks):
        raise RemoteProtocolError(f"{reg.request_id} names rank {d_rank} of {info.engine_id}")
