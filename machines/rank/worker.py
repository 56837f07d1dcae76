"""Either mode's engine API, worker side, main thread (push, or pull on the same base): one
per TP/PP rank, shaped like the seed's connector worker (R-P02, R-P03, R-P07..R-P09, R-T01,
S-02, S-06).

The rank's main thread owns the rank's request lifecycles (`push.d_registration`,
`push.p_lease`, in pull mode `pull.d_read`, `pull.p_lease`) on its own bus. It never
touches NIXL notifs or WRITEs: it hands typed commands to the writer thread (one FIFO,
`WriterCommand`) and learns what happened from the items the writer puts on the
pending-completion-notifs queue: the writer's reports (`ReportToMain`) and the peers'
notifs (`ForwardToMain`). Heartbeats leave from here. Time is an argument.

    worker = PushWorker("prefill", "P-0", config, rank=1, now=now)
    worker.start_load_kv(meta, now)        # from the scheduler; wakes the writer if needed
    worker.take_writer_items(items, now)   # what the writer left on the queue
    output = worker.get_finished(now)      # to the scheduler; always wakes the writer

The writer's reports are applied before time moves on, at the time the bus last stood
at; notifs from peers are applied at `now`, after every timeout due by then. A notif the
machines refuse (an unknown request, a sender that is not the bound peer, a state that
does not expect it) is a `RemoteProtocolError`: it changes nothing and is counted and
logged per peer, rate-limited (`rejections`, S-06), never raised out of the engine's call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

import msgspec

from kvhandoff.machines.kv.effects import (
    CountFailure,
    ForwardToMain,
    ReportEnded,
    ReportFailedRecving,
    ReportFinishedRecving,
    ReportFinishedSending,
    ReportPosted,
    ReportToMain,
    WakeWriter,
    Warn,
)
from kvhandoff.machines.kv.events import (
    Completion,
    End,
    Enqueued,
    Heartbeat,
    Poll,
    Staged,
    WriteFailed,
)
from kvhandoff.machines.pull.d_read import D_READ, DReadCtx
from kvhandoff.machines.pull.p_lease import PULL_P_LEASE, PullLeaseCtx
from kvhandoff.machines.push.d_registration import D_REGISTRATION, DRegistrationCtx
from kvhandoff.machines.push.meta import FAILURE_CAUSES, PushConnectorMeta, PushWorkerOutput
from kvhandoff.machines.push.p_lease import P_LEASE, PLeaseCtx
from kvhandoff.machines.push.scheduler import Mode, Role
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.member_routing import LocalRegion, MemberLayout, derive_member_major_layout
from kvhandoff.protocol.notifs import CompletionNotif, HeartbeatNotif, WriteFailedNotif
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PushRegistration
from kvhandoff.protocol.request_ids import get_base_request_id
from kvhandoff.protocol.tp_mapping import split_rank, writers_of

log = logging.getLogger("kvhandoff.push.worker")

WriterItem = ForwardToMain | ReportToMain

REPORTS_BETWEEN = 32
"""Writer reports applied between two calls of `take_writer_items`'s `between`."""

# Field-less events, shared by every instance of a batch (events are immutable).
_ENQUEUED, _STAGED, _POLL = Enqueued(), Staged(), Poll()

RANK_KINDS: tuple[Declaration[Any], ...] = (D_REGISTRATION, P_LEASE, D_READ, PULL_P_LEASE)
"""Every lifecycle on a rank's main-thread bus."""


