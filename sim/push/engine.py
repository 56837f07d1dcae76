"""An engine-like step loop around one simulated `PushSide` (deterministic simulation only).

`SimEngine` mirrors `kvhandoff.demo.push_role` over the in-memory fabric: D allocates
blocks and calls `update_state_after_alloc` with the decode leg's transfer params
(R-P01, R-P02); P "prefills" (fills each request's blocks with a pattern) and calls
`request_finished` (R-P03); both then step `build_connector_meta` -> `start_load_kv` ->
`get_finished` -> `update_connector_output`, all through the `PushSide`, which reads the
world's virtual clock. The writer
thread and the handshake executor are actors too: `writer_pass` is one pass of the
writer loop, `run_job` runs one queued handshake. What ordering they run in is the
simulator's choice, never this module's.

Every outcome is reported to the world's `SimLedger`, which checks the invariants.
Request ids look like the real system's: the client id `cmpl-<n>-<i>` with a random
8-hex suffix that P and D each draw for themselves (R-P04).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvhandoff.adapters.push_side import PushSide
from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.handshake import HANDSHAKE
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.push.scheduler import LocalEngine, PushConnectorOutput, Role
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg, prefill_leg
from kvhandoff.sim.push.executor import SimHandshakeExecutor
from kvhandoff.sim.push.memory import (
    SCRIBBLE,
    SimBlockPool,
    fill_constant,
    fill_pattern,
    pattern_ok,
)
from kvhandoff.sim.push.transport import SimPushTransport

if TYPE_CHECKING:
    from kvhandoff.sim.push.world import SimulatedPushWorld


@dataclass(frozen=True, slots=True)
class Arrival:
    """One leg of a client request, reaching this engine at `at`."""

    client_id: str
    num_blocks: int
    at: float


@dataclass(frozen=True, slots=True)
class HeldRequest:
    client_id: str
    blocks: tuple[int, ...]  # logical block ids


def random_suffix(rng: random.Random) -> str:
    return f"{rng.getrandbits(32):08x}"


class SimEngine:
    """One engine process (P or D) on the fabric: it can crash and be restarted."""

    def __init__(
        self,
        world: SimulatedPushWorld,
        role: Role,
        engine_id: str,
        host: str,
        port: int,
        members: tuple[str, ...],
    ) -> None:
        self.world = world
        self.role = role
        self.engine_id = engine_id
        self.host = host
        self.port = port
        self.members = members
        self.generation = 0
        self.alive = False
        self.boot()

    # -- process lifecycle -----------------------------------------------------------

    def boot(self) -> None:
        """Start (or restart) the process: a new agent, new memory, empty tables."""
        world = self.world
        self.generation += 1
        self.transport = SimPushTransport(
            world.network,
            self.engine_id,
            [(m,) for m in self.members],
            num_blocks=world.settings.capacity * world.settings.ratio,
            block_len=world.settings.block_len,
            compatibility_hash=world.compatibility_hash,
            is_decoder=self.role == "decode",
            physical_blocks_per_logical=world.settings.ratio,
        )
        self.transport.serve(self.host, self.port)
        self.executor = SimHandshakeExecutor(world.network)
        self.side = PushSide(
            self.role,
            LocalEngine(self.engine_id, self.host, self.port),
            self.transport,
            self.executor.submit,
            config=world.settings.push,
            clock=world.clock,
            physical_blocks_per_logical=world.settings.ratio,
        )
        self.side.bus.on_retire(self._on_retire)
        self.side.bus.on_error = self._on_bus_error
        self.side.writer_bus.on_error = self._on_bus_error
        self.pool = SimBlockPool(world.settings.capacity, world.rng)
        self.arrivals: deque[Arrival] = deque()
        self.requests: dict[str, HeldRequest] = {}
        self.retired: list[tuple[str, str, bool]] = []  # (key, state, unreported)
        self.last_writer_pass = world.clock.now
        self.dirty = False
        self.alive = True
        if world.recording:
            self.side.bus.record(world.sink(f"{self.role}.main"))
            self.side.writer_bus.record(world.sink(f"{self.role}.writer"))
        world.apply_variant(self)

    def crash(self) -> None:
        """The process dies: its agent leaves the fabric, its requests are lost (the world
        restarts it when its downtime is over)."""
        world = self.world
        world.network.crash(self.engine_id)
        self.executor.discard()
        for held in self.requests.values():
            world.ledger.lost(held.client_id, self.role)
        for arrival in self.arrivals:
            world.ledger.lost(arrival.client_id, self.role)
        self.requests.clear()
        self.arrivals.clear()
        self.alive = False

    def _on_retire(self, inst: Instance[Any]) -> None:
        if inst.machine.decl is D_REGISTRATION:
            self.retired.append((str(inst.key), inst.state, inst.has("unreported")))

    def _on_bus_error(self, inst: Instance[Any], event: Event, exc: BaseException) -> None:
        self.world.ledger.violation(
            f"{self.role} bus: {inst.kind} {inst.key!r} in {inst.state}: "
            f"{event.trigger!r} failed: {exc}"
        )

    # -- what the scheduler may run ------------------------------------------------------

    def has_work(self) -> bool:
        return bool(
            self.alive
            and (self.arrivals or self.requests or self.side.scheduler.has_pending_push_work())
        )

    def busy(self) -> bool:
        """A step now could change something (new input since the last step, a due timer)."""
        if not self.alive:
            return False
        now = self.world.clock.now
        if self.dirty or self.side.pending_completion_notifs:
            return True
        if self.arrivals and self.arrivals[0].at <= now:
            return True
        deadline = self.side.bus.next_deadline()
        if deadline is not None and deadline <= now:
            return True
        heartbeat = self._next_heartbeat()
        return heartbeat is not None and heartbeat <= now

    def _next_heartbeat(self) -> float | None:
        """D: when the next step sends heartbeats (R-P15), if any lease needs them."""
        if self.role != "decode" or not self.side.scheduler.has_pending_push_work():
            return None
        return self.side.worker.next_heartbeat

    def writer_due(self) -> bool:
        if not self.alive:
            return False
        if self.side.wake.is_set():
            return True
        return self.world.clock.now >= self.next_writer_pass()

    def next_writer_pass(self) -> float:
        """When the writer thread wakes by itself: self-poll interval or idle timeout.

        A pass that could find nothing to do (no notif waiting, no pending registration to
        expire, no handshake timer) is skipped: it changes nothing, and skipping it lets
        the simulator jump the clock straight to the next real event. So a self-polling
        writer (R-P07) passes 1 ms after a notif reaches its agent, not every 1 ms.
        """
        interval = self.side.self_poll_interval_s
        if interval is not None and self.transport.inbox:
            return self.last_writer_pass + interval
        side = self.side
        idle_work = (
            side.writer.pending_d_registrations
            or side.writer_bus.next_deadline() is not None
            or self.transport.inbox
        )
        if not idle_work:
            return float("inf")
        return self.last_writer_pass + self.world.settings.idle_timeout_s

    def next_event(self) -> float | None:
        """The earliest time something happens here without outside input."""
        if not self.alive:
            return None
        # The writer bus's timers fire in writer passes, which the first entry covers.
        times = [t for t in (self.next_writer_pass(),) if t != float("inf")]
        deadline = self.side.bus.next_deadline()
        if deadline is not None:
            times.append(deadline)
        ready = self.executor.next_ready()
        if ready is not None:
            times.append(ready)
        if self.arrivals:
            times.append(self.arrivals[0].at)
        heartbeat = self._next_heartbeat()
        if heartbeat is not None:
            times.append(heartbeat)
        return min(times, default=None)

    # -- actors ------------------------------------------------------------------------

    def writer_pass(self) -> None:
        """One pass of the `kvhandoff-push-writer` loop: clear the wake, drain, execute."""
        self.side.wake.clear()
        self.last_writer_pass = self.world.clock.now
        before = len(self.side.pending_completion_notifs)
        try:
            self.side.writer_pass()
        except Exception as exc:  # the real thread logs and keeps running
            self.world.ledger.violation(f"{self.role} writer pass raised {exc!r}")
        if len(self.side.pending_completion_notifs) != before:
            self.dirty = True

    def run_job(self, index: int | None = None) -> None:
        if index is None:
            self.executor.run_next()
        else:
            self.executor.run_at(index)

    def step(self) -> None:
        """One engine step: admit arrived legs, then the connector calls of a step."""
        self.dirty = False
        world = self.world
        self.pool.expire_quarantine(world.clock.now)
        output = PushConnectorOutput()
        try:
            self._admit()
            output = self.side.step()
        except Exception as exc:
            world.ledger.violation(f"{self.role} engine step raised {exc!r}")
        if self.role == "prefill":
            self._account_prefill(output)
        else:
            self._account_decode(output)

    # -- admission ---------------------------------------------------------------------

    def _admit(self) -> None:
        now = self.world.clock.now
        while self.arrivals and self.arrivals[0].at <= now:
            arrival = self.arrivals[0]
            request_id = f"{arrival.client_id}-{random_suffix(self.world.rng)}"
            blocks = self.pool.allocate(arrival.num_blocks, request_id)
            if blocks is None:
                return  # out of KV blocks: the request waits, as in an engine
            self.arrivals.popleft()
            self.requests[request_id] = HeldRequest(arrival.client_id, tuple(blocks))
            if self.role == "prefill":
                self._prefill(arrival.client_id, request_id, blocks)
            else:
                self._register(arrival.client_id, request_id, blocks)

    def _prefill(self, client_id: str, request_id: str, blocks: list[int]) -> None:
        fill_pattern(self.transport, client_id, blocks)
        self.world.ledger.leased(client_id, request_id)
        leg = prefill_leg({"request_id": client_id})
        self.side.request_finished(request_id, blocks, leg["kv_transfer_params"])

    def _register(self, client_id: str, request_id: str, blocks: list[int]) -> None:
        fill_constant(self.transport, blocks, 0)
        prefill = self.world.prefill
        coords = PrefillCoordinates(prefill.engine_id, prefill.host, prefill.port, 1)
        leg = decode_leg({"request_id": client_id}, coords)
        self.world.ledger.registered(client_id, request_id, tuple(blocks))
        self.side.update_state_after_alloc(request_id, blocks, leg["kv_transfer_params"])

    def abort(self, request_id: str) -> None:
        """D's engine aborts a request (the client went away): the abort path. What the
        side reported meanwhile (the writer's items it took first) reaches the engine with
        the next step's output, like any report."""
        self.side.abort(request_id)
        self._account_retired(reported_too=False)

    # -- outcomes ------------------------------------------------------------------------

    def _account_prefill(self, output: PushConnectorOutput) -> None:
        ledger = self.world.ledger
        for request_id in sorted(output.finished_sending):
            ledger.finished_sending(request_id)
            held = self.requests.pop(request_id, None)
            if held is None:
                continue
            self.pool.release(held.blocks, request_id)
            fill_constant(self.transport, held.blocks, SCRIBBLE)  # freed memory gets reused
        if output.finished_recving or output.failed_recving:
            ledger.violation("P reported receives")

    def _account_decode(self, output: PushConnectorOutput) -> None:
        ledger = self.world.ledger
        if output.finished_sending:
            ledger.violation("D reported sends")
        for request_id in sorted(output.finished_recving):
            held = self.requests.pop(request_id, None)
            if held is None:
                ledger.violation(f"finished_recving for {request_id!r}, which D does not hold")
                continue
            if not pattern_ok(self.transport, held.client_id, held.blocks):
                ledger.violation(f"{request_id!r} received bytes that are not P's pattern")
            ledger.d_outcome(request_id, "received")
            self.pool.release(held.blocks, request_id)
        for request_id in sorted(output.failed_recving):
            held = self.requests.pop(request_id, None)
            if held is None:
                ledger.violation(f"failed_recving for {request_id!r}, which D does not hold")
                continue
            if not set(held.blocks) <= output.invalid_block_ids:
                ledger.violation(f"{request_id!r} failed without marking its blocks invalid")
            ledger.d_outcome(request_id, "failed")
            self._quarantine(request_id, held)
        self._account_retired(reported_too=True)

    def _account_retired(self, *, reported_too: bool) -> None:
        """Registrations that ended: the unreported ones (expired, aborted) the engine's
        abort path fails; the reported ones must have been in this step's output."""
        ledger = self.world.ledger
        retired, self.retired = self.retired, []
        for request_id, state, unreported in retired:
            if not (unreported or reported_too):
                self.retired.append((request_id, state, unreported))
                continue
            held = self.requests.pop(request_id, None)
            if held is None:
                continue
            if unreported:
                # The engine's request-level abort path fails what the watchdog dropped.
                ledger.d_outcome(request_id, state)
                self._quarantine(request_id, held)
            else:
                ledger.violation(f"D registration {request_id!r} ended {state} unreported")
                self.requests[request_id] = held

    def _quarantine(self, request_id: str, held: HeldRequest) -> None:
        until = self.world.clock.now + self.world.settings.quarantine_s
        self.pool.quarantine(held.blocks, request_id, until)

    # -- end-of-run inspection ------------------------------------------------------------

    def leftovers(self) -> dict[str, int]:
        """Every table that must be empty once all deadlines passed, with its size."""
        side, writer = self.side, self.side.writer
        deferred = sum(len(inst.ctx.deferred) for inst in side.writer_bus.instances(HANDSHAKE))
        tables: dict[str, Any] = {
            "push_finished_blocks": writer.push_finished_blocks,
            "pending_d_registrations": writer.pending_d_registrations,
            "finished_by_base": writer._finished_by_base,
            "pending_by_base": writer._pending_by_base,
            "pending_since": writer._pending_since,
            "reg_send_inbox": side.reg_send_inbox,
            "finished_blocks_inbox": side.finished_blocks_inbox,
            "deferred_push_inbox": side.deferred_push_inbox,
            "evict_finished_inbox": side.evict_finished_inbox,
            "handshake_results": side.handshake_results,
            "peer_lost_inbox": side.peer_lost_inbox,
            "rehandshaked": side._rehandshaked,
            "pending_senders": writer._pending_senders,
            "pending_completion_notifs": side.pending_completion_notifs,
            "sending_transfers": side._sending_transfers,
            "posted_transfers": side._posted_transfers,
            "engine_requests": self.requests,
            "owned_blocks": self.pool.owner,
        }
        sizes = {name: len(table) for name, table in tables.items()}
        sizes["handshake_deferred"] = deferred
        sizes["live_d_registrations"] = side.bus.live(D_REGISTRATION)
        sizes["live_p_leases"] = side.bus.live(P_LEASE)
        return {name: size for name, size in sizes.items() if size}
