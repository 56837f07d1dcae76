"""An engine-like step loop around one simulated `PushSide` (deterministic simulation only).

`SimEngine` mirrors `kvhandoff.demo.push_role` over the in-memory fabric, with every TP/PP
rank of the engine (one `SimPushTransport` each, R-T03, R-T04): D allocates blocks,
finds part of some prefixes cached (R-T05) and calls `update_state_after_alloc` with the
decode leg's transfer params and the blocks it lacks (R-P01, R-P02); P "prefills" (fills
each request's blocks with a pattern, each rank its slice) and calls `request_finished`
(R-P03); both then step the scheduler and every rank through the `PushSide`, which reads
the world's virtual clock. Each rank's writer thread and the handshake executor are actors
too: `writer_pass(rank)` is one pass of that rank's writer loop, `run_job` runs one queued
handshake. What ordering they run in is the simulator's choice, never this module's.

Every outcome is reported to the world's `SimLedger`, which checks the invariants.
Request ids look like the real system's: the client id `cmpl-<n>-<i>` with a random
8-hex suffix that P and D each draw for themselves (R-P04).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvhandoff.adapters.push_rank import PushRank
from kvhandoff.adapters.push_side import PushSide
from kvhandoff.machines.kv.effects import DroppedRegistration
from kvhandoff.machines.push.d_request import D_REQUEST
from kvhandoff.machines.push.match import MATCH
from kvhandoff.machines.push.meta import PushConnectorOutput
from kvhandoff.machines.push.remote_engine import REMOTE_ENGINE
from kvhandoff.machines.push.scheduler import SCHEDULER_KINDS, LocalEngine, Role
from kvhandoff.machines.rank.worker import RANK_KINDS
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.handshake import encode_engine_handshake
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
    """One leg of a client request's attempt, reaching this engine at `at`."""

    key: str  # the attempt's ledger key
    client_id: str
    num_blocks: int
    cached: int
    at: float
    params: dict[str, Any] | None = None
    """Pull mode's decode leg: the params P's `request_finished` returned (the proxy's relay)."""


@dataclass(frozen=True, slots=True)
class HeldRequest:
    key: str
    client_id: str
    blocks: tuple[int, ...]  # logical block ids, the cached prefix first


def random_suffix(rng: random.Random) -> str:
    return f"{rng.getrandbits(32):08x}"


