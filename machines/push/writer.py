"""The push writer's core: matching, remote engines, notif routing and the wake policy,
for one worker rank (R-P04..R-P09, R-T03, R-T05, S-02..S-06).

This is the logic of the rank's one `kvhandoff-push-writer` thread, without the thread:
the thread feeds it its inputs (the main thread's typed commands, the handshake
executor's results, NIXL notifs) and executes the effects it returns (`take_effects`).
Every decision is a declared machine on the writer's own bus: `push.match` pairs D's
`PUSH_REG`s with P's blocks, `push.remote_engine` holds each peer engine's handshake.

- R-P04: either side may arrive first; a match slot per base request id pairs them.
- R-P05: an operation whose peer is not connected waits in the peer's remote-engine
  machine and runs in the writer pass that takes the handshake's result.
- R-P07: while P's blocks wait for `PUSH_REG`s the writer self-polls.
- R-P08: the writer is the sole consumer of notifs: `PUSH_REG` goes to matching; `HB:`,
  completion and `PUSH_FAIL` notifs go to the main thread with the sender's engine and
  rank as far as this rank knows them.
- S-04: a `PUSH_REG` must name this engine, its TP and PP sizes, a D TP size that maps
  onto this one and a D rank this rank writes into; an agent of a known engine may not
  register for another one. S-03: registrations waiting for their blocks are capped per
  peer and in total. S-05: with a cluster key, every notif must be sealed by its sender.
- Bad input from a peer raises nothing here: it is counted and logged per peer,
  rate-limited (`rejections`, S-06), and changes no state.

Time is an argument: every entry point takes `now`.
"""

from __future__ import annotations

import logging
from typing import Any

from kvhandoff.machines.kv.effects import (
    ArmSelfPoll,
    CancelDeferred,
    DeferredFailed,
    DeferredOp,
    DisarmSelfPoll,
    DroppedRegistration,
    DropRemoteAgent,
    EvictRegistration,
    ForwardToMain,
    HoldPending,
    IssueRead,
    IssueWrite,
    RankRegistration,
    ReplayPush,
    ReplayRead,
    ReplayRegistration,
    ReportToMain,
    ReportWriteError,
    RevokeLease,
    SendPushFail,
    SendPushReg,
    SendRegistration,
    StageBlocks,
    StartHandshake,
    StartRead,
    WriterCommand,
)
from kvhandoff.machines.kv.events import HandshakeFailed, Revoked
from kvhandoff.machines.push.match import (
    MATCH,
    BlocksArrived,
    Issued,
    MatchCtx,
    RegArrived,
    Revoke,
)
from kvhandoff.machines.push.remote_engine import (
    REMOTE_ENGINE,
    Cancel,
    Ensure,
    Failed,
    PeerLost,
    RemoteEngineCtx,
    Succeeded,
    Touch,
)
from kvhandoff.machines.push.scheduler import Mode, Role
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.auth import ClusterKey, ReplayWindow, is_sealed
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.notifs import PushRegNotif, parse_notif
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PushRegistration
from kvhandoff.protocol.request_ids import get_base_request_id
from kvhandoff.protocol.tp_mapping import check_tp_sizes, split_rank, write_targets

log = logging.getLogger("kvhandoff.push.writer")

Identity = tuple[str, int] | None
"""(engine id, global rank) of a sending agent, or None when it belongs to no known engine."""

GATHERED_COMMANDS = (SendRegistration, StageBlocks, StartRead)
"""Commands that only start operations: a run of them hands its engines their operations
together (`PushWriter.gather`)."""

_COLLECTED = (
    ReportToMain,
    StartHandshake,
    DropRemoteAgent,
    DroppedRegistration,
    SendPushFail,
)


