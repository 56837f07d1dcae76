"""Push-mode engine API, worker main-thread side: shaped like the seed's connector worker.

The worker's main thread never touches NIXL notifs or WRITEs: it hands work to the writer
thread through effects (`EnqueueRegistration`, `EnqueueFinishedBlocks`, `QueueEviction`,
`WakeWriter`) and learns what happened from the items the writer put on the
pending-completion-notifs queue (`take_writer_items`, also done by `get_finished`).
Heartbeats leave from here. Time is an argument: every call that changes state takes `now`.

    worker = PushWorker(bus, role="prefill", engine=local_engine, now=now)
    worker.register_kv_caches(regions)            # member-major layout, once (R-P14)
    worker.start_load_kv(meta, now)                # hand over; wake the writer if needed
    output = worker.get_finished(drained_items, now)   # always wakes the writer

The writer's reports (`ReportToMain`) are applied before time moves on, at the time the
bus last stood at: a WRITE the writer posted while its lease stood suspends the lease
before the lease can expire (the adapter's lease lock orders the post against the
main thread, R-P11). Notifs from peers (`ForwardToMain`) are applied at `now`, after
every timeout due by then. A notif the machines refuse is a `RemoteProtocolError`: it
changes nothing and is counted and logged per peer (`rejections`), never raised out of
the engine's call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from kvhandoff.machines.pull.d_read import D_READ
from kvhandoff.machines.pull.p_lease import PULL_P_LEASE
from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.effects import (
    ForwardToMain,
    ReportFailedRecving,
    ReportFinishedRecving,
    ReportFinishedSending,
    ReportToMain,
    SendHeartbeat,
    WakeWriter,
    Warn,
)
from kvhandoff.machines.push.events import (
    Completion,
    Enqueued,
    Heartbeat,
    Poll,
    Staged,
    WriteFailed,
)
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.scheduler import (
    KINDS,
    DKind,
    LocalEngine,
    Mode,
    PKind,
    PushConnectorMeta,
    PushConnectorOutput,
    Role,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.member_routing import LocalRegion, MemberLayout, derive_member_major_layout
from kvhandoff.protocol.notifs import CompletionNotif, HeartbeatNotif, WriteFailedNotif
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.request_ids import get_base_request_id

log = logging.getLogger("kvhandoff.push.worker")

WriterItem = ForwardToMain | ReportToMain


class PushWorker:
    def __init__(
        self,
        bus: EventBus,
        role: Role,
        engine: LocalEngine,
        config: PushConfig | None = None,
        mode: Mode = "push",
        *,
        now: float,
    ) -> None:
        self.bus = bus
        self.role = role
        self.engine = engine
        self.config = config or PushConfig()
        self.mode = mode
        self.d_kind: DKind
        self.p_kind: PKind
        self.d_kind, self.p_kind = KINDS[mode]
        # The side whose transfers get_finished polls: P's WRITEs (push), D's READs (pull).
        self.polled_kind: DKind | PKind = P_LEASE if mode == "push" else D_READ
        self.layout: MemberLayout | None = None
        self.rejections = RejectionLog(log, what="notif")
        self._output = PushConnectorOutput()
        self.next_heartbeat = now + self.config.heartbeat_interval
        bus.handle(ReportFinishedRecving, self._on_finished_recving)
        bus.handle(ReportFailedRecving, self._on_failed_recving)
        bus.handle(ReportFinishedSending, self._on_finished_sending)
        bus.handle(Warn, lambda inst, warn: log.warning("%s: %s", warn.request_id, warn.message))

    @property
    def rejected_notifs(self) -> int:
        """Notifs from peers that the machines refused (counted, never raised)."""
        return self.rejections.total

    def register_kv_caches(
        self, regions: Sequence[LocalRegion], *, pp_size: int = 1, has_ssm_layers: bool = False
    ) -> MemberLayout:
        """Derive the member-major layout once; every transfer uses its order (R-P14)."""
        self.layout = derive_member_major_layout(
            regions,
            pp_size=pp_size,
            is_decoder=self.role == "decode",
            has_ssm_layers=has_ssm_layers,
        )
        return self.layout

    def start_load_kv(self, meta: PushConnectorMeta, now: float) -> None:
        """Hand this step's registrations / finished blocks to the writer (R-P02, R-P03)."""
        bus = self.bus
        bus.advance(now)  # a request that ended since the meta was built is not handed over
        for request_id in meta.push_registrations:
            if bus.get(D_REGISTRATION, request_id) is not None:
                bus.dispatch(D_REGISTRATION, request_id, Enqueued(), now)
        for request_id in meta.push_finished_blocks:
            if bus.get(P_LEASE, request_id) is not None:
                bus.dispatch(P_LEASE, request_id, Staged(), now)
        for request_id in meta.pull_reads:
            if bus.get(D_READ, request_id) is not None:
                bus.dispatch(D_READ, request_id, Enqueued(), now)
        if meta.push_registrations or meta.push_finished_blocks or meta.pull_reads:
            bus.execute(WakeWriter())
        self._send_heartbeats(now)

    def get_finished(self, writer_items: Iterable[WriterItem], now: float) -> PushConnectorOutput:
        """Take the writer's items, reap leases, poll transfers; always wakes the writer."""
        self.take_writer_items(writer_items, now)
        bus = self.bus
        bus.advance(now)
        kind = self.polled_kind
        for inst in bus.tagged(kind, "pollable"):
            bus.dispatch(kind, inst.key, Poll(), now)
        bus.execute(WakeWriter())
        output, self._output = self._output, PushConnectorOutput()
        return output

    # -- the pending-completion-notifs queue (R-P08) -------------------------------------

    def take_writer_items(self, items: Iterable[WriterItem], now: float) -> None:
        """Apply the writer's reports (before time moves on), then the peers' notifs at
        `now`; their outcomes are reported by the next `get_finished`."""
        notifs: list[ForwardToMain] = []
        for item in items:
            if isinstance(item, ReportToMain):
                self._on_report(item, now)
            else:
                notifs.append(item)
        if not notifs:
            return
        self.bus.advance(now)
        for notif in notifs:
            try:
                self._on_notif(notif, now)
            except RemoteProtocolError as exc:
                self.rejections.reject(notif.peer, exc, now)

    def _on_report(self, item: ReportToMain, now: float) -> None:
        kind = self.p_kind if self.role == "prefill" else self.d_kind
        if self.bus.get(kind, item.request_id) is None:
            return  # ended meanwhile (reaped, expired, aborted): nothing left to tell
        try:
            self.bus.dispatch(kind, item.request_id, item.event, self.bus.now)
        except RemoteProtocolError as exc:  # a peer event (`Matched`) the state refuses
            self.rejections.reject(item.peer, exc, now)

    def _on_notif(self, item: ForwardToMain, now: float) -> None:
        notif, peer = item.notif, item.peer
        if isinstance(notif, HeartbeatNotif) and self.role == "prefill":
            unknown = self._heartbeat(notif.request_ids, now)
            if unknown:
                raise RemoteProtocolError(f"heartbeat for unknown requests {unknown}", peer=peer)
        elif isinstance(notif, CompletionNotif) and self.role == "prefill" and self.mode == "pull":
            self.bus.dispatch(PULL_P_LEASE, notif.request_id, Completion(), now)
        elif isinstance(notif, CompletionNotif) and self.role == "decode":
            self.bus.dispatch(D_REGISTRATION, notif.request_id, Completion(), now)
        elif isinstance(notif, WriteFailedNotif) and self.role == "decode":
            event = WriteFailed(f"P: {notif.reason}")
            self.bus.dispatch(D_REGISTRATION, notif.request_id, event, now)
        else:
            raise RemoteProtocolError(
                f"{type(notif).__name__} sent to a {self.role} instance", peer=peer
            )

    def _heartbeat(self, request_ids: Sequence[str], now: float) -> list[str]:
        """Extend the leases named by D's ids (exact, then base id); return the unknown ids."""
        kind = self.p_kind
        bus = self.bus
        by_base = {get_base_request_id(i.ctx.key): i.ctx.key for i in bus.instances(kind)}
        unknown = []
        for request_id in request_ids:
            key = request_id if bus.get(kind, request_id) is not None else None
            key = key or by_base.get(get_base_request_id(request_id))
            if key is None:
                unknown.append(request_id)
            else:
                bus.dispatch(kind, key, Heartbeat(), now)
        return unknown

    def _send_heartbeats(self, now: float) -> None:
        """D: every `heartbeat_interval`, `HB:<ids>` per prefill engine (R-P15)."""
        if self.role != "decode" or now < self.next_heartbeat:
            return
        self.next_heartbeat = now + self.config.heartbeat_interval
        by_engine: dict[str, list[str]] = {}
        for engine_id, request_id in self._awaited():
            by_engine.setdefault(engine_id, []).append(request_id)
        for engine_id, request_ids in sorted(by_engine.items()):
            self.bus.execute(SendHeartbeat(engine_id, tuple(request_ids)))

    def _awaited(self) -> Iterable[tuple[str, str]]:
        """(P engine, id P knows) of every transfer D waits on while P holds a lease."""
        if self.mode == "push":
            for reg in self.bus.tagged(D_REGISTRATION, "needs_heartbeat"):
                yield reg.ctx.registration.remote_engine_id, reg.ctx.key
            return
        for read in self.bus.tagged(D_READ, "needs_heartbeat"):
            yield read.ctx.source.prefill.engine_id, read.ctx.source.request_id

    # -- reports to the engine -----------------------------------------------------------

    def _on_finished_recving(self, _inst: Instance[object], effect: ReportFinishedRecving) -> None:
        self._output.finished_recving.add(effect.request_id)

    def _on_failed_recving(self, _inst: Instance[object], effect: ReportFailedRecving) -> None:
        self._output.failed_recving[effect.request_id] = effect.reason
        self._output.invalid_block_ids.update(effect.block_ids)

    def _on_finished_sending(self, _inst: Instance[object], effect: ReportFinishedSending) -> None:
        self._output.finished_sending.add(effect.request_id)
