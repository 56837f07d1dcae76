"""Push-mode engine API, scheduler side: shaped like the seed's connector scheduler.

The scheduler and the worker's main thread share one bus per instance; every lifecycle
change goes through the declared machines (`push.d_registration`, `push.p_lease`, and in
pull mode `pull.d_read`, `pull.p_lease`). Time is an argument: every call that changes
state takes `now`.

    sched = PushScheduler(bus, role="decode", engine=local_engine)
    sched.update_state_after_alloc("cmpl-1-0-aaaa1111", [4, 5], decode_leg_params, now)
    meta = sched.build_connector_meta(now)        # -> meta.push_registrations
    ...
    sched.update_connector_output(worker_output, now)  # finished_recving clears the watchdog

`PushConnectorMeta` (scheduler -> workers) and `PushConnectorOutput` (worker ->
scheduler) are msgspec Structs of plain data: they can cross a process boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from kvhandoff.machines.pull.d_read import D_READ, DReadCtx
from kvhandoff.machines.pull.p_lease import PULL_P_LEASE, PullLeaseCtx
from kvhandoff.machines.push.d_registration import D_REGISTRATION, DRegistrationCtx
from kvhandoff.machines.push.events import Abort, Drained, FinishedRecving, FinishedSending
from kvhandoff.machines.push.p_lease import P_LEASE, PLeaseCtx
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.protocol.legs import (
    PrefillCoordinates,
    PullSource,
    prefill_coordinates,
    pull_params,
    pull_source,
)
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PushRegistration

Role = Literal["prefill", "decode"]
Mode = Literal["push", "pull"]

DKind = Declaration[Any]
"""D's lifecycle of the mode: `D_REGISTRATION` (push) or `D_READ` (pull)."""
PKind = Declaration[Any]
"""P's lifecycle of the mode: `P_LEASE` (push) or `PULL_P_LEASE` (pull)."""

KINDS: dict[Mode, tuple[DKind, PKind]] = {
    "push": (D_REGISTRATION, P_LEASE),
    "pull": (D_READ, PULL_P_LEASE),
}
"""(D lifecycle, P lifecycle) per transfer mode."""

