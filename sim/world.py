"""The seeded world both protocols' simulators share (deterministic simulation only).

`SeededWorld` owns what a simulated run is made of whatever it simulates: one
`random.Random(seed)` that makes every ordering decision, one `VirtualClock`, the
`SimFaults` of the run, a bounded recording log, client requests arriving as a Poisson
process, and the seeded scheduler itself:

- `random_action` first rolls for a fault (`maybe_fault`: a restart or heal that is due,
  then a crash, a partition, a clock jump, the protocol's own faults, an abort), else
  picks one of the actions that are due now, weighted (`due_actions`);
- `jump` moves the clock to the next thing that happens by itself (`next_event`);
- `run` takes random actions until every request is resolved (or `max_actions`), then
  `settle` (faults off, heal, restart, the clock driven past every deadline), `probe`
  (fresh requests with every fault off: one must succeed) and `final_check`, which
  counts what is left after all deadlines as leaked or hung.

A protocol's world (`SimulatedPushWorld`, `SimulatedECWorld`) derives from it and fills
in the hooks: its engines, what is due and how likely, its faults, how its clock moves,
what must be empty at the end. The draws from the generator happen in the order the
hooks are called, so a seed replays exactly.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from typing import ClassVar, Generic

from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.sim.contracts import Choices, ClientT, SettingsT, VariantT
from kvhandoff.sim.faults import SimFaults
from kvhandoff.sim.result import SimRunResult
from kvhandoff.sim.trace import sim_trace

__all__ = ["SeededWorld"]

START = 1000.0  # the virtual clock's reading when a run begins


class SeededWorld(ABC, Generic[SettingsT, ClientT, VariantT]):
    """A seeded scheduler over a protocol's actors; see the module docstring."""

    protocol: ClassVar[str]  # the name `kvhandoff simulate` knows the protocol by
    roles: ClassVar[tuple[str, ...]]  # the processes a crash picks from, in its order
    restart_order: ClassVar[tuple[str, ...]]  # which of two due restarts comes first
    hang_tables: ClassVar[frozenset[str]]  # leftovers that are hung requests, not leaks
    crash_rate: ClassVar[float] = 1.0  # scales `SimFaults.crash`
    partition_rate: ClassVar[float] = 1.0  # scales `SimFaults.partition`
    partition_s: ClassVar[tuple[float, float]] = (1.0, 40.0)
    crash_downtime_s: ClassVar[tuple[float, float]] = (0.5, 20.0)
    clock_jump_s: ClassVar[tuple[float, float]] = (1.0, 45.0)
    stop_at_violation: ClassVar[bool] = False  # end a run at its first broken rule

    def __init__(
        self,
        seed: int,
        *,
        settings: SettingsT | None = None,
        variant: VariantT | None = None,
        faults: SimFaults | None = None,
        record: bool = False,
        log_limit: int | None = 4000,
    ) -> None:
        self.seed = seed
        self.settings = settings if settings is not None else self.default_settings()
        self.variant = variant
        self.rng = random.Random(seed)
        self.clock = VirtualClock(START)
        self.faults = faults or SimFaults.none()
        self.trace = sim_trace(self.protocol, seed, self.clock)  # KVHANDOFF_TRACE: a directory
        self.recording = record or self.trace is not None
        self.log: deque[str] = deque(maxlen=log_limit)
        self.violations: list[str] = []
        self.actions = 0
        self._serial = 0  # client requests issued so far
        self.next_issue_at = self.clock.now
        self.issuing = True  # the seeded scheduler still has client requests to send
        self.heal_at: float | None = None  # when the partition in force ends
        self.restart_at: dict[str, float] = {}  # crashed processes: when each comes back

    # -- recording ----------------------------------------------------------------------

    def note(self, message: str) -> None:
        if self.recording:
            self.log.append(f"t={self.clock.now:.4f} {message}")

    def sink(self, source: str) -> Callable[[str], None]:
        """A bus recording sink that writes into this world's log."""
        log = self.log
        if self.trace is not None:
            return self.trace.sink(source, log)
        return lambda line: log.append(f"{source} {line}")

    def violation(self, message: str) -> None:
        self.violations.append(f"t={self.clock.now:.4f} {message}")

    def halted(self) -> bool:
        return self.stop_at_violation and bool(self.violations)

    # -- the seeded scheduler -----------------------------------------------------------

    def run(self) -> SimRunResult:
        """One whole seeded run: requests under faults, then settle, probe and check."""
        try:
            return self._run()
        finally:
            if self.trace is not None:
                self.trace.close()

    def _run(self) -> SimRunResult:
        settings = self.settings
        stop, violations = self.stop_at_violation, self.violations  # looked up once: hot
        while self.actions < settings.max_actions and not (stop and violations):
            if self._serial >= settings.requests and self.all_resolved():
                break
            self.random_action()
            self.check_invariants()
        if self.halted():  # stop at the first broken rule: its log stays short
            return self.final_check(settled=False)
        self.settle()
        self.probe()
        self.settle()
        return self.final_check()

    def random_action(self) -> None:
        self.actions += 1
        if self.maybe_fault():
            return
        now = self.clock.now
        choices: Choices = []
        if self.issuing and self._serial < self.settings.requests and now >= self.next_issue_at:
            choices.append((2.0, self._arrive))
        self.due_actions(choices, now)
        total = sum(w for w, _ in choices)
        pick = self.rng.random() * total
        for weight, action in choices:
            pick -= weight
            if pick <= 0:
                action()
                return
        choices[-1][1]()

    def _arrive(self) -> None:
        self.issue()
        self.next_issue_at = self.clock.now + self.rng.expovariate(
            1.0 / self.settings.mean_interarrival_s
        )

    def maybe_fault(self) -> bool:
        """Strike one fault (or carry out a due restart or heal); True when something did."""
        now = self.clock.now
        if self.restart_at:
            for role in self.restart_order:
                when = self.restart_at.get(role)
                if when is not None and now >= when:
                    self.restart(role)
                    return True
        if self.heal_at is not None and now >= self.heal_at:
            self.heal()
            return True
        rng, faults = self.rng, self.faults
        if (
            faults.crash
            and rng.random() < faults.crash * self.crash_rate
            and self.inject_crash(rng.choice(self.roles))
        ):
            return True
        if (
            faults.partition
            and self.heal_at is None
            and rng.random() < faults.partition * self.partition_rate
        ):
            self.partition(rng.uniform(*self.partition_s))
            return True
        if faults.clock_jump and rng.random() < faults.clock_jump:
            self.clock_jump(rng.uniform(*self.clock_jump_s))
            return True
        if self.protocol_fault():
            return True
        if faults.abort and rng.random() < faults.abort:
            self.abort_one()
            return True
        return False

    def inject_crash(self, role: str) -> bool:
        """Crash `role` for a drawn downtime; False when that struck nothing."""
        self.crash(role, self.rng.uniform(*self.crash_downtime_s))
        return True

    def next_event(self, *, scheduled: bool = False) -> float | None:
        """The earliest time something happens by itself; with `scheduled`, also what only
        the seeded scheduler does (the next client request, restarting a crashed process)."""
        times = self.event_times()
        if scheduled:
            times += self.restart_at.values()
            if self.issuing and self._serial < self.settings.requests:
                times.append(self.next_issue_at)
        if self.heal_at is not None:
            times.append(self.heal_at)
        return min(times, default=None)

    def jump(self) -> None:
        """Jump the clock to the next thing that happens by itself."""
        when = self.next_event(scheduled=True)
        self.advance_to(self.clock.now + 1.0 if when is None else when)

    # -- the end of a run -----------------------------------------------------------------

    def run_for(self, seconds: float) -> None:
        """Let every actor run what falls due, the clock moving event to event, for a while."""
        end = self.clock.now + seconds
        while not self.halted():
            self.quiesce()
            self.check_invariants()
            when = self.next_event()
            if when is None or when > end:
                return
            self.advance_to(when)

    def settle(self) -> None:
        """Faults off, heal, restart; then drive the clock past every deadline."""
        self.issuing = False
        self.use_faults(SimFaults.none())
        if self.heal_at is not None:
            self.heal()
        for role in self.restart_order:
            if role in self.restart_at:
                self.restart(role)
        self.run_for(self.settings.settle_span_s)

    def probe(self) -> None:
        """Fresh requests, one at a time, every fault off: one of them must recover.

        The first may fail cleanly on a connection that died with a crashed peer (that
        failure is what makes a side forget the dead one); a later one must succeed.
        """
        client: ClientT | None = None
        for attempt in range(self.settings.probes):
            client = self.probe_client(attempt)
            deadline = self.clock.now + self.settings.settle_span_s
            while not client.resolved and self.clock.now < deadline and not self.halted():
                self.quiesce()
                if not client.resolved:
                    self.jump()
            if self.recovered(client):
                return
        if client is not None:
            self.violation(
                f"no recovery: probe {client.client_id} ended {self.state_of(client)}"
                " with every fault off"
            )

    def final_check(self, *, settled: bool = True) -> SimRunResult:
        """Count what is left; after `settle`, anything left is a leak or a hang."""
        leftovers = self.leftovers()
        leaked = hung = completed = failed = requests = 0
        for role, tables in leftovers.items():
            for name, size in list(tables.items()):
                if not size or not settled:
                    del tables[name]
                    continue
                if name in self.hang_tables:
                    hung += size
                else:
                    leaked += size
                self.violation(f"{role} {name} holds {size} entries after all deadlines")
        for client in self.clients_seen():
            if not client.probe:
                requests += 1
            leaked += self.leaked_by(client)
            if not client.resolved:
                if settled:
                    hung += 1
                    self.violation(f"{client.client_id} unresolved: {self.state_of(client)}")
            elif not client.probe:
                if client.completed:
                    completed += 1
                else:
                    failed += 1
        return SimRunResult(
            protocol=self.protocol,
            seed=self.seed,
            requests=requests,
            completed=completed,
            failed_cleanly=failed,
            leaked=leaked,
            hung=hung,
            violations=list(self.violations),
            actions=self.actions,
            sim_seconds=self.clock.now - START,
            leftovers={role: tables for role, tables in leftovers.items() if tables},
            counters=self.counters(),
        )

    # -- hooks: what a protocol's world fills in ------------------------------------------

    @abstractmethod
    def default_settings(self) -> SettingsT: ...

    @abstractmethod
    def issue(self, *, probe: bool = False) -> object:
        """Send one client request."""

    @abstractmethod
    def due_actions(self, choices: Choices, now: float) -> None:
        """Add the actions due at `now` (and a way for time to move) to `choices`."""

    @abstractmethod
    def event_times(self) -> list[float]:
        """When the protocol's actors will next do something by themselves."""

    @abstractmethod
    def advance_to(self, when: float) -> None:
        """Move the clock to `when` (at least a little forward)."""

    # The faults `maybe_fault` strikes: `crash` sets `restart_at`, `restart` clears it;
    # `partition` sets `heal_at`, `heal` clears it.

    @abstractmethod
    def crash(self, role: str, downtime: float) -> None: ...

    @abstractmethod
    def restart(self, role: str) -> None: ...

    @abstractmethod
    def partition(self, duration: float) -> None: ...

    @abstractmethod
    def heal(self) -> None: ...

    @abstractmethod
    def clock_jump(self, seconds: float) -> None: ...

    @abstractmethod
    def abort_one(self) -> None:
        """A client goes away: one of its waiting requests is aborted."""

    def protocol_fault(self) -> bool:
        """Roll for the protocol's own faults; True when one struck."""
        return False

    def use_faults(self, faults: SimFaults) -> None:
        self.faults = faults

    def check_invariants(self) -> None:
        """Check the rules that hold after every action (nothing by default)."""

    @abstractmethod
    def quiesce(self) -> None:
        """Run every action that is due now until none is (bounded)."""

    @abstractmethod
    def probe_client(self, attempt: int) -> ClientT:
        """Issue the `attempt`th probe request."""

    def recovered(self, client: ClientT) -> bool:
        """Whether a resolved probe shows the pair recovered."""
        return client.completed

    @abstractmethod
    def state_of(self, client: ClientT) -> str:
        """Where a client request stands, for a violation message."""

    @abstractmethod
    def clients_seen(self) -> Iterable[ClientT]:
        """Every client request of the run, probes included."""

    def all_resolved(self) -> bool:
        return all(client.resolved for client in self.clients_seen())

    def leaked_by(self, client: ClientT) -> int:
        """What a client request left behind that nothing will free (0 by default)."""
        return 0

    @abstractmethod
    def leftovers(self) -> dict[str, dict[str, int]]:
        """Per role, every table that must be empty after all deadlines, with its size."""

    @abstractmethod
    def counters(self) -> dict[str, int]:
        """What the run counted, for coverage reports."""
