"""Model-based test of a producer/consumer pair over a simulated control plane (issue 4).

Hypothesis drives a real producer (`ec_producer`) and consumer (`ec_consumer`), both with
P2P, through the in-memory planes (`sim/ec/plane.py`): encodings are produced
and published, consumers ask for them (some with their media rewritten to metadata-only
references), and the planes misbehave: random NACKs and garbage acks, lost messages,
slow saves, slow, failing and hanging READs, evictions under pressure in small regions,
disconnects and producer restarts, long jumps of the virtual clock past every timeout.

After every step the invariants of the issue hold:

- no request waits past its deadlines (and no armed deadline is in the past);
- no pinned grant outlives its lease, and every pin is accounted for;
- the pool never hands one block to two entries (and READs land only in reserved blocks);
- a consumer falls back locally exactly when the seed says it must: on every NACK but
  NACK_NOT_READY (retried, unless the configured retry bound is spent), on ack or read
  timeout, on a failed READ, on a disconnect; a request fails exactly when such a
  fallback hits an encoding whose media was rewritten (B-05);
- evictions are FIFO among ready and unpinned entries.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ
from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.machines.ec.producer_grant import EC_PRODUCER_GRANT
from kvhandoff.machines.ec.publication_hold import EC_PUBLICATION_HOLD
from kvhandoff.machines.ec.request import EC_REQUEST, RequestCtx
from kvhandoff.machines.ec.settlement import EC_SETTLEMENT
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_config import (
    DEFAULT_CONSUMER_ACK_TIMEOUT_S,
    DEFAULT_NIXL_READ_TIMEOUT_S,
    DEFAULT_PIN_LEASE_S,
)
from kvhandoff.protocol.ec_status import NACKS, RETRYABLE_NACKS
from kvhandoff.sim.ec.plane import Engine
from kvhandoff.sim.ec.plane import SimECPlane as Sim

MAX_NOT_READY = 20
HASHES = [f"h{i}" for i in range(6)]
META = {"grid": [1, 2, 2]}
READ_FALLBACKS = {str(s) for s in NACKS - RETRYABLE_NACKS} | {
    "ack_timeout",
    "peer_disconnected",
    "read_failed",
}
QUARANTINE_REASONS = {"read_timeout", "peer_disconnected"}
# A read lives at most: one ack wait per attempt (a NACK_NOT_READY is re-sent on the step
# that receives it), then one READ timeout. Requests wait on reads only.
WAIT_BOUND = (MAX_NOT_READY + 1) * DEFAULT_CONSUMER_ACK_TIMEOUT_S + DEFAULT_NIXL_READ_TIMEOUT_S
EPS = 1e-6


class ECPairModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sim: Sim | None = None
        self.published: dict[str, dict[str, Any]] = {}
        self.pending: dict[str, tuple[ECRequestInfo, float | None]] = {}
        self.tokens: dict[str, int] = {}  # encoder tokens of each encoding produced
        self.created: dict[str, dict[str, int]] = {}
        self.serial = 0
        self.failed: dict[str, str] = {}
        self.problems: list[str] = []

    # -- set-up and observers --------------------------------------------------------------

    @initialize(
        seed=st.integers(0, 2**32 - 1),
        producer_blocks=st.integers(3, 10),
        consumer_blocks=st.integers(2, 8),
    )
    def setup(self, seed: int, producer_blocks: int, consumer_blocks: int) -> None:
        self.sim = Sim(
            seed,
            producer_blocks=producer_blocks,
            consumer_blocks=consumer_blocks,
            net_delay=(0.01, 0.3),
            copy_delay=(0.0, 2.0),
            read_delay=(0.01, 1.0),
            machine_config={"consumer_max_not_ready_retries": float(MAX_NOT_READY)},
            eviction_observer=self._evicting,
            on_engine=self._attach,
            ack_observer=self._acked,
        )

    def _attach(self, engine: Engine) -> None:
        order: dict[str, int] = {}
        self.created[engine.name] = order
        counter = iter(range(10**9))

        def sink(line: str) -> None:
            record = json.loads(line)
            if record["kind"] == EC_CACHE_ENTRY.name and record["event"] == "__create__":
                order[record["key"]] = next(counter)

        engine.scheduler.bus.record(sink)
        engine.scheduler.bus.on_retire(self._retired)

    def _evicting(self, engine: Engine, victim: str, _order: list[Any]) -> None:
        order = self.created[engine.name]
        ready = [inst.ctx.key for inst in engine.scheduler.cache.entries() if inst.has("evictable")]
        expected = min(ready, key=order.__getitem__)
        if victim != expected:
            self.problems.append(f"{engine.name} evicted {victim}, FIFO says {expected}")

    def _acked(self, status: str, read: Instance[Any], before: str, after: str) -> None:
        if before != "xfer_req_sent" or after == before:
            return  # stale or malformed: not delivered to the machine
        if status == "OK":
            expected = {"reading"}
        elif status == "NACK_NOT_READY":
            spent = read.ctx.not_ready >= MAX_NOT_READY
            expected = {"fallback_local"} if spent else {"retry_next_step"}
        else:
            expected = {"fallback_local"}
        if after not in expected:
            self.problems.append(f"ack {status} took {read.key} from {before} to {after}")

    def _retired(self, inst: Instance[Any]) -> None:
        if inst.machine.decl is not EC_CONSUMER_READ:
            return
        reason = inst.ctx.reason
        if inst.state == "fallback_local":
            allowed = READ_FALLBACKS | (
                {"NACK_NOT_READY"} if inst.ctx.not_ready >= MAX_NOT_READY else set()
            )
            if reason not in allowed:
                self.problems.append(f"read {inst.key} fell back for {reason!r}")
        elif inst.state == "released" and reason not in QUARANTINE_REASONS:
            self.problems.append(f"read {inst.key} quarantined for {reason!r}")

    # -- the engines' steps ----------------------------------------------------------------

    def step(self) -> None:
        sim = self.sim
        assert sim is not None
        sim.engine_step(sim.producer, [])
        scheduler, now = sim.consumer.scheduler, sim.clock.now
        for rid, (req, since) in list(self.pending.items()):
            if scheduler.ensure_cache_available(req, 0, now):
                for index, mm_hash in enumerate(req.mm_hashes):
                    if scheduler.has_cache_item(mm_hash):
                        scheduler.update_state_after_alloc(req, index, now)
                scheduler.request_finished(req, now)
                del self.pending[rid]
                continue
            inst = scheduler.bus.get(EC_REQUEST, rid)
            if inst is not None and inst.has("failed_cleanly"):
                self.failed[rid] = inst.ctx.failure
                self._check_failure(req, inst)
                scheduler.request_finished(req, now)
                del self.pending[rid]
            elif since is None:
                self.pending[rid] = (req, sim.clock.now)
        sim.engine_step(sim.consumer, [])

    def _check_failure(self, req: ECRequestInfo, inst: Instance[RequestCtx]) -> None:
        if not any(mm_hash in inst.ctx.failure for mm_hash in req.metadata_only) and (
            "malformed" not in inst.ctx.failure
        ):
            self.problems.append(f"{req.request_id} failed without a lost rewritten encoding")

    # -- rules -----------------------------------------------------------------------------

    @rule(mm_hash=st.sampled_from(HASHES), tokens=st.integers(1, 4))
    def produce(self, mm_hash: str, tokens: int) -> None:
        sim = self.sim
        assert sim is not None
        self.serial += 1
        req = ECRequestInfo(
            f"p{self.serial}", (mm_hash,), mm_metadata={mm_hash: META}, mm_tokens=(tokens,)
        )
        self.tokens[mm_hash] = tokens
        sim.engine_step(sim.producer, [(req, 0)])
        self.published.update(sim.producer.scheduler.request_finished(req, sim.clock.now))

    @precondition(lambda self: bool(self.published))
    @rule(data=st.data(), rewrite=st.booleans())
    def consume(self, data: st.DataObject, rewrite: bool) -> None:
        names = sorted(self.published)
        chosen = data.draw(st.lists(st.sampled_from(names), min_size=1, max_size=3, unique=True))
        self._consume(chosen, rewrite)

    @rule(mm_hash=st.sampled_from(HASHES), tokens=st.integers(1, 4), rewrite=st.booleans())
    def produce_and_consume_at_once(self, mm_hash: str, tokens: int, rewrite: bool) -> None:
        """The consumer asks before the producer's save landed: NACK_NOT_READY, retries."""
        self.produce(mm_hash, tokens)
        self._consume([mm_hash], rewrite)

    def _consume(self, chosen: list[str], rewrite: bool) -> None:
        params = {h: self.published[h] for h in chosen}
        servable = frozenset(h for h, entry in params.items() if entry["metadata"])
        self.serial += 1
        rid = f"c{self.serial}"
        req = ECRequestInfo(
            rid,
            tuple(chosen),
            ec_transfer_params=params,
            metadata_only=servable if rewrite else frozenset(),
            mm_tokens=tuple(self.tokens[h] for h in chosen),
        )
        self.pending[rid] = (req, None)
        self.step()

    @rule(seconds=st.floats(0.01, 3.0))
    def advance(self, seconds: float) -> None:
        assert self.sim is not None
        self.sim.advance(seconds, step=self.step)

    @rule(seconds=st.sampled_from([21.0, 31.0, 61.0, 85.0]))
    def advance_past_timeouts(self, seconds: float) -> None:
        assert self.sim is not None
        self.sim.advance(seconds, step=self.step)

    @rule(
        fault=st.sampled_from(
            [
                "NACK_MISSING",
                "NACK_INTERNAL",
                "NACK_INCOMPAT",
                "NACK_NOT_READY",
                "NACK_VERSION",
                "garbage",
                "hang",
                "fail",
                "slow",
                "drop",
                "disconnect",
                "restart",
            ]
        )
    )
    def misbehave(self, fault: str) -> None:
        """Arm one fault for the next ack or READ, or break the link or the producer now."""
        sim = self.sim
        assert sim is not None
        if fault in ("hang", "fail", "slow"):
            sim.read_faults.append(fault)
        elif fault == "drop":
            sim.drop_next += 1
        elif fault == "disconnect":
            sim.disconnect()
            self.step()
        elif fault == "restart":
            sim.restart_producer()
            self.step()
        else:
            sim.ack_faults.append(fault)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def no_problem_reported(self) -> None:
        assert not self.problems, self.problems
        assert self.sim is None or not self.sim.violations, self.sim.violations

    @invariant()
    def pools_and_entries_agree(self) -> None:
        if self.sim is None:
            return
        for engine in (self.sim.producer, self.sim.consumer):
            engine.scheduler.cache.check()

    @invariant()
    def no_deadline_in_the_past(self) -> None:
        if self.sim is None:
            return
        now = self.sim.clock.now
        for engine in (self.sim.producer, self.sim.consumer):
            deadline = engine.scheduler.bus.next_deadline()
            assert deadline is None or deadline >= now - EPS

    @invariant()
    def no_request_waits_past_its_deadlines(self) -> None:
        if self.sim is None:
            return
        now = self.sim.clock.now
        for rid, (_, since) in self.pending.items():
            assert since is None or now - since <= WAIT_BOUND + EPS, (rid, now - since)

    @invariant()
    def no_grant_outlives_its_lease_and_pins_are_accounted(self) -> None:
        sim = self.sim
        if sim is None:
            return
        now = sim.clock.now
        producer = sim.producer.scheduler
        grants_per_hash: dict[str, int] = {}
        for grant in producer.bus.instances(EC_PRODUCER_GRANT):
            assert grant.has("leased"), grant
            assert now - sim.grant_times[grant.ctx.key] <= DEFAULT_PIN_LEASE_S + EPS
            grants_per_hash[grant.ctx.mm_hash] = grants_per_hash.get(grant.ctx.mm_hash, 0) + 1
        for hold in producer.bus.tagged(EC_PUBLICATION_HOLD, "holding"):  # R-E06
            grants_per_hash[hold.ctx.key] = grants_per_hash.get(hold.ctx.key, 0) + 1
        for entry in producer.cache.entries():
            assert entry.ctx.pins == grants_per_hash.get(entry.key, 0), entry
        consumer = sim.consumer.scheduler
        held: dict[str, int] = {}
        for item in consumer.bus.tagged(EC_SETTLEMENT, "holds_pin"):
            held[item.ctx.mm_hash] = held.get(item.ctx.mm_hash, 0) + 1
        loads = sim.outstanding_loads
        for entry in consumer.cache.entries():
            expected = held.get(entry.key, 0) + loads.get(entry.key, 0)
            assert entry.ctx.pins == expected, (entry, expected)

    @invariant()
    def local_fallback_only_with_media(self) -> None:
        if self.sim is None:
            return
        for request in self.sim.consumer.scheduler.bus.instances(EC_REQUEST):
            if not request.has("failed_cleanly"):
                assert not set(request.ctx.local) & request.ctx.metadata_only, request.ctx

    @invariant()
    def every_read_in_flight_has_a_bounded_exit(self) -> None:
        if self.sim is None:
            return
        bus = self.sim.consumer.scheduler.bus
        for read in bus.instances(EC_CONSUMER_READ):
            if read.state in ("xfer_req_sent", "reading", "quarantined"):
                assert read.timer is not None, read
            else:
                assert read.state == "retry_next_step", read
                assert read.ctx.not_ready <= MAX_NOT_READY


TestR_E08_B05_ECPairModel = ECPairModel.TestCase
TestR_E08_B05_ECPairModel.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def test_R_E07_R_E08_R_E12_B04_pair_reaches_every_read_outcome() -> None:
    """A derandomized run must see reads succeed, retry, fall back and quarantine."""
    seen: dict[str, int] = {}

    class Counting(ECPairModel):
        def _retired(self, inst: Instance[Any]) -> None:
            super()._retired(inst)
            if inst.machine.decl is EC_CONSUMER_READ:
                seen[inst.state] = seen.get(inst.state, 0) + 1
                if inst.ctx.not_ready:
                    seen["retried"] = seen.get("retried", 0) + 1

    run_state_machine_as_test(
        Counting,
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert {"done", "fallback_local", "released", "retried"} <= set(seen), seen