MAIN_THREAD_KINDS: tuple[Declaration[Any], ...] = (D_REGISTRATION, P_LEASE, D_READ, PULL_P_LEASE)
"""Every lifecycle on a side's main-thread bus (`register_push_machines`)."""


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """This instance's coordinates, as peers reach its side channel."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    tp_rank: int = 0


class PushConnectorMeta(msgspec.Struct, kw_only=True):
    """What one scheduler step hands to the workers."""

    push_registrations: dict[str, PushRegistration] = msgspec.field(default_factory=dict)
    push_finished_blocks: dict[str, tuple[int, ...]] = msgspec.field(default_factory=dict)
    pull_reads: dict[str, PullSource] = msgspec.field(default_factory=dict)


class PushConnectorOutput(msgspec.Struct, kw_only=True):
    """What one worker step reports back (get_finished)."""

    finished_sending: set[str] = msgspec.field(default_factory=set)
    finished_recving: set[str] = msgspec.field(default_factory=set)
    failed_recving: dict[str, str] = msgspec.field(default_factory=dict)
    invalid_block_ids: set[int] = msgspec.field(default_factory=set)


def register_push_machines(bus: EventBus, config: PushConfig) -> None:
    """Register the main-thread lifecycles of both modes on `bus` under `config`."""
    machine_config = config.machine_config()
    bus.register(D_REGISTRATION, machine_config)
    bus.register(P_LEASE, machine_config)
    bus.register(D_READ, machine_config)
    bus.register(PULL_P_LEASE, machine_config)


class PushScheduler:
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
        self._push_pending_registrations: list[str] = []
        self._newly_finished_push_blocks: list[str] = []

    # -- D side ----------------------------------------------------------------------

    def update_state_after_alloc(
        self,
        request_id: str,
        block_ids: Sequence[int],
        kv_transfer_params: Mapping[str, Any],
        now: float,
    ) -> None:
        """D: stash the registration of freshly allocated blocks; arm the watchdog (R-P02)."""
        self._require("decode", "update_state_after_alloc")
        if self.mode == "pull":
            source = pull_source(dict(kv_transfer_params))
            self.bus.create(D_READ, DReadCtx(request_id, source, tuple(block_ids)), now)
            self._push_pending_registrations.append(request_id)
            return
        prefill = prefill_coordinates(dict(kv_transfer_params))
        registration = PushRegistration(
            request_id=request_id,
            decode_engine_id=self.engine.engine_id,
            decode_host=self.engine.host,
            decode_port=self.engine.port,
            decode_tp_size=self.engine.tp_size,
            decode_tp_rank=self.engine.tp_rank,
            block_ids=tuple(block_ids),
            remote_engine_id=prefill.engine_id,
            remote_host=prefill.host,
            remote_port=prefill.port,
            remote_tp_size=prefill.tp_size,
        )
        writers_per_rank = max(1, prefill.tp_size // self.engine.tp_size)
        ctx = DRegistrationCtx(request_id, registration, completions_needed=writers_per_rank)
        self.bus.create(D_REGISTRATION, ctx, now)
        self._push_pending_registrations.append(request_id)

    # -- P side ----------------------------------------------------------------------

    def request_finished(
        self,
        request_id: str,
        block_ids: Sequence[int],
        kv_transfer_params: Mapping[str, Any],
        now: float,
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: hold the blocks under a lease for the push; True delays freeing them (R-P03)."""
        self._require("prefill", "request_finished")
        if not kv_transfer_params.get("do_remote_decode"):
            return False, None
        extension = self.config.kv_lease_extension
        if self.mode == "pull":
            ctx = PullLeaseCtx(request_id, tuple(block_ids), lease_extension=extension)
            self.bus.create(PULL_P_LEASE, ctx, now)
            here = PrefillCoordinates(
                self.engine.engine_id, self.engine.host, self.engine.port, self.engine.tp_size
            )
            return True, pull_params(here, request_id, list(block_ids))
        lease = PLeaseCtx(request_id, tuple(block_ids), lease_extension=extension)
        self.bus.create(P_LEASE, lease, now)
        self._newly_finished_push_blocks.append(request_id)
        return True, None

    # -- both ------------------------------------------------------------------------

    def build_connector_meta(self, now: float) -> PushConnectorMeta:
        """Drain what this step hands to the workers; expired watchdogs fire first (R-P10)."""
        # Only D's time moves here. P's leases are reaped in get_finished (R-P11), after
        # the writer's reports are taken: a lease whose WRITE the writer just posted must
        # see the post before its expiry, or its blocks are freed under the DMA.
        if self.role == "decode":
            self.bus.advance(now)
        meta = PushConnectorMeta()
        for request_id in self._push_pending_registrations:
            if self.mode == "pull":
                read = self.bus.get(D_READ, request_id)
                if read is not None and read.has("drainable"):
                    self.bus.dispatch(D_READ, request_id, Drained(), now)
                    meta.pull_reads[request_id] = read.ctx.source
                continue
            reg = self.bus.get(D_REGISTRATION, request_id)
            if reg is not None and reg.has("drainable"):
                self.bus.dispatch(D_REGISTRATION, request_id, Drained(), now)
                meta.push_registrations[request_id] = reg.ctx.registration
        for request_id in self._newly_finished_push_blocks:
            lease = self.bus.get(P_LEASE, request_id)
            if lease is not None and lease.has("drainable"):
                meta.push_finished_blocks[request_id] = lease.ctx.block_ids
        self._push_pending_registrations.clear()
        self._newly_finished_push_blocks.clear()
        return meta

    def update_connector_output(self, output: PushConnectorOutput, now: float) -> None:
        """finished_sending clears P leases; finished_recving clears D watchdogs (R-P09)."""
        self._confirm(self.p_kind, output.finished_sending, FinishedSending(), now)
        self._confirm(self.d_kind, output.finished_recving, FinishedRecving(), now)

    def has_pending_push_work(self) -> bool:
        """True while any push state is in flight on this side (R-P13)."""
        return self.bus.live(self.d_kind) > 0 or self.bus.live(self.p_kind) > 0

    def abort(self, request_id: str, now: float) -> None:
        """D: the engine's request-level abort path ends a registration or read that has
        not been reported yet (a reported receive reaches the engine as usual)."""
        self.bus.advance(now)
        if self.bus.has_tag(self.d_kind, request_id, "abortable"):
            self.bus.dispatch(self.d_kind, request_id, Abort(), now)

    def _confirm(
        self, kind: Declaration[Any], request_ids: Iterable[str], event: Event, now: float
    ) -> None:
        for request_id in request_ids:
            if self.bus.has_tag(kind, request_id, "confirmable"):
                self.bus.dispatch(kind, request_id, event, now)

    def _require(self, role: Role, call: str) -> None:
        if self.role != role:
            raise LocalProtocolError(f"{call} is a {role}-side call; this scheduler is {self.role}")
