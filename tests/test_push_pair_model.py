"""A whole P/D pair over the simulated fabric, driven by Hypothesis (issue 3).

The rules are the actors of `SimulatedPushWorld`: the proxy sending a client request's
two legs (either side may see it first), engine steps, writer passes, handshake jobs
that run late, fail or never run, message deliveries in any order, lost and duplicated
notifs, WRITEs that fail to post or end in error, clock steps and jumps (heartbeats go
out as D steps), request aborts, and engine crashes and restarts.

After every step the world's invariants hold (the fabric checks each WRITE as it is
posted and as it lands): no WRITE before both the registration and the blocks exist, a
WRITE targets only blocks D registered for that request and reads only blocks P still
leases, finished_sending at most once, received bytes equal P's pattern. At teardown the
world settles past every deadline with faults off and demands: every P lease freed
exactly once, every D registration ended received, failed, expired or aborted, every
writer table, inbox and bus empty of request lifecycles, and a fresh request completes.
"""

from __future__ import annotations

import logging

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvhandoff.sim.push.settings import SimSettings
from kvhandoff.sim.push.world import SimulatedPushWorld

ROLES = st.sampled_from(["prefill", "decode"])
MAX_REQUESTS = 6
CLOCK_STEPS = st.sampled_from([0.0005, 0.002, 0.05, 0.3, 1.0, 2.5])
CLOCK_JUMPS = st.sampled_from([5.0, 12.0, 35.0, 70.0])  # heartbeats, then past timeouts
RARE = st.integers(0, 5)  # destructive rules act on 0 only, so most runs get somewhere


class PushPairModel(RuleBasedStateMachine):
    world: SimulatedPushWorld

    @initialize(seed=st.integers(0, 2**16))
    def start(self, seed: int) -> None:
        # The seed only draws request suffixes and block choices; Hypothesis orders events.
        # The seed also draws the topology (TP/PP of each side) and the cluster key.
        self.world = SimulatedPushWorld(seed, settings=SimSettings(leg_spread_s=0.0))

    def _alive(self, role: str) -> bool:
        return self.world.engine(role).alive

    def _pick(self, data: st.DataObject, size: int, label: str) -> int:
        return data.draw(st.integers(0, size - 1), label=label)

    # -- the proxy and the engines ----------------------------------------------------------

    @precondition(lambda self: self.world._serial < MAX_REQUESTS)
    @rule(blocks=st.integers(1, 4), first=st.sampled_from(["prefill", "decode", None]))
    def client_request(self, blocks: int, first: str | None) -> None:
        """Both legs are sent; one side may admit its leg before the other steps."""
        self.world.issue(blocks)
        if first is not None and self._alive(first):
            self.world.step(first)

    @rule(role=ROLES)
    def engine_step(self, role: str) -> None:
        if self._alive(role):
            self.world.step(role)

    @rule(role=ROLES, data=st.data())
    def writer_pass(self, role: str, data: st.DataObject) -> None:
        """One pass of any rank's writer thread."""
        if self._alive(role):
            ranks = len(self.world.engine(role).transports)
            self.world.writer_pass(role, self._pick(data, ranks, "rank"))

    @rule(seconds=st.sampled_from([0.0, 0.01, 0.2]))
    def run_a_while(self, seconds: float) -> None:
        """Every actor runs what falls due, no faults, for a little while (a big step)."""
        self.world.run_for(seconds)

    @rule(role=ROLES, data=st.data(), fail=st.booleans())
    def handshake_job(self, role: str, data: st.DataObject, fail: bool) -> None:
        """A queued handshake runs now (any of them, in any order), or fails."""
        engine = self.world.engine(role)
        if engine.alive and engine.executor.jobs:
            index = self._pick(data, len(engine.executor.jobs), "job")
            self.world.run_job(role, index, fail=fail)

    # -- the wire ------------------------------------------------------------------------------

    @precondition(lambda self: self.world.network.in_flight)
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        """Any message in flight arrives next: reordering and late arrival included."""
        self.world.deliver(self._pick(data, len(self.world.network.in_flight), "message"))

    @precondition(lambda self: self.world.network.in_flight)
    @rule(data=st.data())
    def lose(self, data: st.DataObject) -> None:
        """A notif is lost, or a WRITE's data never arrives (the WRITE ends in ERR)."""
        self.world.network.drop(self._pick(data, len(self.world.network.in_flight), "lost"))

    @precondition(lambda self: self.world.network.in_flight)
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        self.world.network.duplicate(self._pick(data, len(self.world.network.in_flight), "dup"))

    @rule()
    def next_write_fails_to_post(self) -> None:
        self.world.network.fail_next_write_posts = 1

    @precondition(lambda self: any(m.transfer for m in self.world.network.in_flight))
    @rule(data=st.data())
    def write_errors(self, data: st.DataObject) -> None:
        writes = [m for m in self.world.network.in_flight if m.transfer is not None]
        message = writes[self._pick(data, len(writes), "write")]
        assert message.transfer is not None
        message.transfer.fail_on_delivery = True

    # -- time, aborts, crashes ---------------------------------------------------------------

    @rule(seconds=CLOCK_STEPS)
    def clock(self, seconds: float) -> None:
        self.world.advance(seconds)

    @rule(seconds=CLOCK_JUMPS, rare=RARE)
    def clock_jump(self, seconds: float, rare: int) -> None:
        if rare == 0:
            self.world.advance(seconds)

    @rule(rare=RARE)
    def abort(self, rare: int) -> None:
        if rare == 0 and self._alive("decode"):
            self.world.abort_one()

    @precondition(lambda self: self.world.prefill.alive and self.world.decode.alive)
    @rule(role=ROLES, rare=RARE)
    def crash(self, role: str, rare: int) -> None:
        if rare == 0:
            self.world.crash(role)

    @precondition(lambda self: not (self.world.prefill.alive and self.world.decode.alive))
    @rule()
    def restart(self) -> None:
        for role in ("prefill", "decode"):
            self.world.restart(role)

    # -- the invariants ---------------------------------------------------------------------

    @invariant()
    def nothing_violated(self) -> None:
        if hasattr(self, "world"):
            assert self.world.ledger.violations == [], self.world.ledger.violations

    def teardown(self) -> None:
        if not hasattr(self, "world"):
            return
        world = self.world
        world.settle()
        world.probe()
        world.settle()
        result = world.final_check()
        assert result.ok, (result.violations, result.leftovers)
        for record in world.ledger.clients.values():
            assert record.p in ("freed", "lost"), record
            assert record.finished_sending == (1 if record.p == "freed" else 0), record
            assert record.d in ("received", "failed", "expired", "aborted", "lost"), record
        for engine in world.engines:
            assert not engine.side.scheduler.has_pending_push_work()


def test_R_P04_R_P05_R_P12_B06_B08_pair_model_over_the_simulated_fabric() -> None:
    logging.getLogger("kvhandoff").setLevel(logging.CRITICAL)
    try:
        run_state_machine_as_test(
            PushPairModel,
            settings=settings(
                max_examples=300,
                stateful_step_count=60,
                deadline=None,
                database=None,
                derandomize=True,
            ),
        )
    finally:
        logging.getLogger("kvhandoff").setLevel(logging.NOTSET)
