"""A whole P/D pair over the in-memory fabric, under one seeded scheduler (simulation only).

`SimulatedPushWorld` holds two `SimEngine`s (prefill and decode, each a `PushSide` with
every TP/PP rank, each rank's writer and the handshake executor as actors), one
`SimNetwork` and one `VirtualClock`. A seed draws the world's shape first: its topology
(TP 1->1, 2->1, 1->2, a PP-2 producer, ..., R-T03, R-T04) and whether the engines share a
cluster key (S-05). Nothing runs on its own: every ordering decision (which engine steps,
which rank's writer passes, which message is delivered, which handshake job runs, when
the clock moves, and which fault strikes) is made by the world's seeded `random.Random`,
so a run replays exactly from its seed.

Beyond the fabric's faults the world plays a proxy that retries some failed requests
under the same client id (a new attempt of the same base request id), decode legs that
find part of their prefix cached (R-T05), and hostile processes: a foreign one sending
completions, `PUSH_FAIL`s, heartbeats and `PUSH_REG`s under names of no known engine, and,
in worlds with a cluster key, a spoofing one that uses real agents' names (S-02, S-05).

The scheduler, the run and its end are `SeededWorld`'s (`kvhandoff.sim.world`); this
world says what is due and how likely (`due_actions`), how its faults strike, and what
must be empty at the end (`RunChecks`).
"""

from __future__ import annotations

import random
from typing import ClassVar, Unpack

from kvhandoff.machines.push.d_request import D_REQUEST
from kvhandoff.machines.push.scheduler import Mode
from kvhandoff.protocol.handshake import compatibility_hash
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.sim.contracts import Choices, WorldOptions
from kvhandoff.sim.faults import SimFaults
from kvhandoff.sim.push.checks import RunChecks
from kvhandoff.sim.push.engine import Arrival, SimEngine
from kvhandoff.sim.push.fabric import SimNetwork
from kvhandoff.sim.push.ledger import ClientRecord, SimLedger
from kvhandoff.sim.push.rogue import Rogue
from kvhandoff.sim.push.settings import MEMBERS, SimSettings, Topology, Variant
from kvhandoff.sim.world import SeededWorld

__all__ = ["SimulatedPushWorld"]


