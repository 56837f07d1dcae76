"""A producer/consumer encoder-cache pair under one seeded scheduler (simulation only).

`SimulatedECWorld` drives a real producer (`ec_producer`) and a real consumer
(`ec_consumer`), both with P2P, over `SimECPlane`. Client requests arrive as a Poisson
process; the proxy sends each one's encode leg to the producer (which saves the encoder
output and publishes it from `request_finished`), then relays the publication to the
consumer, sometimes with the media rewritten to a metadata-only reference (B-05). Every
ordering decision (which engine steps, when the clock moves, which fault strikes) comes
from the world's `random.Random(seed)`, so a run replays exactly from its seed.

Faults (`SimFaults`): lost, late, duplicated and reordered control messages; a failed
agent load (`handshake_fail`), failed and stalled READs; crash and restart of either
process; partition and heal (a long one costs the ZMQ heartbeat, so both ends see a
disconnect); clock jumps; eviction pressure on the producer; slow saves (NACK_NOT_READY);
aborted consumer requests.

Invariants are checked after every action: the pools, the eviction order and the entries
agree (no block owned twice, no double free); every pin is accounted for (producer: one
per live grant; consumer: one per hold and per load in flight); no grant outlives its
lease; only ready entries are evicted; a READ lands only in blocks reserved for its
encoding and, while awaited, reads a pinned source; a load reads its own encoding; a read
falls back only for a reason the seed allows (NACK_NOT_READY only once the retries are
spent) and quarantines only after a READ timeout or a disconnect; a request encodes
locally only what it has media for, and fails only when it lost a rewritten encoding.

The scheduler, the run and its end are `SeededWorld`'s (`kvhandoff.sim.world`); the
faults this world strikes are in `faults.py`, what its end looks at in `ending.py`. A
run ends with `settle` (faults off, heal, restart, the clock driven past every
deadline), `probe` (a fresh encoding must be read remotely, from a restarted producer if
it crashed), and `final_check` (no grant, pin, reserved or quarantined block, copy or
message left; every request resolved).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from typing import Any, ClassVar, Unpack

from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.machines.ec.request import EC_REQUEST, RequestCtx
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.sim.contracts import Choices, WorldOptions
from kvhandoff.sim.ec import ending, hostile
from kvhandoff.sim.ec import faults as ec_faults
from kvhandoff.sim.ec.checks import check_evicting, check_invariants, check_read_retired
from kvhandoff.sim.ec.plane import Engine, SimECPlane
from kvhandoff.sim.ec.settings import META, ECClient, ECSimSettings, Phase
from kvhandoff.sim.faults import SimFaults
from kvhandoff.sim.world import SeededWorld

__all__ = ["ECVariant", "SimulatedECWorld"]

ECVariant = Callable[["SimulatedECWorld", Engine], None]

_RELAYING, _WAITING = Phase.RELAYING, Phase.WAITING  # looked up once: `waiting()` is hot


class SimulatedECWorld(SeededWorld[ECSimSettings, ECClient, ECVariant]):
    """A producer and a consumer over `SimECPlane`; the scheduler comes from `SeededWorld`."""

    protocol: ClassVar[str] = "ec"
    roles: ClassVar[tuple[str, ...]] = ("producer", "consumer")
    restart_order: ClassVar[tuple[str, ...]] = ("consumer", "producer")
    hang_tables: ClassVar[frozenset[str]] = frozenset({"live_reads", "live_requests"})
    crash_rate: ClassVar[float] = 2.0
    partition_rate: ClassVar[float] = 2.0
    partition_s: ClassVar[tuple[float, float]] = (0.5, 30.0)
    stop_at_violation: ClassVar[bool] = True

    def __init__(
        self, seed: int, **options: Unpack[WorldOptions[ECSimSettings, ECVariant]]
    ) -> None:
        super().__init__(seed, **options)
        self.clients: dict[str, ECClient] = {}
        self.reads_done: set[str] = set()
        self.outcomes: dict[str, int] = {}  # how reads ended, for coverage reports
        self.fillers = 0
        self.hostile_serial = 0
        self.plane = SimECPlane(
            seed,
            producer_blocks=self.settings.producer_blocks,
            consumer_blocks=self.settings.consumer_blocks,
            faults=self.faults,
            net_delay=(0.01, 0.3),
            copy_delay=(0.0, 0.5),
            read_delay=(0.01, 1.0),
            machine_config={
                "consumer_max_not_ready_retries": float(self.settings.max_not_ready),
                "producer_max_grants_per_peer": float(self.settings.max_pins_per_peer),
                "producer_max_grants": float(self.settings.max_pins),
            },
            clock=self.clock,
            rng=random.Random(self.rng.getrandbits(64)),
            eviction_observer=self._evicting,
            on_engine=self._attach,
            tp_size=self.settings.tp_size,
            pcp_size=self.settings.pcp_size(seed),
        )

    def default_settings(self) -> ECSimSettings:
        return ECSimSettings()

    # -- observers ----------------------------------------------------------------------

    def _attach(self, engine: Engine) -> None:
        bus = engine.scheduler.bus
        if self.recording:
            bus.record(self.sink(f"{engine.name}-{engine.epoch}"))
        if engine.name == "consumer":
            bus.on_retire(lambda inst: check_read_retired(self, inst))
        if self.variant is not None:
            self.variant(self, engine)

    def _evicting(self, engine: Engine, victim: str, _order: list[Any]) -> None:
        check_evicting(self, engine, victim)

    # -- client requests --------------------------------------------------------------------

    def issue(self, *, probe: bool = False, mm_hash: str | None = None) -> ECClient:
        """A client request: its encode leg runs on the producer now, and its consumer
        leg arrives when the proxy relays the publication."""
        self._serial += 1
        client_id = f"cmpl-{self._serial:05d}-0"
        if mm_hash is not None:
            hashes: tuple[str, ...] = (mm_hash,)
        else:
            count = 1 if self.rng.random() < 0.7 else 2
            picks = self.rng.sample(range(self.settings.encodings), count)
            hashes = tuple(f"mm{i:02d}" for i in picks)
        client = ECClient(client_id, hashes, probe=probe)
        self.clients[client_id] = client
        params = self._encode_leg(client_id, hashes)
        rewrite = not probe and self.rng.random() < self.settings.rewrite_share
        servable = frozenset(h for h, entry in params.items() if entry.get("metadata"))
        if not probe and self.faults.hostile and self.rng.random() < self.faults.hostile * 5:
            hostile.inflate_sizes(self, params)
        client.request = ECRequestInfo(
            client_id,
            hashes,
            ec_transfer_params=params,
            metadata_only=servable if rewrite else frozenset(),
            mm_tokens=tuple(self.settings.tokens(h) for h in hashes),
        )
        relay = 0.0 if probe else self.rng.uniform(*self.settings.relay_s)
        client.relay_at = self.clock.now + relay
        self.note(f"issue {client_id} {hashes} rewrite={rewrite} published={sorted(servable)}")
        return client

    def _encode_leg(self, client_id: str, hashes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        producer = self.plane.producer
        if not producer.alive:
            return {}  # the encode leg failed: the consumer encodes locally
        tokens = tuple(self.settings.tokens(h) for h in hashes)
        req = ECRequestInfo(
            f"enc-{client_id}", hashes, mm_metadata={h: META for h in hashes}, mm_tokens=tokens
        )
        self.plane.engine_step(producer, [(req, index) for index in range(len(hashes))])
        return producer.scheduler.request_finished(req, self.clock.now)

    # -- engine steps -------------------------------------------------------------------------

    def consumer_step(self) -> None:
        consumer = self.plane.consumer
        if not consumer.alive:
            return
        scheduler, now = consumer.scheduler, self.clock.now
        allocs: list[tuple[ECRequestInfo, int]] = []
        finished: list[ECRequestInfo] = []
        for client in self.waiting():
            req = client.request
            assert req is not None
            if client.phase is Phase.RELAYING:
                client.phase = Phase.WAITING
                client.consumer_epoch = consumer.epoch
            if scheduler.ensure_cache_available(req, 0, now):
                for index, h in enumerate(req.mm_hashes):
                    if scheduler.has_cache_item(h):
                        allocs.append((req, index))
                finished.append(req)
                self.resolve(client, Phase.COMPLETED)
                continue
            inst = scheduler.bus.get(EC_REQUEST, req.request_id)
            if inst is not None and inst.has("failed_cleanly"):
                self._check_failure(req, inst)
                scheduler.request_finished(req, now)
                self.resolve(client, Phase.FAILED, inst.ctx.failure)
        self.plane.engine_step(consumer, allocs)
        for req in finished:
            scheduler.request_finished(req, self.clock.now)

    def waiting(self) -> list[ECClient]:
        """Clients whose consumer leg the live consumer should look at now."""
        now = self.clock.now
        epoch = self.plane.consumer.epoch
        return [
            c
            for c in self.clients.values()
            if (c.phase is _RELAYING and c.relay_at <= now)
            or (c.phase is _WAITING and c.consumer_epoch == epoch)
        ]

    def resolve(self, client: ECClient, phase: Phase, reason: str = "") -> None:
        client.phase = phase
        client.reason = reason
        self.note(f"{client.client_id} {phase}{': ' + reason if reason else ''}")

    def _check_failure(self, req: ECRequestInfo, inst: Instance[RequestCtx]) -> None:
        lost_rewritten = any(h in inst.ctx.failure for h in req.metadata_only)
        if not lost_rewritten and "malformed" not in inst.ctx.failure:
            self.violation(f"{req.request_id} failed without losing a rewritten encoding")

    def producer_step(self) -> None:
        self.plane.engine_step(self.plane.producer, [])

    # -- what the seeded scheduler asks (SeededWorld) -------------------------------------

    def due_actions(self, choices: Choices, now: float) -> None:
        plane, rng = self.plane, self.rng
        consumer, producer = plane.consumer, plane.producer
        consumer_busy = (
            bool(self.waiting())
            or consumer.copies_in_flight() > 0
            or bool(consumer.reports_in_transit)
        )
        choices.append((3.0 if consumer_busy else 0.3, self.consumer_step))
        producer_busy = producer.copies_in_flight() > 0 or bool(producer.reports_in_transit)
        choices.append((3.0 if producer_busy else 0.3, self.producer_step))
        choices.append((2.0, lambda: plane.advance(rng.expovariate(20.0))))
        if not consumer_busy and not producer_busy:
            choices.append((1.0, self.jump))

    def event_times(self) -> list[float]:
        times = [c.relay_at for c in self.clients.values() if c.phase is Phase.RELAYING]
        for when in (self.plane.next_event(), self.plane.next_report()):
            if when is not None:
                times.append(when)
        return times

    def advance_to(self, when: float) -> None:
        """The planes run to `when` (at least 0.1 ms on), delivering what falls due."""
        self.plane.run_until(max(when, self.clock.now + 1e-4))

    def crash(self, role: str, downtime: float) -> None:
        ec_faults.crash(self, role, downtime)

    def restart(self, role: str) -> None:
        ec_faults.restart(self, role)

    def partition(self, duration: float) -> None:
        ec_faults.partition(self, duration)

    def heal(self) -> None:
        ec_faults.heal(self)

    def clock_jump(self, seconds: float) -> None:
        ec_faults.clock_jump(self, seconds)

    def abort_one(self) -> None:
        ec_faults.abort_one(self)

    def protocol_fault(self) -> bool:
        rate = self.faults.eviction_pressure
        if rate and self.rng.random() < rate:
            ec_faults.eviction_pressure(self)
            return True
        rate = self.faults.hostile
        if rate and self.rng.random() < rate:
            hostile.act(self)
            return True
        return False

    def use_faults(self, faults: SimFaults) -> None:
        self.faults = self.plane.faults = faults

    # -- invariants and the end of a run ----------------------------------------------------

    def check_invariants(self) -> None:
        check_invariants(self)

    def quiesce(self, rounds: int = 50) -> None:
        ending.quiesce(self, rounds)

    def probe_client(self, attempt: int) -> ECClient:
        return ending.probe_client(self, attempt)

    def recovered(self, client: ECClient) -> bool:
        """The probe completed by reading its encoding from the producer."""
        return client.completed and client.mm_hashes[0] in self.reads_done

    def state_of(self, client: ECClient) -> str:
        return str(client.phase)

    def clients_seen(self) -> Iterable[ECClient]:
        return self.clients.values()

    def leftovers(self) -> dict[str, dict[str, int]]:
        return ending.leftovers(self)

    def counters(self) -> dict[str, int]:
        return ending.counters(self)

    def terms_of(self, violations: list[str]) -> set[str]:
        """The client ids and mm_hashes the first violations name (for an event log)."""
        terms: set[str] = set()
        for client in self.clients.values():
            if any(client.client_id in v for v in violations[:3]):
                terms.add(client.client_id)
                terms.update(client.mm_hashes)
        for i in range(self.settings.encodings):
            name = f"mm{i:02d}"
            if any(name in v for v in violations[:3]):
                terms.add(name)
        return terms
