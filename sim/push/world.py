"""A whole P/D pair over the in-memory fabric, under one seeded scheduler (simulation only).

`SimulatedPushWorld` holds two `SimEngine`s (prefill and decode, each a `PushSide` with
its writer and handshake executor as actors), one `SimNetwork` and one `VirtualClock`.
Nothing runs on its own: every ordering decision (which engine steps, which writer
passes, which message is delivered, which handshake job runs, when the clock moves, and
which fault strikes) is made by the world's seeded `random.Random`, so a run replays
exactly from its seed.

The same actions are public (`issue`, `step`, `writer_pass`, `deliver`, `run_job`,
`advance`, `crash`, ...) so a Hypothesis state machine can choose them instead.

A run ends with `settle`: faults off, partitions healed, crashed engines restarted, the
clock driven past every deadline; then `probe` sends fresh requests until one completes
(a peer that came back is re-handshaked, B-08), and `final_check` demands that every
lease was freed exactly once, every registration ended, and every table is empty.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable

from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.protocol.handshake import compatibility_hash
from kvhandoff.sim.push.checks import RunChecks
from kvhandoff.sim.push.engine import Arrival, SimEngine
from kvhandoff.sim.push.fabric import SimFaults, SimNetwork
from kvhandoff.sim.push.ledger import SimLedger
from kvhandoff.sim.push.settings import (
    MEMBERS,
    SIM_PUSH_CONFIG,
    SimRunResult,
    SimSettings,
    Variant,
)

__all__ = [
    "MEMBERS",
    "SIM_PUSH_CONFIG",
    "SimRunResult",
    "SimSettings",
    "SimulatedPushWorld",
    "Variant",
]


class SimulatedPushWorld(RunChecks):
    """P and D over one fabric and one clock; the checks come from `RunChecks`."""

    def __init__(
        self,
        seed: int,
        *,
        faults: SimFaults | None = None,
        settings: SimSettings | None = None,
        variant: Variant | None = None,
        record: bool = False,
        log_limit: int | None = 4000,
    ) -> None:
        self.seed = seed
        self.settings = settings or SimSettings()
        self.rng = random.Random(seed)
        self.clock = VirtualClock(1000.0)
        self.faults = faults or SimFaults.none()
        self.network = SimNetwork(random.Random(self.rng.getrandbits(64)), self.clock, self.faults)
        self.network.observer = self
        self.ledger = SimLedger()
        self.compatibility_hash = compatibility_hash(
            "kvhandoff-sim", "sim-model", "uint8", self.settings.block_len
        )
        self.recording = record
        self.log: deque[str] = deque(maxlen=log_limit)
        self.variant = variant
        self.actions = 0
        self._serial = 0
        self.prefill = SimEngine(self, "prefill", "prefill-0", "10.0.0.1", 5600, MEMBERS)
        # D lists its regions in another order: routing must go by member (R-P14).
        self.decode = SimEngine(self, "decode", "decode-0", "10.0.0.2", 5700, MEMBERS[::-1])
        self.engines = (self.prefill, self.decode)
        self.heal_at: float | None = None
        self.next_issue_at = self.clock.now
        self.issuing = True  # the seeded scheduler still has client requests to send

    # -- recording ----------------------------------------------------------------------

    def sink(self, source: str) -> Callable[[str], None]:
        log = self.log
        return lambda line: log.append(f"{source} {line}")

    def note(self, message: str) -> None:
        if self.recording:
            self.log.append(f"t={self.clock.now:.4f} {message}")

    def apply_variant(self, engine: SimEngine) -> None:
        if self.variant is not None:
            self.variant(engine)

    def engine(self, role: str) -> SimEngine:
        return self.prefill if role == "prefill" else self.decode

    # -- actions -------------------------------------------------------------------------

    def issue(self, num_blocks: int | None = None, *, probe: bool = False) -> str:
        """The proxy sends one client request's two legs (R-P01); they may arrive apart."""
        self._serial += 1
        index = 1 if self._serial % 5 == 0 else 0  # some multi-prompt sub-requests
        n = self._serial - index
        client_id = f"cmpl-{n:05d}-{index}"
        blocks = num_blocks or self.rng.randint(1, self.settings.max_blocks)
        self.ledger.add(client_id, blocks, probe=probe)
        spread = 0.0 if probe else self.settings.leg_spread_s
        now = self.clock.now
        for engine in self.engines:
            if engine.alive:
                engine.arrivals.append(Arrival(client_id, blocks, now + self.rng.random() * spread))
                engine.dirty = True
            else:
                self.ledger.lost(client_id, engine.role)
        self.note(f"issue {client_id} blocks={blocks}")
        return client_id

    def step(self, role: str) -> None:
        self.note(f"{role} step")
        self.engine(role).step()

    def writer_pass(self, role: str) -> None:
        self.note(f"{role} writer pass")
        self.engine(role).writer_pass()

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
            if engine.alive and engine.transport.agent_name in (msg.src_agent, msg.dst_agent):
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
            engine.crash(downtime)

    def restart(self, role: str) -> None:
        engine = self.engine(role)
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
        live = [rid for rid in decode.requests if decode.side.bus.get(D_REGISTRATION, rid)]
        if decode.alive and live:
            victim = self.rng.choice(sorted(live))
            self.note(f"abort {victim}")
            decode.abort(victim)

    # -- the seeded scheduler ---------------------------------------------------------------

    def run(self) -> SimRunResult:
        """One whole seeded run: requests under faults, then settle, probe and check."""
        while self.actions < self.settings.max_actions:
            if self._serial >= self.settings.requests and not self.ledger.unresolved():
                break
            self.random_action()
        self.settle()
        self.probe()
        self.settle()
        return self.final_check()

    def random_action(self) -> None:
        self.actions += 1
        rng, faults, now = self.rng, self.faults, self.clock.now
        if self._maybe_fault(rng, faults, now):
            return
        choices: list[tuple[float, Callable[[], None]]] = []
        idle_steps: list[tuple[float, Callable[[], None]]] = []
        if self._serial < self.settings.requests and now >= self.next_issue_at:
            choices.append((2.0, self._arrive))
        for engine in self.engines:
            role = engine.role
            if engine.busy():
                choices.append((3.0, lambda r=role: self.step(r)))  # type: ignore[misc]
            elif engine.has_work():  # an engine steps while work is pending, idle or not
                idle_steps.append((0.2, lambda r=role: self.step(r)))  # type: ignore[misc]
            if engine.writer_due():
                choices.append((3.0, lambda r=role: self.writer_pass(r)))  # type: ignore[misc]
            if engine.alive and engine.executor.ready():
                choices.append((2.0, lambda r=role: self.run_job(r)))  # type: ignore[misc]
        if self.network.deliverable():
            choices.append((5.0, self.deliver))
        if choices:  # something is due now: time moves in small steps meanwhile
            choices.append((0.5, lambda: self.advance(rng.expovariate(200.0))))
        else:  # nothing is due: jump to the next thing that will be
            choices.append((1.0, self._jump))
        choices += idle_steps
        total = sum(w for w, _ in choices)
        pick = rng.random() * total
        for weight, action in choices:
            pick -= weight
            if pick <= 0:
                action()
                return
        choices[-1][1]()

    def _maybe_fault(self, rng: random.Random, faults: SimFaults, now: float) -> bool:
        for engine in self.engines:
            if not engine.alive and engine.restart_at is not None and now >= engine.restart_at:
                self.restart(engine.role)
                return True
        if self.heal_at is not None and now >= self.heal_at:
            self.heal()
            return True
        if faults.crash and rng.random() < faults.crash:
            engine = rng.choice(self.engines)
            if engine.alive:
                self.crash(engine.role, rng.uniform(0.5, 20.0))
                return True
        if faults.partition and self.heal_at is None and rng.random() < faults.partition:
            self.partition(rng.uniform(1.0, 40.0))
            return True
        if faults.clock_jump and rng.random() < faults.clock_jump:
            self.advance(rng.uniform(1.0, 45.0))
            return True
        if faults.abort and rng.random() < faults.abort:
            self.abort_one()
            return True
        return False

    def _arrive(self) -> None:
        self.issue()
        self.next_issue_at = self.clock.now + self.rng.expovariate(
            1.0 / self.settings.mean_interarrival_s
        )

    def next_event(self, *, scheduled: bool = False) -> float | None:
        """The earliest time something happens by itself; with `scheduled`, also what only
        the seeded scheduler does (the next client request, restarting a crashed engine)."""
        times = [e for e in (engine.next_event() for engine in self.engines) if e is not None]
        if scheduled:
            times += [e.restart_at for e in self.engines if not e.alive and e.restart_at]
            if self.issuing and self._serial < self.settings.requests:
                times.append(self.next_issue_at)
        arrival = self.network.next_arrival()
        if arrival is not None:
            times.append(arrival)
        if self.heal_at is not None:
            times.append(self.heal_at)
        return min(times) if times else None

    def _jump(self) -> None:
        when = self.next_event(scheduled=True)
        self.advance_to(self.clock.now + 1.0 if when is None else when)

    # -- the end of a run ----------------------------------------------------------------------

    def quiesce(self, limit: int = 400) -> None:
        """Run every action that is due now until none is (bounded)."""
        for _ in range(limit):
            progressed = False
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
                if engine.writer_due():
                    self.writer_pass(engine.role)
                    progressed = True
            if not progressed:
                return

    def run_for(self, seconds: float) -> None:
        """Let every actor run what falls due, the clock moving event to event, for a while."""
        end = self.clock.now + seconds
        while True:
            self.quiesce()
            when = self.next_event()
            if when is None or when > end:
                return
            self.advance_to(when)

    def settle(self) -> None:
        """Faults off, heal, restart; then drive the clock past every deadline."""
        self.issuing = False
        self.faults = SimFaults.none()
        self.network.faults = self.faults
        if self.heal_at is not None:
            self.heal()
        for engine in self.engines:
            if not engine.alive:
                self.restart(engine.role)
        self.run_for(self.settings.settle_span_s)
        for engine in self.engines:
            engine.pool.expire_quarantine(float("inf"))

    def probe(self) -> None:
        """Fresh requests, one at a time, every fault off: one of them must complete.

        The first may fail cleanly on a connection that died with a crashed peer (that
        failure is what makes the side forget the dead agent); the next must re-handshake
        and succeed (B-08).
        """
        last = None
        for _ in range(self.settings.probes):
            last = self.issue(probe=True)
            deadline = self.clock.now + self.settings.settle_span_s
            while not self.ledger.clients[last].resolved and self.clock.now < deadline:
                self.quiesce()
                if not self.ledger.clients[last].resolved:
                    self._jump()
            if self.ledger.clients[last].completed:
                return
        if last is not None:
            record = self.ledger.clients[last]
            self.ledger.violation(
                f"no recovery: probe {last} ended P={record.p} D={record.d} with every fault off"
            )