class SimulatedPushWorld(RunChecks, SeededWorld[SimSettings, ClientRecord, Variant]):
    """P and D over one fabric and one clock; the scheduler comes from `SeededWorld`,
    the checks from `RunChecks`."""

    protocol: ClassVar[str] = "push"
    mode: ClassVar[Mode] = "push"  # the engines' transfer mode (`SimulatedPullWorld`: pull)
    roles: ClassVar[tuple[str, ...]] = ("prefill", "decode")
    restart_order: ClassVar[tuple[str, ...]] = roles
    # Multi-rank worlds take about twice the actions of a single-rank one per request;
    # halving the per-action rates keeps about one crash or partition in two runs.
    crash_rate: ClassVar[float] = 0.5
    partition_rate: ClassVar[float] = 0.5

    def __init__(
        self,
        seed: int,
        *,
        topology: Topology | None = None,
        keyed: bool | None = None,
        **options: Unpack[WorldOptions[SimSettings, Variant]],
    ) -> None:
        super().__init__(seed, **options)
        settings = self.settings
        drawn = self.rng.choice(self.topologies(settings))
        self.topology = topology if topology is not None else drawn
        lucky = self.rng.random() < settings.keyed
        self.keyed = keyed if keyed is not None else lucky
        self.network = SimNetwork(random.Random(self.rng.getrandbits(64)), self.clock, self.faults)
        self.network.observer = self
        self.ledger = SimLedger()
        self.ledger.now = self.clock.now
        self.violations = self.ledger.violations  # the ledger records every broken rule
        self.compatibility_hash = compatibility_hash(
            "kvhandoff-sim", "sim-model", "uint8", self.settings.block_len
        )
        self.retries: list[tuple[float, str, int]] = []  # (when, client id, blocks)
        self.prefill = SimEngine(self, "prefill", "prefill-0", "10.0.0.1", 5600, MEMBERS)
        # D lists its regions in another order: routing must go by member (R-P14).
        self.decode = SimEngine(self, "decode", "decode-0", "10.0.0.2", 5700, MEMBERS[::-1])
        self.engines = (self.prefill, self.decode)
        self.rogue = Rogue(self)

    def default_settings(self) -> SimSettings:
        return SimSettings()

    def topologies(self, settings: SimSettings) -> tuple[Topology, ...]:
        """What a seed draws its topology from."""
        return settings.topologies

    def config_of(self, role: str) -> PushConfig:
        return self.settings.config(self.topology, role, keyed=self.keyed)

    def violation(self, message: str) -> None:
        self.ledger.violation(message)

    def apply_variant(self, engine: SimEngine) -> None:
        if self.variant is not None:
            self.variant(engine)

    def engine(self, role: str) -> SimEngine:
        return self.prefill if role == "prefill" else self.decode

    # -- actions -------------------------------------------------------------------------

    def issue(
        self, num_blocks: int | None = None, *, probe: bool = False, client_id: str | None = None
    ) -> str:
        """The proxy sends one client request's two legs (R-P01); they may arrive apart.
        With `client_id`, it retries that request (same base id, new attempt)."""
        if client_id is None:
            self._serial += 1
            index = 1 if self._serial % 5 == 0 else 0  # some multi-prompt sub-requests
            n = self._serial - index
            client_id = f"cmpl-{n:05d}-{index}"
        blocks = num_blocks or self.rng.randint(1, self.settings.max_blocks)
        cached = 0
        if not probe and blocks > 1 and self.rng.random() < self.settings.prefix_hit:
            cached = self.rng.randint(1, blocks - 1)
        record = self.ledger.add(client_id, blocks, cached=cached, probe=probe)
        spread = 0.0 if probe else self.settings.leg_spread_s
        now = self.clock.now
        # Pull: the proxy sends the decode leg once P answered (`relay_decode_leg`).
        for engine in self.engines if self.mode == "push" else (self.prefill,):
            if engine.alive:
                at = now + self.rng.random() * spread
                engine.arrivals.append(Arrival(record.key, client_id, blocks, cached, at))
                engine.dirty = True
            else:
                self.ledger.lost(record.key, engine.role)
                if self.mode == "pull":
                    self.ledger.lost(record.key, "decode")  # no answer to relay
        self.note(f"issue {record.key} blocks={blocks} cached={cached}")
        return record.key

    def relay_decode_leg(self, arrival: Arrival, params: dict[str, object] | None) -> None:
        """Pull mode: P answered the prefill leg; the proxy sends the decode leg with P's
        params (its coordinates, request id and blocks) to D, arriving a little later."""
        decode = self.decode
        if params is None or not decode.alive:
            self.ledger.lost(arrival.key, "decode")
            return
        at = self.clock.now + self.rng.random() * self.settings.leg_spread_s
        leg = Arrival(
            arrival.key,
            arrival.client_id,
            arrival.num_blocks,
            arrival.cached,
            at,
            {"do_remote_prefill": True, **params},
        )
        decode.arrivals.append(leg)
        decode.dirty = True

    def failed(self, key: str) -> None:
        """D failed an attempt cleanly: the proxy may retry it under the same id, once no
        registration of the failed attempt can still be held anywhere."""
        record = self.ledger.clients[key]
        if record.probe or record.attempt or not self.issuing:
            return
        if self.rng.random() < self.settings.retry:
            when = self.clock.now + self.settings.retry_delay_s
            self.retries.append((when, record.client_id, record.num_blocks))

    def _retry(self) -> None:
        self.retries.sort()
        _when, client_id, blocks = self.retries.pop(0)
        self.note(f"retry {client_id}")
        self.issue(blocks, client_id=client_id)

    def step(self, role: str) -> None:
        self.note(f"{role} step")
        self.engine(role).step()

    def writer_pass(self, role: str, rank: int = 0) -> None:
        self.note(f"{role}{rank} writer pass")
        self.engine(role).writer_pass(rank)

    def run_job(self, role: str, index: int | None = None, *, fail: bool = False) -> None:
        engine = self.engine(role)
        if fail:
            self.network.fail_next_handshakes += 1
        self.note(f"{role} handshake job{' (fails)' if fail else ''}")
        engine.run_job(index)
        self.network.fail_next_handshakes = 0
        engine.dirty = True

    def deliver(self, index: int | None = None) -> None:
        msg = self.network.deliver_next() if index is None else self.network.deliver(index)
        if msg is None:
            return
        self.note(f"deliver {msg.describe()}")
        for engine in self.engines:
            if engine.alive and {msg.src_agent, msg.dst_agent} & engine.agents():
                engine.dirty = True

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.ledger.now = self.clock.now
        self.note(f"advance {seconds:.4f}")

    def advance_to(self, when: float) -> None:
        """Move the clock to `when` exactly (at least a little forward)."""
        now = self.clock.now
        self.clock.jump_to(when if when > now else now + 1e-4)
        self.ledger.now = self.clock.now
        self.note(f"advance to {self.clock.now:.4f}")

    def crash(self, role: str, downtime: float = 5.0) -> None:
        engine = self.engine(role)
        if engine.alive:
            self.note(f"CRASH {role}")
            engine.crash()
            self.restart_at[role] = self.clock.now + downtime

    def restart(self, role: str) -> None:
        engine = self.engine(role)
        self.restart_at.pop(role, None)
        if not engine.alive:
            self.note(f"RESTART {role}")
            engine.boot()

    def partition(self, duration: float = 10.0) -> None:
        self.note("PARTITION")
        self.network.partition(self.prefill.engine_id, self.decode.engine_id)
        self.heal_at = self.clock.now + duration

    def heal(self) -> None:
        self.note("HEAL")
        self.network.heal()
        self.heal_at = None

    def abort_one(self) -> None:
        decode = self.decode
        bus = decode.side.scheduler.bus
        live = [rid for rid in decode.requests if bus.has_tag(D_REQUEST, rid, "abortable")]
        if decode.alive and live:
            victim = self.rng.choice(sorted(live))
            self.note(f"abort {victim}")
            decode.abort(victim)

    def clock_jump(self, seconds: float) -> None:
        self.advance(seconds)

    def protocol_fault(self) -> bool:
        """A hostile process: foreign names always, real names only with a cluster key
        (without one a spoofed name is, by design, the peer it names: the threat model)."""
        rng, faults = self.rng, self.faults
        if faults.foreign_notif and rng.random() < faults.foreign_notif:
            return self.rogue.strike(spoof=False)
        if self.keyed and faults.spoofed_notif and rng.random() < faults.spoofed_notif:
            return self.rogue.strike(spoof=True)
        return False

    # -- what the seeded scheduler asks (SeededWorld) ---------------------------------------

    def due_actions(self, choices: Choices, now: float) -> None:
        rng = self.rng
        idle_steps: Choices = []
        for engine in self.engines:
            role = engine.role
            if engine.busy():
                choices.append((3.0, lambda r=role: self.step(r)))  # type: ignore[misc]
            elif engine.has_work():  # an engine steps while work is pending, idle or not
                idle_steps.append((0.2, lambda r=role: self.step(r)))  # type: ignore[misc]
            for rank in range(len(engine.transports)):
                if engine.writer_due(rank):
                    choices.append(
                        (3.0, lambda r=role, k=rank: self.writer_pass(r, k))  # type: ignore[misc]
                    )
            if engine.alive and engine.executor.ready():
                choices.append((2.0, lambda r=role: self.run_job(r)))  # type: ignore[misc]
        if self.network.deliverable():
            choices.append((5.0, self.deliver))
        if self.issuing and self.retries and min(self.retries)[0] <= now:
            choices.append((2.0, self._retry))
        if choices:  # something is due now: time moves in small steps meanwhile
            choices.append((0.5, lambda: self.advance(rng.expovariate(200.0))))
        else:  # nothing is due: jump to the next thing that will be
            choices.append((1.0, self.jump))
        choices += idle_steps

    def event_times(self) -> list[float]:
        times = [e for e in (engine.next_event() for engine in self.engines) if e is not None]
        arrival = self.network.next_arrival()
        if arrival is not None:
            times.append(arrival)
        if self.issuing and self.retries:
            times.append(min(self.retries)[0])
        return times

    def all_resolved(self) -> bool:
        return not self.retries and super().all_resolved()

    def use_faults(self, faults: SimFaults) -> None:
        self.faults = self.network.faults = faults

    def inject_crash(self, role: str) -> bool:
        return self.engine(role).alive and super().inject_crash(role)

    def probe_client(self, attempt: int) -> ClientRecord:
        return self.ledger.clients[self.issue(probe=True)]

    # -- the end of a run ----------------------------------------------------------------------

    def quiesce(self, limit: int = 400) -> None:
        """Run every action that is due now until none is (bounded)."""
        for _ in range(limit):
            progressed = False
            while self.issuing and self.retries and min(self.retries)[0] <= self.clock.now:
                self._retry()  # the proxy's retry is due (it counts as a next event)
                progressed = True
            while self.network.deliverable():
                self.deliver()
                progressed = True
            for engine in self.engines:
                while engine.alive and engine.executor.ready():
                    self.run_job(engine.role)
                    progressed = True
                if engine.busy():
                    self.step(engine.role)
                    progressed = True
                for rank in range(len(engine.transports)):
                    if engine.writer_due(rank):
                        self.writer_pass(engine.role, rank)
                        progressed = True
            if not progressed:
                return

    def settle(self) -> None:
        """Faults off, heal, restart, every deadline past; then quarantines end."""
        self.retries.clear()
        super().settle()
        for engine in self.engines:
            engine.pool.expire_quarantine(float("inf"))


class SimulatedPullWorld(SimulatedPushWorld):
    """The same world in pull mode (B-09): P answers each prefill leg with its params, the
    proxy relays them on the decode leg, each D rank READs what it lacks from the P ranks
    holding its heads, and each P rank frees its lease on the completion notifs of the D
    ranks reading from it (or at expiry). Pull reads from one pipeline stage: a seed draws
    its topology among those without PP. The fabric reports every READ posted and landed
    to the same ledger (`RunChecks.read_posted`, `read_landed`)."""

    protocol: ClassVar[str] = "pull"
    mode: ClassVar[Mode] = "pull"

    def topologies(self, settings: SimSettings) -> tuple[Topology, ...]:
        return tuple(t for t in settings.topologies if t.p_pp == 1)