class PushWorker:
    """One rank's main-thread half (see the module docstring)."""

    def __init__(
        self,
        role: Role,
        engine_id: str,
        config: PushConfig | None = None,
        mode: Mode = "push",
        *,
        rank: int = 0,
        now: float,
        bus: EventBus | None = None,
    ) -> None:
        self.role = role
        self.engine_id = engine_id
        self.config = config or PushConfig()
        self.mode = mode
        self.rank = rank
        self.pp_rank, self.tp_rank = split_rank(rank, self.config.tp_size)
        self.d_kind: Declaration[Any] = D_REGISTRATION if mode == "push" else D_READ
        self.p_kind: Declaration[Any] = P_LEASE if mode == "push" else PULL_P_LEASE
        # The side whose transfers get_finished polls: P's WRITEs (push), D's READs (pull).
        self.polled_kind: Declaration[Any] = self.p_kind if mode == "push" else self.d_kind
        self.bus = bus or EventBus()
        machine_config = self.config.machine_config()
        for kind in RANK_KINDS:
            self.bus.register(kind, machine_config)
        # D's heartbeats name a lease by D's id: matched by base id without a scan (R-P04).
        self.bus.alias(self.p_kind, _base_id)
        self.layout: MemberLayout | None = None
        self.rejections = RejectionLog(log, what="notif")
        self.step = 0
        self._transfer_outcomes: dict[Event, list[str]] = {}
        self._output = self._fresh_output()
        bus_ = self.bus
        bus_.handle(ReportFinishedRecving, self._on_finished_recving)
        bus_.handle(ReportFailedRecving, self._on_failed_recving)
        bus_.handle(ReportFinishedSending, self._on_finished_sending)
        bus_.handle(ReportEnded, self._on_ended)
        bus_.handle(ReportPosted, self._on_posted)
        bus_.handle(CountFailure, self._on_failure)
        bus_.handle(Warn, lambda _inst, warn: log.warning("%s: %s", warn.request_id, warn.message))
        del now  # the rank keeps no clock of its own; the scheduler paces heartbeats

    @property
    def rejected_notifs(self) -> int:
        """Notifs from peers that the machines refused (counted, never raised)."""
        return self.rejections.total

    def register_kv_caches(
        self, regions: Sequence[LocalRegion], *, has_ssm_layers: bool = False
    ) -> MemberLayout:
        """Derive the member-major layout once; every transfer uses its order (R-P14)."""
        self.layout = derive_member_major_layout(
            regions,
            pp_size=self.config.pp_size,
            is_decoder=self.role == "decode",
            has_ssm_layers=has_ssm_layers,
        )
        return self.layout

    # -- the scheduler's metadata -----------------------------------------------------------

    def start_load_kv(self, meta: PushConnectorMeta, now: float) -> bool:
        """Take this step's work (R-P02, R-P03); True when the writer has new work and
        must be woken (R-P07). Heartbeats are the adapter's to send (`meta.heartbeats`)."""
        bus = self.bus
        bus.advance(now)  # a request that ended since the meta was built is not handed over
        self.step = max(self.step, meta.step)
        enqueued: list[str] = []
        for request_id, registration in meta.push_registrations.items():
            if bus.get(D_REGISTRATION, request_id) is None:
                reg = _for_rank(registration, self.tp_rank)
                writers = frozenset(
                    writers_of(
                        self.tp_rank,
                        registration.decode_tp_size,
                        registration.remote_tp_size,
                        registration.remote_pp_size,
                    )
                )
                bus.create(D_REGISTRATION, DRegistrationCtx(request_id, reg, writers), now)
                enqueued.append(request_id)
        if enqueued:
            bus.dispatch_many(D_REGISTRATION, enqueued, _ENQUEUED, now)
        reads: list[str] = []
        for request_id, read in meta.pull_reads.items():
            if bus.get(D_READ, request_id) is None:
                expires = read.source.lease_expires_at
                deadline = None if expires is None else expires - self.config.sealed_notif_skew
                read_ctx = DReadCtx(
                    request_id, read.source, read.block_ids, lease_deadline=deadline
                )
                bus.create(D_READ, read_ctx, now)
                reads.append(request_id)
        if reads:
            bus.dispatch_many(D_READ, reads, _ENQUEUED, now)
        extension = self.config.lease_extension
        staged: list[str] = []
        for request_id, blocks in meta.push_finished_blocks.items():
            if self.mode == "pull":
                if bus.get(PULL_P_LEASE, request_id) is None:
                    lease_ctx = PullLeaseCtx(
                        request_id, blocks, lease_extension=extension, p_tp=self.config.tp_size
                    )
                    bus.create(PULL_P_LEASE, lease_ctx, now)
            elif bus.get(P_LEASE, request_id) is None:
                bus.create(P_LEASE, PLeaseCtx(request_id, blocks, lease_extension=extension), now)
                staged.append(request_id)
        if staged:
            bus.dispatch_many(P_LEASE, staged, _STAGED, now)
        for request_id in meta.ended:
            if bus.get(self.d_kind, request_id) is not None:
                bus.dispatch(self.d_kind, request_id, End(), now)
            else:  # nothing held here any more: its memory is the engine's again
                self._output_ended.append(request_id)
        woken = bool(
            meta.push_registrations or meta.push_finished_blocks or meta.pull_reads or meta.ended
        )
        if woken:
            bus.execute(WakeWriter())
        return woken

    def get_finished(
        self, now: float, settled: Callable[[str], bool] | None = None
    ) -> PushWorkerOutput:
        """Poll posted transfers and report this rank's step; always wakes the writer.

        `settled(request_id)` (the rank's view of its transport, optional) says whether a
        transfer may have ended: an instance polled before (`polled`) whose transfer has
        not is skipped, since its poll could change nothing (its timeout runs on the
        bus's timers either way)."""
        bus = self.bus
        bus.advance(now)
        kind = self.polled_kind
        due = [
            inst.key
            for inst in bus.tagged(kind, "pollable")
            if settled is None or not inst.has("polled") or settled(str(inst.key))
        ]
        if due:
            bus.dispatch_many(kind, due, _POLL, now)
            self._apply_transfer_outcomes(kind, now)
        bus.execute(WakeWriter())
        output = self._output
        output.step = self.step
        output.ended = tuple(self._output_ended)
        output.finished_sending = tuple(self._sending)
        output.finished_recving = tuple(self._recving)
        output.posted = tuple(self._posted)
        if self._invalid:
            output.invalid_block_ids = tuple(self._invalid)
        self._output = self._fresh_output()
        return output

    def transfer_ended(self, request_id: str, outcome: Event) -> None:
        """The executor of a poll (`PollTransfer`) found the request's transfers ended:
        `outcome` (done, or failed) reaches its machine right after the step's polls, in
        one batch per outcome."""
        self._transfer_outcomes.setdefault(outcome, []).append(request_id)

    def _apply_transfer_outcomes(self, kind: Declaration[Any], now: float) -> None:
        outcomes, self._transfer_outcomes = self._transfer_outcomes, {}
        for outcome, request_ids in outcomes.items():
            self.bus.dispatch_many(kind, request_ids, outcome, now)

    def _fresh_output(self) -> PushWorkerOutput:
        # Appended to during the step, made tuples by `get_finished` (not tuple + tuple).
        self._output_ended: list[str] = []
        self._sending: list[str] = []
        self._recving: list[str] = []
        self._posted: list[str] = []
        self._invalid: list[int] = []
        return PushWorkerOutput(rank=self.rank, step=self.step)

    # -- the pending-completion-notifs queue (R-P08) -------------------------------------

    def take_writer_items(
        self,
        items: Iterable[WriterItem],
        now: float,
        between: Callable[[], None] | None = None,
    ) -> None:
        """Apply the writer's reports (before time moves on), then the peers' notifs, each
        at the time the writer took it (`ForwardToMain.at`, never before the bus's time nor
        after `now`): the seed applies notifs before it reaps, so a heartbeat that reached
        the writer before its lease's deadline extends the lease even when this step runs
        after the deadline (R-P08, R-P11). Then time moves on to `now`; outcomes are
        reported by the next `get_finished`. `between` (the rank's transport, optional)
        runs after every `REPORTS_BETWEEN` reports: a long batch of reports does not hold
        back transfers the transport completes itself."""
        notifs: list[ForwardToMain] = []
        batches = _ReportBatches()
        taken = 0
        for item in items:
            if isinstance(item, ForwardToMain):
                notifs.append(item)
                continue
            if not batches.add(item):
                self._apply_batches(batches, now)
                batches.add(item)
            taken += 1
            if taken % REPORTS_BETWEEN == 0:
                self._apply_batches(batches, now)
                if between is not None:
                    between()
        self._apply_batches(batches, now)
        if not notifs:
            return
        bus = self.bus
        landed: list[str] = []  # D's completion notifs of one sender, taken at one time
        completion: Completion | None = None
        for notif in notifs:
            at = now if notif.at is None or notif.at > now else notif.at
            landing = self._push_completion(notif)
            event = None if landing is None else landing[0]
            if completion is not None and landed and (event != completion or at > bus.now):
                self._on_completions(completion, landed, now)
                landed = []
            if at > bus.now:
                bus.advance(at)  # what was due before it arrived fires first
            if landing is not None:
                completion = landing[0]
                landed.append(landing[1])
                continue
            try:
                self._on_notif(notif, bus.now)
            except RemoteProtocolError as exc:
                self.reject(notif.peer, exc, now)
        if completion is not None and landed:
            self._on_completions(completion, landed, now)
        bus.advance(now)

    def _push_completion(self, item: ForwardToMain) -> tuple[Completion, str] | None:
        """The event and request of a completion notif to a push D rank (batched per
        sender and time: a writer pass hands them over together), else None."""
        notif = item.notif
        if isinstance(notif, CompletionNotif) and self.role == "decode" and self.mode == "push":
            event = Completion(item.peer, item.engine, item.rank, notif.tp_size)
            return event, notif.request_id
        return None

    def _on_completions(self, event: Completion, request_ids: list[str], now: float) -> None:
        """One sender's completion notifs, taken at one time, as one batch: each request's
        registration counts it, as `dispatch` would one by one; an unknown or refused one
        is the sender's rejection."""
        for _key, exc in self.bus.dispatch_many(D_REGISTRATION, request_ids, event, self.bus.now):
            if isinstance(exc, RemoteProtocolError):
                self.reject(event.sender, exc, now)

    def reject(self, peer: str | None, exc: RemoteProtocolError | str, now: float) -> None:
        self.rejections.reject(peer, exc, now)
        self._on_failure(None, CountFailure("rejected"))

    def _apply_batches(self, batches: _ReportBatches, now: float) -> None:
        for (event, peer), request_ids in batches.take():
            self._on_reports(event, peer, request_ids, now)

    def _on_reports(
        self, event: Event, peer: str | None, request_ids: list[str], now: float
    ) -> None:
        """One writer event for many requests, as one batch (equal events, one peer); a
        request that ended meanwhile (reaped, released, dropped) has nothing left to be
        told, and a peer event (`Matched`) that a state refuses is the peer's rejection."""
        kind = self.p_kind if self.role == "prefill" else self.d_kind
        bus = self.bus
        live = [key for key in request_ids if bus.get(kind, key) is not None]
        if live:
            for _key, exc in bus.dispatch_many(kind, live, event, bus.now):
                if isinstance(exc, RemoteProtocolError):
                    self.reject(peer, exc, now)

    def _on_notif(self, item: ForwardToMain, now: float) -> None:
        notif, peer = item.notif, item.peer
        if isinstance(notif, HeartbeatNotif) and self.role == "prefill":
            unknown = self._heartbeat(notif.request_ids, item.engine, peer, now)
            if unknown:  # named in brief: a heartbeat may carry thousands of ids (S-06)
                shown = ", ".join(repr(i[:64]) for i in unknown[:3])
                more = f" and {len(unknown) - 3} more" if len(unknown) > 3 else ""
                raise RemoteProtocolError(
                    f"heartbeat for unknown requests: {shown}{more}", peer=peer
                )
        elif isinstance(notif, CompletionNotif) and self.role == "prefill" and self.mode == "pull":
            event = Completion(peer, item.engine, item.rank, notif.tp_size)
            self.bus.dispatch(PULL_P_LEASE, notif.request_id, event, now)
        elif isinstance(notif, WriteFailedNotif) and self.role == "decode" and self.mode == "push":
            failed = WriteFailed(peer, item.engine, item.rank, notif.reason)
            self.bus.dispatch(D_REGISTRATION, notif.request_id, failed, now)
        else:
            raise RemoteProtocolError(
                f"{type(notif).__name__} sent to a {self.role} {self.mode} instance", peer=peer
            )

    def _heartbeat(
        self, request_ids: Sequence[str], engine: str | None, sender: str, now: float
    ) -> list[str]:
        """Extend the leases named by D's ids (exact, then base id); return the unknown
        ids. Each lease takes it only from the D engine it is bound to (S-02)."""
        kind = self.p_kind
        bus = self.bus
        beat = Heartbeat(engine, sender)
        unknown = []
        beating = []
        for request_id in request_ids:
            inst = bus.get(kind, request_id) or bus.by_alias(kind, get_base_request_id(request_id))
            if inst is None:
                unknown.append(request_id)
            else:
                beating.append(inst.key)
        refused = bus.dispatch_many(kind, beating, beat, now) if beating else []
        unknown.extend(str(key) for key, _exc in refused)
        return unknown

    # -- reports to the scheduler --------------------------------------------------------

    def _on_finished_recving(self, _inst: Instance[object], effect: ReportFinishedRecving) -> None:
        self._recving.append(effect.request_id)

    def _on_failed_recving(self, _inst: Instance[object], effect: ReportFailedRecving) -> None:
        self._output.failed_recving[effect.request_id] = effect.reason
        self._invalid.extend(effect.block_ids)

    def _on_finished_sending(self, _inst: Instance[object], effect: ReportFinishedSending) -> None:
        self._sending.append(effect.request_id)

    def _on_ended(self, _inst: Instance[object], effect: ReportEnded) -> None:
        self._output_ended.append(effect.request_id)

    def _on_posted(self, _inst: Instance[object], effect: ReportPosted) -> None:
        self._posted.append(effect.request_id)

    def _on_failure(self, _inst: Instance[object] | None, effect: CountFailure) -> None:
        cause = effect.cause if effect.cause in FAILURE_CAUSES else "post"
        failures = self._output.failures
        failures[cause] = failures.get(cause, 0) + 1


