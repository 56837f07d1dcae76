"""The end of a simulated encoder-cache run (simulation only).

What `SimulatedECWorld` tells the shared ending (`SeededWorld.settle`, `probe`,
`final_check`): `quiesce` steps both engines until nothing moves at this instant;
`probe_client` asks for a fresh encoding, which the consumer must then read from the
producer (a restarted one if it crashed); `leftovers` is what may not outlive the
deadlines (no grant, pin, reserved or quarantined block, copy or message); `counters`
is what the run counted.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ
from kvhandoff.machines.ec.producer_grant import EC_PRODUCER_GRANT
from kvhandoff.machines.ec.request import EC_REQUEST
from kvhandoff.sim.ec.engine import Engine
from kvhandoff.sim.ec.settings import ECClient

if TYPE_CHECKING:
    from kvhandoff.sim.ec.world import SimulatedECWorld

__all__ = ["counters", "leftovers", "probe_client", "quiesce"]


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


def probe_client(world: SimulatedECWorld, attempt: int) -> ECClient:
    """A fresh encoding, every fault off: the producer saves it before the consumer asks."""
    clock, plane = world.clock, world.plane
    mm_hash = f"probe{attempt}"
    saved_by = clock.now + 5.0
    client = world.issue(probe=True, mm_hash=mm_hash)
    while plane.producer.scheduler.cache.has(mm_hash, "awaiting_bytes"):
        if clock.now > saved_by:
            break
        world.producer_step()
        plane.advance(0.05)
    return client


def leftovers(world: SimulatedECWorld) -> dict[str, dict[str, int]]:
    """Every table that must be empty after all deadlines, per process, with its size."""
    plane = world.plane
    producer, consumer = plane.producer, plane.consumer
    return {
        "producer": {
            "live_grants": producer.scheduler.bus.live(EC_PRODUCER_GRANT),
            "pinned_entries": _pinned(producer),
            "unsaved_entries": _awaiting_bytes(producer),
            "copies_in_flight": producer.copies_in_flight(),
            "reports_in_transit": len(producer.reports_in_transit),
        },
        "consumer": {
            "live_reads": consumer.scheduler.bus.live(EC_CONSUMER_READ),
            "live_requests": consumer.scheduler.bus.live(EC_REQUEST),
            "pinned_entries": _pinned(consumer),
            "reserved_entries": _awaiting_bytes(consumer),
            "copies_in_flight": consumer.copies_in_flight(),
            "loads_in_flight": len(consumer.loads_unreported),
            "reports_in_transit": len(consumer.reports_in_transit),
        },
        "network": {"in_flight": plane.in_flight()},
    }


def counters(world: SimulatedECWorld) -> dict[str, int]:
    """The planes' and schedulers' counters, and how reads ended (coverage reports)."""
    plane = world.plane
    counters = dict(plane.counters)
    for engine in plane.engines():
        for name, value in engine.scheduler.counters().items():
            counters[f"{engine.name}.{name}"] = value
    counters.update(world.outcomes)
    counters["reads_started"] = plane.reads_started
    counters["reads_landed"] = plane.reads_landed
    return counters


def _pinned(engine: Engine) -> int:
    return sum(1 for e in engine.scheduler.cache.entries() if e.ctx.pins)


def _awaiting_bytes(engine: Engine) -> int:
    return sum(1 for e in engine.scheduler.cache.entries() if e.has("awaiting_bytes"))
