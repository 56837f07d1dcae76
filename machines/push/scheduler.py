"""Push-mode engine API, scheduler side: shaped like the seed's connector scheduler.

The scheduler and the worker's main thread share one bus per instance; every lifecycle
change goes through the declared machines (`push.d_registration`, `push.p_lease`).

    sched = PushScheduler(bus, role="decode", engine=local_engine)
    sched.update_state_after_alloc("cmpl-1-0-aaaa1111", [4, 5], decode_leg_params)
    meta = sched.build_connector_meta()          # -> meta.push_registrations
    ...
    sched.update_connector_output(worker_output)  # finished_recving clears the watchdog
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvhandoff.machines.pull.d_read import D_READ
from kvhandoff.machines.pull.d_read import KIND as PULL_D_KIND
from kvhandoff.machines.pull.p_lease import KIND as PULL_P_KIND
from kvhandoff.machines.pull.p_lease import PULL_P_LEASE
from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.d_registration import KIND as D_KIND
from kvhandoff.machines.push.p_lease import KIND as P_KIND
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.runtime.bus import EventBus
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

KINDS: dict[Mode, tuple[str, str]] = {"push": (D_KIND, P_KIND), "pull": (PULL_D_KIND, PULL_P_KIND)}
"""(D lifecycle, P lifecycle) per transfer mode."""


@dataclass(frozen=True, slots=True)
class LocalEngine:
    """This instance's coordinates, as peers reach its side channel."""

    engine_id: str
    host: str
    port: int
    tp_size: int = 1
    tp_rank: int = 0


@dataclass(slots=True)
class PushConnectorMeta:
    """What one scheduler step hands to the workers."""

    push_registrations: dict[str, PushRegistration] = field(default_factory=dict)
    push_finished_blocks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    pull_reads: dict[str, PullSource] = field(default_factory=dict)


@dataclass(slots=True)
class PushConnectorOutput:
    """What one worker step reports back (get_finished)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: dict[str, str] = field(default_factory=dict)
    invalid_block_ids: set[int] = field(default_factory=set)


def register_push_machines(bus: EventBus, config: PushConfig) -> None:
    """Register the main-thread lifecycles of both modes on `bus` under `config`."""
    machine_config = config.machine_config()
    for decl in (D_REGISTRATION, P_LEASE, D_READ, PULL_P_LEASE):
        bus.register(decl, machine_config)


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
        self, request_id: str, block_ids: Sequence[int], kv_transfer_params: Mapping[str, Any]
    ) -> None:
        """D: stash the registration of freshly allocated blocks; arm the watchdog (R-P02)."""
        self._require("decode", "update_state_after_alloc")
        if self.mode == "pull":
            source = pull_source(dict(kv_transfer_params))
            self.bus.create(PULL_D_KIND, request_id, source=source, block_ids=tuple(block_ids))
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
        self.bus.create(
            D_KIND, request_id, registration=registration, completions_needed=writers_per_rank
        )
        self._push_pending_registrations.append(request_id)

    # -- P side ----------------------------------------------------------------------

    def request_finished(
        self, request_id: str, block_ids: Sequence[int], kv_transfer_params: Mapping[str, Any]
    ) -> tuple[bool, dict[str, Any] | None]:
        """P: hold the blocks under a lease for the push; True delays freeing them (R-P03)."""
        self._require("prefill", "request_finished")
        if not kv_transfer_params.get("do_remote_decode"):
            return False, None
        if self.mode == "pull":
            self.bus.create(
                PULL_P_KIND,
                request_id,
                block_ids=tuple(block_ids),
                lease_extension=self.config.kv_lease_extension,
            )
            here = PrefillCoordinates(
                self.engine.engine_id, self.engine.host, self.engine.port, self.engine.tp_size
            )
            return True, pull_params(here, request_id, list(block_ids))
        self.bus.create(
            P_KIND,
            request_id,
            block_ids=tuple(block_ids),
            lease_extension=self.config.kv_lease_extension,
        )
        self._newly_finished_push_blocks.append(request_id)
        return True, None

    # -- both ------------------------------------------------------------------------

    def build_connector_meta(self) -> PushConnectorMeta:
        """Drain what this step hands to the workers; expired watchdogs fire first (R-P10)."""
        # Only D's watchdogs fire here. P's leases are reaped in get_finished (R-P11), after
        # the writer's reports are drained: a lease whose WRITE the writer just posted must
        # see write_posted before its expiry, or its blocks are freed under the DMA.
        if self.role == "decode":
            self.bus.fire_due()
        meta = PushConnectorMeta()
        for request_id in self._push_pending_registrations:
            inst = self.bus.get(self.d_kind, request_id)
            if inst is None or inst.state not in ("stashed", "waiting"):
                continue
            self.bus.dispatch(self.d_kind, request_id, "drained")
            if self.mode == "pull":
                meta.pull_reads[request_id] = inst.ctx.source
            else:
                meta.push_registrations[request_id] = inst.ctx.registration
        for request_id in self._newly_finished_push_blocks:
            inst = self.bus.get(P_KIND, request_id)
            if inst is not None and inst.state == "finished":
                meta.push_finished_blocks[request_id] = inst.ctx.block_ids
        self._push_pending_registrations.clear()
        self._newly_finished_push_blocks.clear()
        return meta

    def update_connector_output(self, output: PushConnectorOutput) -> None:
        """finished_sending clears P leases; finished_recving clears D watchdogs (R-P09)."""
        self._confirm(self.p_kind, output.finished_sending, "finished_sending")
        self._confirm(self.d_kind, output.finished_recving, "finished_recving")

    def has_pending_push_work(self) -> bool:
        """True while any push state is in flight on this side (R-P13)."""
        return self.bus.live(self.d_kind) > 0 or self.bus.live(self.p_kind) > 0

    def abort(self, request_id: str) -> None:
        """D: the engine's request-level abort path ends a registration."""
        if self.bus.get(self.d_kind, request_id) is not None:
            self.bus.dispatch(self.d_kind, request_id, "abort")

    def _confirm(self, kind: str, request_ids: Iterable[str], event: str) -> None:
        for request_id in request_ids:
            inst = self.bus.get(kind, request_id)
            if inst is not None and inst.state == "reported":
                self.bus.dispatch(kind, request_id, event)

    def _require(self, role: Role, call: str) -> None:
        if self.role != role:
            raise LocalProtocolError(f"{call} is a {role}-side call; this scheduler is {self.role}")
