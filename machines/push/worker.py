"""Push-mode engine API, worker main-thread side: shaped like the seed's connector worker.

The worker's main thread never touches NIXL notifs or WRITEs: it hands work to the writer
thread through effects (`EnqueueRegistration`, `EnqueueFinishedBlocks`, `QueueEviction`,
`WakeWriter`) and learns what happened from the items the writer put on the
pending-completion-notifs queue, which `get_finished` drains. Heartbeats leave from here.

    worker = PushWorker(bus, role="prefill", engine=local_engine)
    worker.register_kv_caches(regions)           # member-major layout, once (R-P14)
    worker.start_load_kv(meta)                    # hand over; wake the writer if needed
    output = worker.get_finished(drained_items)   # always wakes the writer
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kvhandoff.machines.push.d_registration import KIND as D_KIND
from kvhandoff.machines.push.effects import (
    FailedRecving,
    FinishedRecving,
    FinishedSending,
    ForwardToMain,
    ReportToMain,
    SendHeartbeat,
    WakeWriter,
    Warn,
)
from kvhandoff.machines.push.p_lease import KIND as P_KIND
from kvhandoff.machines.push.scheduler import (
    KINDS,
    LocalEngine,
    Mode,
    PushConnectorMeta,
    PushConnectorOutput,
    Role,
)
from kvhandoff.machines.runtime.bus import EventBus
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
    ) -> None:
        self.bus = bus
        self.role = role
        self.engine = engine
        self.config = config or PushConfig()
        self.mode = mode
        self.d_kind, self.p_kind = KINDS[mode]
        # The side whose transfers get_finished polls: P's WRITEs (push), D's READs (pull).
        self.polled_kind, self.polled_state = (
            (self.p_kind, "writing") if mode == "push" else (self.d_kind, "reading")
        )
        self.layout: MemberLayout | None = None
        self.rejected_notifs = 0
        self._warned_peers: set[str] = set()
        self._output = PushConnectorOutput()
        self._next_heartbeat = bus.clock() + self.config.heartbeat_interval
        bus.handle(FinishedRecving, self._on_finished_recving)
        bus.handle(FailedRecving, self._on_failed_recving)
        bus.handle(FinishedSending, self._on_finished_sending)
        bus.handle(Warn, lambda inst, warn: log.warning("%s: %s", warn.request_id, warn.message))

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

    def start_load_kv(self, meta: PushConnectorMeta) -> None:
        """Hand this step's registrations / finished blocks to the writer (R-P02, R-P03)."""
        for request_id in meta.push_registrations:
            self.bus.dispatch(D_KIND, request_id, "enqueued")
        for request_id in meta.push_finished_blocks:
            self.bus.dispatch(P_KIND, request_id, "staged")
        for request_id in meta.pull_reads:
            self.bus.dispatch(self.d_kind, request_id, "enqueued")
        if meta.push_registrations or meta.push_finished_blocks or meta.pull_reads:
            self.bus.execute(WakeWriter())
        self._send_heartbeats()

    def get_finished(self, writer_items: Iterable[WriterItem] = ()) -> PushConnectorOutput:
        """Drain the writer's items, reap leases, poll WRITEs; always wakes the writer."""
        for item in writer_items:
            self._on_writer_item(item)
        self.bus.fire_due()
        for inst in self.bus.instances(self.polled_kind):
            if inst.state == self.polled_state:
                self.bus.dispatch(self.polled_kind, inst.key, "poll")
        self.bus.execute(WakeWriter())
        output, self._output = self._output, PushConnectorOutput()
        return output

    # -- the pending-completion-notifs queue (R-P08) -------------------------------------

    def _on_writer_item(self, item: WriterItem) -> None:
        if isinstance(item, ReportToMain):
            kind = self.p_kind if self.role == "prefill" else self.d_kind
            if self.bus.get(kind, item.request_id) is not None:
                self.bus.dispatch(kind, item.request_id, item.event)
            return
        try:
            self._on_notif(item)
        except RemoteProtocolError as exc:
            self.rejected_notifs += 1
            if item.peer not in self._warned_peers:
                self._warned_peers.add(item.peer)
                log.warning(
                    "rejected notif from %s: %s (further ones counted only)", item.peer, exc
                )

    def _on_notif(self, item: ForwardToMain) -> None:
        notif, peer = item.notif, item.peer
        if isinstance(notif, HeartbeatNotif) and self.role == "prefill":
            unknown = self._heartbeat(notif.request_ids)
            if unknown:
                raise RemoteProtocolError(f"heartbeat for unknown requests {unknown}", peer=peer)
        elif isinstance(notif, CompletionNotif) and self.role == "prefill" and self.mode == "pull":
            if self.bus.get(self.p_kind, notif.request_id) is None:
                raise RemoteProtocolError(
                    f"completion for unknown lease {notif.request_id!r}", peer=peer
                )
            self.bus.dispatch(self.p_kind, notif.request_id, "completion")
        elif isinstance(notif, CompletionNotif | WriteFailedNotif) and self.role == "decode":
            if self.bus.get(D_KIND, notif.request_id) is None:
                raise RemoteProtocolError(
                    f"notif for unknown request {notif.request_id!r}", peer=peer
                )
            event = "completion" if isinstance(notif, CompletionNotif) else "write_failed"
            payload = None if isinstance(notif, CompletionNotif) else f"P: {notif.reason}"
            self.bus.dispatch(D_KIND, notif.request_id, event, payload)
        else:
            raise RemoteProtocolError(
                f"{type(notif).__name__} sent to a {self.role} instance", peer=peer
            )

    def _heartbeat(self, request_ids: Sequence[str]) -> list[str]:
        """Extend the leases named by D's ids (exact, then base id); return the unknown ids."""
        kind = self.p_kind
        by_base = {get_base_request_id(inst.key): inst.key for inst in self.bus.instances(kind)}
        unknown = []
        for request_id in request_ids:
            key = request_id if self.bus.get(kind, request_id) else None
            key = key or by_base.get(get_base_request_id(request_id))
            if key is None:
                unknown.append(request_id)
            else:
                self.bus.dispatch(kind, key, "heartbeat")
        return unknown

    def _send_heartbeats(self) -> None:
        """D: every `heartbeat_interval`, `HB:<ids>` per prefill engine (R-P15)."""
        now = self.bus.clock()
        if self.role != "decode" or now < self._next_heartbeat:
            return
        self._next_heartbeat = now + self.config.heartbeat_interval
        by_engine: dict[str, list[str]] = {}
        for engine_id, request_id in self._awaited():
            by_engine.setdefault(engine_id, []).append(request_id)
        for engine_id, request_ids in sorted(by_engine.items()):
            self.bus.execute(SendHeartbeat(engine_id, tuple(request_ids)))

    def _awaited(self) -> Iterable[tuple[str, str]]:
        """(P engine, id P knows) of every transfer D waits on while P holds a lease."""
        if self.mode == "push":
            for inst in self.bus.instances(D_KIND):
                if inst.state == "sent":
                    yield inst.ctx.registration.remote_engine_id, inst.key
            return
        for inst in self.bus.instances(self.d_kind):
            if inst.state in ("queued", "awaiting_handshake", "reading"):
                yield inst.ctx.source.prefill.engine_id, inst.ctx.source.request_id

    # -- reports to the engine -----------------------------------------------------------

    def _on_finished_recving(self, _inst: Any, effect: FinishedRecving) -> None:
        self._output.finished_recving.add(effect.request_id)

    def _on_failed_recving(self, _inst: Any, effect: FailedRecving) -> None:
        self._output.failed_recving[effect.request_id] = effect.reason
        self._output.invalid_block_ids.update(effect.block_ids)

    def _on_finished_sending(self, _inst: Any, effect: FinishedSending) -> None:
        self._output.finished_sending.add(effect.request_id)