class PushWriter:
    """One rank's writer core (see the module docstring)."""

    def __init__(
        self,
        role: Role,
        engine_id: str,
        config: PushConfig | None = None,
        mode: Mode = "push",
        *,
        rank: int = 0,
        bus: EventBus | None = None,
        started_at: float = 0.0,
    ) -> None:
        """`started_at`: this process's start on the wall clock that sealed notifs are
        checked against (S-05: what was sealed before it is a replay)."""
        self.role = role
        self.engine_id = engine_id
        self.config = cfg = config or PushConfig()
        self.mode = mode
        self.rank = rank
        self.pp_rank, self.tp_rank = split_rank(rank, cfg.tp_size)
        self.bus = bus or EventBus()
        machine_config = cfg.machine_config()
        self.bus.register(MATCH, machine_config)
        self.bus.register(REMOTE_ENGINE, machine_config)
        self.key = ClusterKey.from_text(cfg.cluster_key) if cfg.cluster_key else None
        self.replay = ReplayWindow(started_at, ttl=cfg.sealed_notif_ttl, skew=cfg.sealed_notif_skew)
        self.poll_interval_s = cfg.push_writer_poll_interval_ms / 1000.0
        self.self_polling = False
        self.rejections = RejectionLog(log, what="notif")
        self.dropped: dict[str, int] = {}
        # S-03 accounting (counters, not lifecycles: the match slots hold the registrations).
        self.pending_by_peer: dict[str, int] = {}
        self.pending_blocks_by_peer: dict[str, int] = {}
        self.pending_count = 0
        self.pending_blocks = 0
        self.unknown_count = 0  # held for agents of no connected engine
        self.unknown_blocks = 0
        # Slots whose blocks wait for PUSH_REGs (R-P07): the tag's members, kept by the bus.
        self._awaiting = self.bus.machine(MATCH).watch("awaiting_registration")
        self._heard: set[str] = set()  # engines heard from since the last `advance` (B-11)
        self._effects: list[Effect] = []
        # Operations of a run of commands, per remote engine, until `hand_over` gives
        # them over (None: every operation goes to its engine at once).
        self._gathered: dict[str, list[DeferredOp]] | None = None
        bus = self.bus
        for effect_type in _COLLECTED:
            bus.handle(effect_type, self._collect)
        bus.handle(ReplayRegistration, self._on_op)
        bus.handle(ReplayPush, self._on_op)
        bus.handle(ReplayRead, self._on_op)
        bus.handle(DeferredFailed, self._on_deferred_failed)
        bus.handle(CancelDeferred, self._on_cancel_deferred)
        bus.handle(HoldPending, self._on_hold)

    @property
    def rejected_notifs(self) -> int:
        """Inputs from peers that were refused (counted, never raised)."""
        return self.rejections.total

    def take_effects(self) -> list[Effect]:
        """The effects produced since the last call, in order."""
        effects, self._effects = self._effects, []
        return effects

    @property
    def has_effects(self) -> bool:
        """Whether `take_effects` would return any."""
        return bool(self._effects)

    def awaiting_registration(self) -> bool:
        return bool(self._awaiting)

    @property
    def awaiting_count(self) -> int:
        """Match slots whose blocks wait for `PUSH_REG`s (R-P07)."""
        return len(self._awaiting)

    # -- inputs ---------------------------------------------------------------------------

    def on_command(self, command: WriterCommand, now: float) -> None:
        """One typed command from the main thread, in the order it was given."""
        self.bus.advance(now)
        if isinstance(command, SendRegistration):
            op: DeferredOp = ReplayRegistration(command.request_id, command.registration)
            self._through(command.registration.remote_engine_id, op, now)
        elif isinstance(command, StageBlocks):
            self._to_slot(command.request_id, BlocksArrived(command.request_id, command.block_ids))
        elif isinstance(command, RevokeLease):
            if self.bus.get(MATCH, get_base_request_id(command.request_id)) is None:
                self._effects.append(ReportToMain(command.request_id, Revoked()))
            else:
                self._to_slot(command.request_id, Revoke(command.request_id))
        elif isinstance(command, ReportWriteError):
            self._tell_write_error(command)
        elif isinstance(command, EvictRegistration):
            self._cancel_everywhere(command.request_id)
        elif isinstance(command, StartRead):
            read = ReplayRead(command.request_id, command.source, command.block_ids)
            self._through(command.source.prefill.engine_id, read, now)
        else:
            self._cancel_everywhere(command.request_id)
            self._effects.append(ReportToMain(command.request_id, Revoked()))
        self._update_self_poll()

    def gather(self, on: bool) -> None:
        """While on, the operations that commands send through a remote engine (PUSH_REGs,
        pushes, READs) wait, per engine, for `hand_over`, which gives each engine its
        operations together in one `Ensure`. A writer pass gathers over a run of
        `GATHERED_COMMANDS` and hands over before any other command (a revoked lease, an
        eviction), whose change nothing sent earlier may overtake. Off hands over first."""
        if not on:
            self.hand_over(self.bus.now)
        self._gathered = {} if on else None

    def hand_over(self, now: float) -> bool:
        """Give each remote engine the operations gathered for it; True if there were any
        (their effects are then waiting in `take_effects`)."""
        gathered = self._gathered
        if not gathered:
            return False
        self._gathered = {}
        for engine_id, ops in gathered.items():
            self._ensure(engine_id, tuple(ops), now)
        self._update_self_poll()
        return True

    def on_handshake_result(self, engine_id: str, attempt: int, ok: bool, now: float) -> None:
        # Due timers first: an engine evicted by now takes no late result.
        self.bus.advance(now)
        if self.bus.get(REMOTE_ENGINE, engine_id) is not None:
            event = Succeeded(attempt) if ok else Failed(attempt)
            self.bus.dispatch(REMOTE_ENGINE, engine_id, event, now)
        self._update_self_poll()

    def on_peer_lost(self, engine_id: str, now: float) -> None:
        """B-08: a send or WRITE found the peer gone: forget its agents."""
        self.bus.advance(now)
        if self.bus.get(REMOTE_ENGINE, engine_id) is not None:
            self.bus.dispatch(REMOTE_ENGINE, engine_id, PeerLost(), now)

    def on_issued(self, p_request_id: str, now: float) -> None:
        """The push of `p_request_id` was posted or failed to post."""
        base = get_base_request_id(p_request_id)
        bus = self.bus
        if bus.get(MATCH, base) is not None:
            bus.dispatch(MATCH, base, Issued(p_request_id), bus.now)
            self._update_self_poll()

    def retry(self, op: ReplayPush | ReplayRegistration, now: float) -> None:
        """Send a push, or a `PUSH_REG`, through the peer's remote engine again (after its
        agents were forgotten, B-08)."""
        engine = op.engine_id if isinstance(op, ReplayPush) else op.registration.remote_engine_id
        self._ensure(engine, (op,), now)

    def advance(self, now: float) -> None:
        """Fire what is due by `now` (pending registrations, tombstones, handshakes,
        idle engines), then keep every engine heard from since the last call alive (B-11:
        one `Touch` per engine and pass, however many notifs it sent; the writer pass
        ends with this call, at the time its notifs were taken)."""
        self.bus.advance(now)
        if self._heard:
            for engine_id in self._heard:
                self._touch(engine_id, now)
            self._heard.clear()
        self._update_self_poll()

    def on_notif(
        self, peer: str, identity: Identity, data: bytes, now: float, wall: float | None = None
    ) -> None:
        """Route one notif from `get_new_notifs` (R-P08). `wall`: the wall-clock time that
        sealed notifs are checked against (S-05; `now` when None)."""
        self.bus.advance(now)
        try:
            if self.key is not None:
                opened = self.key.open(peer, data)
                data = self.replay.admit(opened, now if wall is None else wall, peer)
            elif is_sealed(data):
                raise RemoteProtocolError("sealed notif, but no cluster key is configured")
            notif = parse_notif(data, peer=peer)
            engine, rank = identity if identity is not None else (None, None)
            if engine is not None:
                self._heard.add(engine)  # kept alive once per pass, by `advance`
            if isinstance(notif, PushRegNotif):
                if self.role != "prefill" or self.mode != "push":
                    raise RemoteProtocolError(f"PUSH_REG sent to a {self.role} instance")
                self._on_push_reg(notif.registration, peer, engine, now)
            else:
                self._effects.append(ForwardToMain(notif, peer, engine, rank, now))
        except RemoteProtocolError as exc:
            self.reject(peer, exc, now)
        self._update_self_poll()

    def reject(self, peer: str | None, exc: RemoteProtocolError | str, now: float) -> None:
        self.rejections.reject(peer, exc, now)

    # -- matching (R-P04) --------------------------------------------------------------

    def _on_push_reg(
        self, reg: PushRegistration, sender: str, sender_engine: str | None, now: float
    ) -> None:
        cfg = self.config
        if reg.remote_engine_id != self.engine_id:
            raise RemoteProtocolError(f"PUSH_REG for engine {reg.remote_engine_id!r}", peer=sender)
        if (reg.remote_tp_size, reg.remote_pp_size) != (cfg.tp_size, cfg.pp_size):
            raise RemoteProtocolError(
                f"PUSH_REG {reg.request_id!r} names P as TP {reg.remote_tp_size} x PP"
                f" {reg.remote_pp_size}; this engine is {cfg.tp_size} x {cfg.pp_size}",
                peer=sender,
            )
        if not reg.block_ids:
            raise RemoteProtocolError(
                f"PUSH_REG {reg.request_id!r} registers no blocks", peer=sender
            )
        check_tp_sizes(cfg.tp_size, reg.decode_tp_size, peer=sender)
        targets = sorted(
            t.d_rank for t in write_targets(cfg.tp_size, self.tp_rank, reg.decode_tp_size)
        )
        if reg.decode_tp_rank is not None and reg.decode_tp_rank not in targets:
            raise RemoteProtocolError(
                f"PUSH_REG {reg.request_id!r} of D rank {reg.decode_tp_rank}, which P rank"
                f" {self.rank} does not write into",
                peer=sender,
            )
        if sender_engine is not None and sender_engine != reg.decode_engine_id:
            raise RemoteProtocolError(
                f"an agent of engine {sender_engine!r} registers for {reg.decode_engine_id!r}",
                peer=sender,
            )
        # C-01: a stock vLLM D names no rank; its ranks all register the same blocks, so
        # one registration stands for every D rank this P rank writes into.
        d_ranks = targets if reg.decode_tp_rank is None else [reg.decode_tp_rank]
        known = sender_engine is not None
        for d_rank in d_ranks:
            self._check_caps(sender, len(reg.block_ids), known)
            event = RegArrived(RankRegistration(d_rank, reg, sender, known))
            self._to_slot(reg.request_id, event)

    def _check_caps(self, peer: str, blocks: int, known: bool) -> None:
        """S-03: what one agent, the agents of no connected engine together, and every
        peer together can make this rank hold. The unknown agents' share is half of each
        total, so however many names a flood invents, connected engines keep the rest."""
        cfg = self.config
        if self.pending_by_peer.get(peer, 0) >= cfg.max_pending_registrations_per_peer:
            raise RemoteProtocolError(
                f"over the cap of {cfg.max_pending_registrations_per_peer} waiting PUSH_REGs"
                " per peer",
                peer=peer,
            )
        held = self.pending_blocks_by_peer.get(peer, 0)
        if held + blocks > cfg.max_pending_block_ids_per_peer:
            raise RemoteProtocolError(
                f"over the cap of {cfg.max_pending_block_ids_per_peer} block ids in one"
                " peer's waiting PUSH_REGs",
                peer=peer,
            )
        if not known and (
            self.unknown_count >= cfg.max_pending_registrations // 2
            or self.unknown_blocks + blocks > cfg.max_pending_block_ids // 2
        ):
            raise RemoteProtocolError(
                "over the share of waiting PUSH_REGs for agents of no connected engine",
                peer=peer,
            )
        if self.pending_count >= cfg.max_pending_registrations:
            raise RemoteProtocolError(
                f"over the cap of {cfg.max_pending_registrations} waiting PUSH_REGs", peer=peer
            )
        if self.pending_blocks + blocks > cfg.max_pending_block_ids:
            raise RemoteProtocolError(
                f"over the cap of {cfg.max_pending_block_ids} block ids in waiting PUSH_REGs",
                peer=peer,
            )

    def _to_slot(
        self, request_id: str, event: RegArrived | BlocksArrived | Revoke | Issued
    ) -> None:
        base = get_base_request_id(request_id)
        bus = self.bus
        if bus.get(MATCH, base) is None:
            ctx = MatchCtx(base, p_tp=self.config.tp_size, p_tp_rank=self.tp_rank)
            bus.create(MATCH, ctx, bus.now)
        bus.dispatch(MATCH, base, event, bus.now)

    def _tell_write_error(self, command: ReportWriteError) -> None:
        inst = self.bus.get(MATCH, get_base_request_id(command.request_id))
        push = None if inst is None else inst.ctx.push
        if push is not None and push.request_id == command.request_id:
            self._effects.append(SendPushFail(push, command.reason, command.d_ranks))

    # -- remote engines (R-P05, B-08, B-11) --------------------------------------------

    def _through(self, engine_id: str, op: DeferredOp, now: float) -> None:
        gathered = self._gathered
        if gathered is None:
            self._ensure(engine_id, (op,), now)
        elif engine_id in gathered:
            gathered[engine_id].append(op)
        else:
            gathered[engine_id] = [op]

    def _ensure(self, engine_id: str, ops: tuple[DeferredOp, ...], now: float) -> None:
        bus = self.bus
        if bus.get(REMOTE_ENGINE, engine_id) is None:
            ctx = RemoteEngineCtx(engine_id, "", 0, ttl=self.config.engine_ttl)
            bus.create(REMOTE_ENGINE, ctx, now)
        bus.dispatch(REMOTE_ENGINE, engine_id, Ensure(ops), now)

    def _touch(self, engine_id: str, now: float) -> None:
        if self.bus.get(REMOTE_ENGINE, engine_id) is not None:
            self.bus.dispatch(REMOTE_ENGINE, engine_id, Touch(), now)

    def is_connected(self, engine_id: str) -> bool:
        return self.bus.has_tag(REMOTE_ENGINE, engine_id, "peer_ready")

    def _cancel_everywhere(self, request_id: str) -> None:
        bus = self.bus
        for inst in bus.tagged(REMOTE_ENGINE, "deferring"):
            bus.dispatch(REMOTE_ENGINE, inst.key, Cancel(request_id), bus.now)

    # -- effect handlers ------------------------------------------------------------------

    def _collect(self, _inst: Instance[Any] | None, effect: Effect) -> None:
        if isinstance(effect, DroppedRegistration):
            self.dropped[effect.reason] = self.dropped.get(effect.reason, 0) + 1
        self._effects.append(effect)

    def _on_op(self, inst: Instance[Any] | None, op: DeferredOp) -> None:
        """An operation: a new push from a match slot goes through D's remote engine; one
        that a remote engine lets proceed is carried out."""
        if inst is not None and inst.machine.decl is MATCH:
            assert isinstance(op, ReplayPush)
            self._through(op.engine_id, op, self.bus.now)
        elif isinstance(op, ReplayRegistration):
            self._effects.append(SendPushReg(op.request_id, op.registration, op.retried))
        elif isinstance(op, ReplayPush):
            self._effects.append(IssueWrite(op))
        else:
            self._effects.append(IssueRead(op.request_id, op.source, op.block_ids))

    def _on_deferred_failed(self, _inst: Instance[Any] | None, effect: DeferredFailed) -> None:
        op = effect.op
        self._effects.append(ReportToMain(op.request_id, HandshakeFailed()))
        if isinstance(op, ReplayPush):
            self._to_slot(op.request_id, Issued(op.request_id))

    def _on_cancel_deferred(self, _inst: Instance[Any] | None, effect: CancelDeferred) -> None:
        bus = self.bus
        if bus.get(REMOTE_ENGINE, effect.engine_id) is not None:
            bus.dispatch(REMOTE_ENGINE, effect.engine_id, Cancel(effect.request_id), bus.now)

    def _on_hold(self, _inst: Instance[Any] | None, effect: HoldPending) -> None:
        peer, blocks = effect.peer, effect.blocks * effect.count
        count = self.pending_by_peer.get(peer, 0) + effect.count
        if count > 0:
            self.pending_by_peer[peer] = count
            self.pending_blocks_by_peer[peer] = self.pending_blocks_by_peer.get(peer, 0) + blocks
        else:
            self.pending_by_peer.pop(peer, None)
            self.pending_blocks_by_peer.pop(peer, None)
        self.pending_count += effect.count
        self.pending_blocks += blocks
        if not effect.known:
            self.unknown_count += effect.count
            self.unknown_blocks += blocks

    # -- wake policy (R-P07) -------------------------------------------------------------

    def _update_self_poll(self) -> None:
        wanted = bool(self._awaiting)
        if wanted != self.self_polling:
            self.self_polling = wanted
            self._effects.append(ArmSelfPoll(self.poll_interval_s) if wanted else DisarmSelfPoll())