def _base_id(key: Hashable) -> Hashable:
    return get_base_request_id(str(key))


def _for_rank(registration: PushRegistration, tp_rank: int) -> PushRegistration:
    """The scheduler's registration as this rank sends it."""
    return msgspec.structs.replace(registration, decode_tp_rank=tp_rank)


class _ReportBatches:
    """The writer's reports grouped into one batch per (event, peer), in the order the
    batches were opened, without reordering any request's own reports: a report joins its
    event's batch only if no later batch holds an earlier report of the same request (a
    pass's "matched, matched, ..., posted, posted, ..." is two batches however the writer
    interleaved them). Requests are independent instances, so only each one's order counts."""

    __slots__ = ("_batches", "_latest")

    def __init__(self) -> None:
        self._batches: dict[tuple[Event, str | None], tuple[int, list[str]]] = {}
        self._latest: dict[str, int] = {}

    def add(self, item: ReportToMain) -> bool:
        """Add `item`; False when it cannot join without reordering (apply the batches
        taken so far, then add it again)."""
        key = (item.event, item.peer)
        batch = self._batches.get(key)
        request_id = item.request_id
        if batch is None:
            batch = self._batches[key] = (len(self._batches), [])
        elif self._latest.get(request_id, -1) > batch[0]:
            return False
        self._latest[request_id] = batch[0]
        batch[1].append(request_id)
        return True

    def take(self) -> list[tuple[tuple[Event, str | None], list[str]]]:
        """The batches in the order they were opened; empties this."""
        out = [(key, ids) for key, (_index, ids) in self._batches.items()]
        self._batches = {}
        self._latest = {}
        return out