class SimEngine:
    """One engine (P or D, every rank) on the fabric: it can crash and be restarted."""

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
        self.config = world.config_of(role)
        self.generation = 0
        self.alive = False
        self.boot()

    # -- process lifecycle -----------------------------------------------------------

    def boot(self) -> None:
        """Start (or restart) the process: new agents, new memory, empty tables."""
        world = self.world
        cfg = self.config
        self.generation += 1
        self.transports = [self._transport(rank) for rank in range(cfg.world_size)]
        self.executor = SimHandshakeExecutor(world.network)
        self.side = PushSide(
            self.role,
            LocalEngine(self.engine_id, self.host, self.port),
            self.transports,
            self.executor.submit,
            config=cfg,
            clock=world.clock,
            physical_blocks_per_logical=world.settings.ratio,
            wall=world.clock,
            mode=world.mode,
        )
        world.network.serve(
            self.engine_id,
            self.host,
            self.port,
            lambda: encode_engine_handshake(self.side.handshake()),
        )
        self.side.scheduler.bus.on_retire(self._on_retire)
        for bus in self._buses():
            bus.on_error = self._on_bus_error
        for rank in self.side.ranks:
            rank.dropped_observers.append(self._dropped_observer(rank))
        self.pool = SimBlockPool(world.settings.capacity, world.rng)
        self.arrivals: deque[Arrival] = deque()
        self.requests: dict[str, HeldRequest] = {}
        self.retired: list[tuple[str, str]] = []  # (key, final state) of D requests
        self.last_writer_pass = [world.clock.now] * cfg.world_size
        self.dirty = False
        self.alive = True
        if world.recording:
            self.side.scheduler.bus.record(world.sink(f"{self.role}.scheduler"))
            for rank in self.side.ranks:
                rank.bus.record(world.sink(f"{self.role}{rank.rank}.main"))
                rank.writer_bus.record(world.sink(f"{self.role}{rank.rank}.writer"))
        world.apply_variant(self)

    def _transport(self, rank: int) -> SimPushTransport:
        world, cfg = self.world, self.config
        pp_rank, tp_rank = divmod(rank, cfg.tp_size)
        per_stage = len(self.members) // cfg.pp_size
        owned = self.members[pp_rank * per_stage : (pp_rank + 1) * per_stage]
        return SimPushTransport(
            world.network,
            self.engine_id,
            [(m,) for m in owned],
            num_blocks=world.settings.capacity * world.settings.ratio,
            block_len=world.settings.block_len // cfg.tp_size,
            compatibility_hash=world.compatibility_hash,
            tp_size=cfg.tp_size,
            tp_rank=tp_rank,
            pp_size=cfg.pp_size,
            pp_rank=pp_rank,
            is_decoder=self.role == "decode",
            physical_blocks_per_logical=world.settings.ratio,
        )

    def _buses(self) -> list[Any]:
        side = self.side
        return [
            side.scheduler.bus,
            *(r.bus for r in side.ranks),
            *(r.writer_bus for r in side.ranks),
        ]

    def _dropped_observer(self, rank: PushRank) -> Any:
        agent = rank.transport.agent_name
        ledger = self.world.ledger

        def observe(effect: DroppedRegistration) -> None:
            if effect.reason == "duplicate":
                ledger.dropped_as_duplicate(agent, effect.d_request_id, effect.d_rank)

        return observe

    def crash(self) -> None:
        """The process dies: its agents leave the fabric, its requests are lost (the world
        restarts it when its downtime is over)."""
        world = self.world
        world.network.crash(self.engine_id)
        self.executor.discard()
        for held in self.requests.values():
            world.ledger.lost(held.key, self.role)
        for arrival in self.arrivals:
            world.ledger.lost(arrival.key, self.role)
            if world.mode == "pull" and self.role == "prefill":
                world.ledger.lost(arrival.key, "decode")  # its decode leg is never sent
        self.requests.clear()
        self.arrivals.clear()
        self.alive = False

    def _on_retire(self, inst: Instance[Any]) -> None:
        if inst.machine.decl is D_REQUEST:
            self.retired.append((str(inst.key), inst.state))

    def _on_bus_error(self, inst: Instance[Any], event: Event, exc: BaseException) -> None:
        self.world.ledger.violation(
            f"{self.role} bus: {inst.kind} {inst.key!r} in {inst.state}: "
            f"{event.trigger!r} failed: {exc}"
        )

    def agents(self) -> set[str]:
        return {t.agent_name for t in self.transports}

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
        side = self.side
        if self.dirty or any(r.pending_completion_notifs for r in side.ranks):
            return True
        if self.arrivals and self.arrivals[0].at <= now:
            return True
        deadlines = [
            side.scheduler.bus.next_deadline(),
            *(r.bus.next_deadline() for r in side.ranks),
        ]
        if any(d is not None and d <= now for d in deadlines):
            return True
        heartbeat = self._next_heartbeat()
        return heartbeat is not None and heartbeat <= now

    def _next_heartbeat(self) -> float | None:
        """D: when the next step sends heartbeats (R-P15), if any lease needs them."""
        if self.role != "decode" or not self.side.scheduler.has_pending_push_work():
            return None
        return self.side.scheduler.next_heartbeat

    def writer_due(self, rank: int) -> bool:
        if not self.alive:
            return False
        if self.side.ranks[rank].wake.is_set():
            return True
        return self.world.clock.now >= self.next_writer_pass(rank)

    def next_writer_pass(self, rank: int) -> float:
        """When the rank's writer thread wakes by itself: self-poll interval or idle timeout.

        A pass that could find nothing to do (no notif waiting, no timer of the writer's
        machines) is skipped: it changes nothing, and skipping it lets the simulator jump
        the clock straight to the next real event. So a self-polling writer (R-P07) passes
        1 ms after a notif reaches its agent, not every 1 ms.
        """
        side = self.side.ranks[rank]
        transport = self.transports[rank]
        inbox = transport.inbox
        interval = side.writer_poll_interval_s
        last = self.last_writer_pass[rank]
        if interval is not None and (inbox or transport.batcher.any_ended()):
            return last + interval  # B-13: it settles a batch that ended, as the thread does
        deadline = side.writer_bus.next_deadline()
        if not inbox and deadline is None:
            return float("inf")
        due = last + self.world.settings.idle_timeout_s
        if not inbox and deadline is not None:
            due = max(due, deadline)
        return due

    def next_event(self) -> float | None:
        """The earliest time something happens here without outside input."""
        if not self.alive:
            return None
        times = [
            t for t in map(self.next_writer_pass, range(len(self.transports))) if t != float("inf")
        ]
        side = self.side
        for bus in (side.scheduler.bus, *(r.bus for r in side.ranks)):
            deadline = bus.next_deadline()
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

    def writer_pass(self, rank: int) -> None:
        """One pass of a rank's `kvhandoff-push-writer` loop: clear the wake, drain, execute."""
        side = self.side.ranks[rank]
        side.wake.clear()
        self.last_writer_pass[rank] = self.world.clock.now
        before = len(side.pending_completion_notifs)
        batcher = self.transports[rank].batcher
        settled = batcher.batches_settled
        try:
            side.writer_pass()
        except Exception as exc:  # the real thread logs and keeps running
            self.world.ledger.violation(f"{self.role} rank {rank} writer pass raised {exc!r}")
        if len(side.pending_completion_notifs) != before or batcher.batches_settled != settled:
            self.dirty = True  # B-13: a settled WRITE is for the engine's next poll

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
            self._abort_given_up()

    def _abort_given_up(self) -> None:
        """The engine's request-level abort path (R-P10): a request the watchdog dropped
        waits in the engine until it is aborted (a client timeout in vLLM); it is
        reported released with the next step."""
        scheduler = self.side.scheduler
        for inst in scheduler.bus.tagged(D_REQUEST, "given_up"):
            self.side.abort(str(inst.key))
            self.dirty = True

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
            self.requests[request_id] = HeldRequest(arrival.key, arrival.client_id, tuple(blocks))
            if self.role == "prefill":
                self._prefill(arrival, request_id, blocks)
            else:
                self._register(arrival, request_id, blocks)

    def _prefill(self, arrival: Arrival, request_id: str, blocks: list[int]) -> None:
        for transport in self.transports:
            fill_pattern(transport, arrival.client_id, blocks)
        self.world.ledger.leased(arrival.key, request_id)
        leg = prefill_leg({"request_id": arrival.client_id})
        _delay, params = self.side.request_finished(request_id, blocks, leg["kv_transfer_params"])
        if self.world.mode == "pull":
            self.world.relay_decode_leg(arrival, params)

    def _register(self, arrival: Arrival, request_id: str, blocks: list[int]) -> None:
        cached, lacking = blocks[: arrival.cached], blocks[arrival.cached :]
        for transport in self.transports:
            fill_pattern(transport, arrival.client_id, cached)  # a prefix cache hit (R-T05)
            fill_constant(transport, lacking, 0)
        if arrival.params is not None:  # pull: the leg carries what P returned
            params = arrival.params
        else:
            prefill = self.world.prefill
            topo = self.world.topology
            coords = PrefillCoordinates(
                prefill.engine_id, prefill.host, prefill.port, topo.p_tp, topo.p_pp
            )
            params = decode_leg({"request_id": arrival.client_id}, coords)["kv_transfer_params"]
        self.world.ledger.registered(arrival.key, request_id, tuple(blocks))
        self.side.update_state_after_alloc(request_id, lacking, params)

    def abort(self, request_id: str) -> None:
        """D's engine aborts a request (the client went away): the abort path. What the
        side reported meanwhile reaches the engine with the next step's output."""
        self.side.abort(request_id)

    # -- outcomes ------------------------------------------------------------------------

    def _account_prefill(self, output: PushConnectorOutput) -> None:
        ledger = self.world.ledger
        for request_id in sorted(output.finished_sending):
            ledger.finished_sending(request_id)
            held = self.requests.pop(request_id, None)
            if held is None:
                continue
            self.pool.release(held.blocks, request_id)
            for transport in self.transports:  # freed memory gets reused
                fill_constant(transport, held.blocks, SCRIBBLE)
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
            if not all(pattern_ok(t, held.client_id, held.blocks) for t in self.transports):
                ledger.violation(f"{request_id!r} received bytes that are not P's pattern")
            ledger.d_outcome(request_id, "received")
            self.pool.release(held.blocks, request_id)
        for request_id in sorted(output.failed_recving):
            held = self.requests.pop(request_id, None)
            if held is None:
                ledger.violation(f"failed_recving for {request_id!r}, which D does not hold")
                continue
            lacking = set(held.blocks) - set(held.blocks[: self._cached(held)])
            if not lacking <= output.invalid_block_ids:
                ledger.violation(f"{request_id!r} failed without marking its blocks invalid")
            ledger.d_outcome(request_id, "failed")
            self.world.failed(held.key)
            self._quarantine(request_id, held)
        for request_id, reason in sorted(output.released.items()):
            held = self.requests.pop(request_id, None)
            if held is None:
                ledger.violation(f"released {request_id!r}, which D does not hold")
                continue
            # P may still write into them until its lease runs out: quarantined.
            ledger.d_outcome(request_id, "expired" if "watchdog" in reason else "aborted")
            self._quarantine(request_id, held)
        self._account_retired()

    def _cached(self, held: HeldRequest) -> int:
        return self.world.ledger.clients[held.key].cached

    def _account_retired(self) -> None:
        """Every D request that ended must have been reported (received, failed or
        released) in the output of the step that took its report."""
        ledger = self.world.ledger
        retired, self.retired = self.retired, []
        for request_id, state in retired:
            if request_id in self.requests:
                ledger.violation(f"D request {request_id!r} ended {state} unreported")

    def _quarantine(self, request_id: str, held: HeldRequest) -> None:
        until = self.world.clock.now + self.world.settings.quarantine_s
        self.pool.quarantine(held.blocks, request_id, until)

    # -- end-of-run inspection ------------------------------------------------------------

    def leftovers(self) -> dict[str, int]:
        """Every table that must be empty once all deadlines passed, with its size
        (summed over the ranks)."""
        sizes: dict[str, int] = {
            "engine_requests": len(self.requests),
            "owned_blocks": len(self.pool.owner),
        }
        scheduler = self.side.scheduler.bus
        for kind in SCHEDULER_KINDS:
            sizes[f"live_{kind.name}"] = scheduler.live(kind)
        for rank in self.side.ranks:
            tables: dict[str, int] = {
                "writer_inbox": len(rank.writer_inbox),
                "handshake_results": len(rank.handshake_results),
                "peer_lost_inbox": len(rank.peer_lost_inbox),
                "pending_completion_notifs": len(rank.pending_completion_notifs),
                "posted_transfers": len(rank.posted_transfers),
                "sending_transfers": len(rank.sending_transfers),
                "pending_by_peer": len(rank.writer.pending_by_peer),
                "match_slots": rank.writer_bus.live(MATCH),
                "remote_engines": rank.writer_bus.live(REMOTE_ENGINE),
                **{f"live_{kind.name}": rank.bus.live(kind) for kind in RANK_KINDS},
            }
            for name, size in tables.items():
                sizes[name] = sizes.get(name, 0) + size
        return {name: size for name, size in sizes.items() if size}
