"""The end of a simulated encoder-cache run (simulation only).

`settle` turns every fault off, heals, restarts, and drives the clock past every
deadline; `probe` asks for a fresh encoding, which the consumer must read from the
producer (a restarted one if it crashed); `final_check` counts what is left: no grant,
pin, reserved or quarantined block, copy or message may outlive the deadlines, and every
request must be resolved.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ
from kvhandoff.machines.ec.producer_grant import EC_PRODUCER_GRANT
from kvhandoff.machines.ec.request import EC_REQUEST
from kvhandoff.sim.ec.engine import Engine
from kvhandoff.sim.ec.faults import heal, restart
from kvhandoff.sim.ec.settings import Phase
from kvhandoff.sim.push.fabric import SimFaults
from kvhandoff.sim.push.world import SimRunResult

if TYPE_CHECKING:
    from kvhandoff.sim.ec.world import SimulatedECWorld

__all__ = ["final_check", "probe", "quiesce", "settle"]

_HANGS = ("live_reads", "live_requests")


def quiesce(world: SimulatedECWorld, rounds: int = 50) -> None:
    """Step both engines until nothing moves any more at this instant."""
    plane = world.plane
    for _ in range(rounds):
        before = (plane.in_flight(), len(world.waiting()))
        world.producer_step()
        world.consumer_step()
        plane.run_until(world.clock.now)
        if before == (plane.in_flight(), len(world.waiting())):
            return


def run_for(world: SimulatedECWorld, seconds: float) -> None:
    end = world.clock.now + seconds
    while not world.violations:
        quiesce(world)
        world.check_invariants()
        when = world.next_scheduled()
        if when is None or when > end:
            return
        world.plane.run_until(max(when, world.clock.now + 1e-4))


def settle(world: SimulatedECWorld) -> None:
    """Faults off, heal, restart; then drive the clock past every deadline."""
    world.issuing = False
    world.faults = SimFaults.none()
    world.plane.faults = world.faults
    if world.heal_at is not None:
        heal(world)
    for which in sorted(world.restart_at):
        restart(world, which)
    run_for(world, world.settings.settle_span_s)


def probe(world: SimulatedECWorld) -> None:
    """A fresh encoding, every fault off: the consumer must read it from the producer."""
    settings, clock, plane = world.settings, world.clock, world.plane
    for attempt in range(settings.probes):
        mm_hash = f"probe{attempt}"
        saved_by = clock.now + 5.0
        client = world.issue(probe=True, mm_hash=mm_hash)
        while plane.producer.scheduler.cache.has(mm_hash, "awaiting_bytes"):
            if clock.now > saved_by:
                break
            world.producer_step()
            plane.advance(0.05)
        deadline = clock.now + settings.settle_span_s
        while not client.resolved and clock.now < deadline and not world.violations:
            quiesce(world)
            if not client.resolved:
                world.jump()
        if client.phase is Phase.COMPLETED and mm_hash in world.reads_done:
            return
    world.violation(f"no recovery: probe {client.client_id} ended {client.phase}")


def _leftovers(world: SimulatedECWorld) -> dict[str, dict[str, int]]:
    plane = world.plane
    producer, consumer = plane.producer, plane.consumer
    return {
        "producer": {
            "live_grants": producer.scheduler.bus.live(EC_PRODUCER_GRANT),
            "pinned_entries": _pinned(producer),
            "unsaved_entries": _awaiting_bytes(producer),
            "copies_in_flight": producer.worker.in_flight(),
        },
        "consumer": {
            "live_reads": consumer.scheduler.bus.live(EC_CONSUMER_READ),
            "live_requests": consumer.scheduler.bus.live(EC_REQUEST),
            "pinned_entries": _pinned(consumer),
            "reserved_entries": _awaiting_bytes(consumer),
            "copies_in_flight": consumer.worker.in_flight(),
            "loads_in_flight": sum(consumer.outstanding_loads.values()),
        },
        "network": {"in_flight": plane.in_flight()},
    }


def final_check(world: SimulatedECWorld, *, settled: bool = True) -> SimRunResult:
    """Count what is left; after `settle`, anything left is a leak or a hang."""
    plane = world.plane
    leftovers = _leftovers(world)
    leaked = hung = completed = failed = requests = 0
    for role, tables in leftovers.items():
        for name, size in list(tables.items()):
            if not size or not settled:
                del tables[name]
                continue
            if name in _HANGS:
                hung += size
            else:
                leaked += size
            world.violation(f"{role} {name} holds {size} after all deadlines")
    for client in world.clients.values():
        if not client.probe:
            requests += 1
        if not client.resolved:
            if settled:
                hung += 1
                world.violation(f"{client.client_id} unresolved: {client.phase}")
        elif not client.probe:
            if client.phase is Phase.COMPLETED:
                completed += 1
            else:
                failed += 1
    counters = dict(plane.counters)
    for engine in plane.engines():
        for name, value in engine.scheduler.counters().items():
            counters[f"{engine.name}.{name}"] = value
    counters.update(world.outcomes)
    counters["reads_started"] = plane.reads_started
    counters["reads_landed"] = plane.reads_landed
    return SimRunResult(
        seed=world.seed,
        requests=requests,
        completed=completed,
        failed_cleanly=failed,
        leaked=leaked,
        hung=hung,
        violations=list(world.violations),
        actions=world.actions,
        sim_seconds=world.clock.now - 1000.0,
        leftovers={k: v for k, v in leftovers.items() if v},
        counters=counters,
    )


def _pinned(engine: Engine) -> int:
    return sum(1 for e in engine.scheduler.cache.entries() if e.ctx.pins)


def _awaiting_bytes(engine: Engine) -> int:
    return sum(1 for e in engine.scheduler.cache.entries() if e.has("awaiting_bytes"))
