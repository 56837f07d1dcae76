"""The push writer's core: matching, handshakes, notif routing and the wake policy.

This is the logic of the one `kvhandoff-push-writer` thread per worker, without the
thread: the thread drains its inboxes into these methods and executes the effects they
return (`take_effects`). Everything here runs on the writer thread only.

- R-P04: either side may arrive first. A `PUSH_REG` looks up `push_finished_blocks`;
  finished blocks look up `pending_d_registrations`; both try the exact request id
  first, then the base id (`get_base_request_id`), which keeps the completion index.
- R-P05: an operation that needs an unconnected peer goes through that peer's handshake
  machine (`push.handshake`), which defers and replays it.
- R-P07: while P finished blocks wait for an unmatched `PUSH_REG`, the writer self-polls
  (`ArmSelfPoll`); when none wait it blocks on its wake event again (`DisarmSelfPoll`).
- R-P08: the writer is the sole consumer of notifs: `PUSH_REG` goes to matching; `HB:`,
  completion and WRITE-failed notifs go to the main thread.
- R-P09: an evicted request's stale entries are dropped and it is never served again.
- Bad bytes from a peer raise nothing here: they are counted and logged per peer,
  rate-limited (`rejections`), and change no state.

Time is an argument: every entry point takes `now` (the writer thread reads its clock once
per pass). Everything here runs on the writer thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Literal

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
from kvhandoff.machines.push.events import Matched
from kvhandoff.machines.push.handshake import (
    HANDSHAKE,
    DeferredOp,
    Ensure,
    Failed,
    HandshakeCtx,
    PeerLost,
    Succeeded,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.notifs import PushRegNotif, parse_notif
from kvhandoff.protocol.push_wire import PushRegistration
from kvhandoff.protocol.request_ids import get_base_request_id

log = logging.getLogger("kvhandoff.push.writer")

Role = Literal["prefill", "decode"]

_FORGET_AFTER = 65_536  # evicted ids remembered, to drop late duplicates


class PushWriter:
    def __init__(
        self,
        role: Role,
        bus: EventBus,
        *,
        poll_interval_s: float = 0.001,
        handshake_timeout: float = 10.0,
        pending_registration_ttl: float = 480.0,
    ) -> None:
        self.role = role
        self.bus = bus
        self.poll_interval_s = poll_interval_s
        bus.register(HANDSHAKE, {"handshake_timeout": handshake_timeout})
        for effect_type in (
            ReportToMain,
            StartHandshake,
            ReplayRegistration,
            ReplayPush,
            ReplayRead,
            DropRemoteAgent,
        ):
            bus.handle(effect_type, self._collect)
        self.push_finished_blocks: dict[str, tuple[int, ...]] = {}
        self.pending_d_registrations: dict[str, PushRegistration] = {}
        self._finished_by_base: dict[str, str] = {}
        self._pending_by_base: dict[str, str] = {}
        self._pending_since: dict[str, float] = {}  # arrival order
        self._pending_senders: dict[str, str] = {}  # D request id -> agent that sent it
        self.pending_registration_ttl = pending_registration_ttl
        self._evicted: OrderedDict[str, None] = OrderedDict()  # base ids
        self.self_polling = False
        self.rejections = RejectionLog(log, what="notif")
        self._effects: list[Effect] = []

    @property
    def rejected_notifs(self) -> int:
        """Inputs from peers that were refused (counted, never raised)."""
        return self.rejections.total

    def take_effects(self) -> list[Effect]:
        """The effects produced since the last call, in order."""
        effects, self._effects = self._effects, []
        return effects

    def _collect(self, _inst: Instance[HandshakeCtx] | None, effect: Effect) -> None:
        self._effects.append(effect)

    # -- inboxes ---------------------------------------------------------------------

    def on_reg_send(self, request_id: str, registration: PushRegistration, now: float) -> None:
        """D: a registration from the reg-send inbox (first pass or replay)."""
        if get_base_request_id(request_id) in self._evicted:
            return
        reg = registration
        op = ReplayRegistration(request_id, reg)
        self._through_handshake(reg.remote_engine_id, reg.remote_host, reg.remote_port, op, now)

    def on_pull_read(self, op: ReplayRead, now: float) -> None:
        """D, pull mode (B-09): a read from the pull-read inbox (first pass or replay)."""
        if get_base_request_id(op.request_id) in self._evicted:
            return
        prefill = op.source.prefill
        self._through_handshake(prefill.engine_id, prefill.host, prefill.port, op, now)

    def on_finished_blocks(self, request_id: str, block_ids: tuple[int, ...], now: float) -> None:
        """P: finished blocks from the finished-blocks inbox."""
        if get_base_request_id(request_id) in self._evicted:
            return
        registration, sender = self._pop_registration(request_id)
        if registration is None:
            self.push_finished_blocks[request_id] = block_ids
            self._finished_by_base[get_base_request_id(request_id)] = request_id
        else:
            self._matched(request_id, block_ids, registration, sender, now)
        self._update_self_poll()

    def on_deferred_push(self, op: ReplayPush, now: float) -> None:
        """P: a matched push replayed after its handshake."""
        if get_base_request_id(op.request_id) not in self._evicted:
            self._push(op, now)

    def on_evict(self, request_id: str) -> None:
        """Drop everything the writer still holds for a finished or expired request."""
        base = get_base_request_id(request_id)
        self._remember_evicted(base)
        if self.push_finished_blocks.pop(request_id, None) is not None:
            self._finished_by_base.pop(base, None)
        pending_id = self._pending_by_base.pop(base, None)
        for key in {request_id, pending_id}:
            if key is not None:
                self.pending_d_registrations.pop(key, None)
                self._pending_since.pop(key, None)
                self._pending_senders.pop(key, None)
        self._update_self_poll()

    def on_handshake_result(self, engine_id: str, ok: bool, now: float) -> None:
        if self.bus.get(HANDSHAKE, engine_id) is not None:
            event = Succeeded() if ok else Failed()
            self.bus.dispatch(HANDSHAKE, engine_id, event, now)

    def on_peer_lost(self, engine_id: str, now: float) -> None:
        if self.bus.get(HANDSHAKE, engine_id) is not None:
            self.bus.dispatch(HANDSHAKE, engine_id, PeerLost(), now)

    def on_notif(self, peer: str, data: bytes, now: float) -> None:
        """Route one notif from `get_new_notifs` (R-P08)."""
        try:
            notif = parse_notif(data, peer=peer)
            if isinstance(notif, PushRegNotif):
                if self.role != "prefill":
                    raise RemoteProtocolError("PUSH_REG sent to a decode instance", peer=peer)
                self._on_push_reg(notif.registration, peer, now)
            else:
                self._effects.append(ForwardToMain(notif, peer))
        except RemoteProtocolError as exc:
            self.rejections.reject(peer, exc, now)  # counted, logged rate-limited per peer

    def is_connected(self, engine_id: str) -> bool:
        return self.bus.has_tag(HANDSHAKE, engine_id, "peer_ready")

    # -- matching (R-P04) --------------------------------------------------------------

    def _on_push_reg(self, registration: PushRegistration, sender: str, now: float) -> None:
        d_request_id = registration.request_id
        p_request_id = self._pop_finished(d_request_id)
        if p_request_id is None:
            if get_base_request_id(d_request_id) in self._evicted:
                return  # a late duplicate of a request already served or reaped
            self.pending_d_registrations[d_request_id] = registration
            self._pending_since[d_request_id] = now
            self._pending_by_base[get_base_request_id(d_request_id)] = d_request_id
            self._pending_senders[d_request_id] = sender
            return
        blocks = self.push_finished_blocks.pop(p_request_id)
        self._matched(p_request_id, blocks, registration, sender, now)
        self._update_self_poll()

    def _pop_finished(self, d_request_id: str) -> str | None:
        if d_request_id in self.push_finished_blocks:
            self._finished_by_base.pop(get_base_request_id(d_request_id), None)
            return d_request_id
        return self._finished_by_base.pop(get_base_request_id(d_request_id), None)

    def _pop_registration(self, p_request_id: str) -> tuple[PushRegistration | None, str]:
        """The pending registration matching `p_request_id`, and the agent that sent it."""
        base = get_base_request_id(p_request_id)
        d_request_id = p_request_id if p_request_id in self.pending_d_registrations else None
        d_request_id = d_request_id or self._pending_by_base.get(base)
        if d_request_id is None:
            return None, ""
        self._pending_by_base.pop(get_base_request_id(d_request_id), None)
        self._pending_since.pop(d_request_id, None)
        sender = self._pending_senders.pop(d_request_id, "")
        return self.pending_d_registrations.pop(d_request_id, None), sender

    def _matched(
        self,
        p_request_id: str,
        blocks: tuple[int, ...],
        registration: PushRegistration,
        sender: str,
        now: float,
    ) -> None:
        self._effects.append(ReportToMain(p_request_id, Matched(), peer=sender or None))
        self._push(ReplayPush(p_request_id, blocks, registration, sender), now)

    def _push(self, op: ReplayPush, now: float) -> None:
        reg = op.registration
        self._through_handshake(reg.decode_engine_id, reg.decode_host, reg.decode_port, op, now)

    # -- handshakes (R-P05) ------------------------------------------------------------

    def _through_handshake(
        self, engine_id: str, host: str, port: int, op: DeferredOp, now: float
    ) -> None:
        bus = self.bus
        if self.is_connected(engine_id):
            self._effects.append(_proceed(op))
            return
        if bus.get(HANDSHAKE, engine_id) is None:
            bus.create(HANDSHAKE, HandshakeCtx(engine_id, host, port), now)
        bus.dispatch(HANDSHAKE, engine_id, Ensure(op), now)

    # -- wake policy (R-P07) -------------------------------------------------------------

    def _update_self_poll(self) -> None:
        wanted = bool(self.push_finished_blocks)
        if wanted != self.self_polling:
            self.self_polling = wanted
            self._effects.append(ArmSelfPoll(self.poll_interval_s) if wanted else DisarmSelfPoll())

    def _remember_evicted(self, base_request_id: str) -> None:
        self._evicted[base_request_id] = None
        while len(self._evicted) > _FORGET_AFTER:
            self._evicted.popitem(last=False)

    def expire_pending(self, now: float) -> int:
        """Drop `PUSH_REG`s that waited longer than D's own watchdog for their blocks."""
        deadline = now - self.pending_registration_ttl
        dropped = 0
        while self._pending_since:
            d_request_id, since = next(iter(self._pending_since.items()))
            if since > deadline:
                break
            del self._pending_since[d_request_id]
            self._pending_senders.pop(d_request_id, None)
            if self.pending_d_registrations.pop(d_request_id, None) is not None:
                self._pending_by_base.pop(get_base_request_id(d_request_id), None)
                dropped += 1
        return dropped


def _proceed(op: DeferredOp) -> Effect:
    """The operation itself, once its peer is connected."""
    if isinstance(op, ReplayRegistration):
        return SendPushReg(op.request_id, op.registration)
    if isinstance(op, ReplayRead):
        return IssueRead(op.request_id, op.source, op.block_ids)
    return IssueWrite(op.request_id, op.block_ids, op.registration, op.sender_agent)
