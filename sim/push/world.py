"""A whole P/D pair over the in-memory fabric, under one seeded scheduler (simulation only).

`SimulatedPushWorld` holds two `SimEngine`s (prefill and decode, each a `PushSide` with
its writer and handshake executor as actors), one `SimNetwork` and one `VirtualClock`.
Nothing runs on its own: every ordering decision (which engine steps, which writer
passes, which message is delivered, which handshake job runs, when the clock moves, and
which fault strikes) is made by the world's seeded `random.Random`, so a run replays
exactly from its seed.

The same actions are public (`issue`, `step`, `writer_pass`, `deliver`, `run_job`,
`advance`, `crash`, ...) so a Hypothesis state machine can choose them instead.

The scheduler, the run and its end are `SeededWorld`'s (`kvhandoff.sim.world`); this
world says what is due and how likely (`due_actions`), how its faults strike, and what
must be empty at the end (`RunChecks`). A run ends with `settle`: faults off,
partitions healed, crashed engines restarted, the clock driven past every deadline;
then `probe` sends fresh requests until one completes (a peer that came back is
re-handshaked, B-08), and `final_check` demands that every lease was freed exactly once,
every registration ended, and every table is empty.
"""

from __future__ import annotations

import random
from typing import ClassVar, Unpack

from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.protocol.handshake import compatibility_hash
from kvhandoff.sim.contracts import Choices, WorldOptions
from kvhandoff.sim.faults import SimFaults
from kvhandoff.sim.push.checks import RunChecks
from kvhandoff.sim.push.engine import Arrival, SimEngine
from kvhandoff.sim.push.fabric import SimNetwork
from kvhandoff.sim.push.ledger import ClientRecord, SimLedger
from kvhandoff.sim.push.settings import MEMBERS, SimSettings, Variant
from kvhandoff.sim.world import SeededWorld

__all__ = ["SimulatedPushWorld"]


class SimulatedPushWorld(RunChecks, SeededWorld[SimSettings, ClientRecord, Variant]):
    """P and D over one fabric and one clock; the scheduler comes from `SeededWorld`,
    the checks from `RunChecks`."""

    protocol: ClassVar[str] = "push"
    roles: ClassVar[tuple[str, ...]] = ("prefill", "decode")
    restart_order: ClassVar[tuple[str, ...]] = roles

    def __init__(self, seed: int, **options: Unpack[WorldOptions[SimSettings, Variant]]) -> None:
        super().__init__(seed, **options)
        self.network = SimNetwork(random.Random(self.rng.getrandbits(64)), self.clock, self.faults)
        self.network.observer = self
        self.ledger = SimLedger()
        self.violations = self.ledger.violations  # the ledger records every broken rule
        self.compatibility_hash = compatibility_hash(
            "kvhandoff-sim", "sim-model", "uint8", self.settings.block_len
        )
        self.prefill = SimEngine(self, "prefill", "prefill-0", "10.0.0.1", 5600, MEMBERS)
        # D lists its regions in another order: routing must go by member (R-P14).
        self.decode = SimEngine(self, "decode", "decode-0", "10.0.0.2", 5700, MEMBERS[::-1])
        self.engines = (self.prefill, self.decode)

    def default_settings(self) -> SimSettings:
        return SimSettings()

    def violation(self, message: str) -> None:
        self.ledger.violation(message)

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
        live = [rid for rid in decode.requests if decode.side.bus.get(D_REGISTRATION, rid)]
        if decode.alive and live:
            victim = self.rng.choice(sorted(live))
            self.note(f"abort {victim}")
            decode.abort(victim)

    def clock_jump(self, seconds: float) -> None:
        self.advance(seconds)

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
            if engine.writer_due():
                choices.append((3.0, lambda r=role: self.writer_pass(r)))  # type: ignore[misc]
            if engine.alive and engine.executor.ready():
                choices.append((2.0, lambda r=role: self.run_job(r)))  # type: ignore[misc]
        if self.network.deliverable():
            choices.append((5.0, self.deliver))
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
        return times

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

    def settle(self) -> None:
        """Faults off, heal, restart, every deadline past; then quarantines end."""
        super().settle()
        for engine in self.engines:
            engine.pool.expire_quarantine(float("inf"))
