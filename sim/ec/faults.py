"""The faults a simulated encoder-cache world injects between engine steps (simulation only).

Crash and restart of either process (the survivor's ZMQ heartbeat notices within its
timeout), partition and heal (a long partition costs the heartbeat: both ends see a
disconnect), clock jumps, eviction pressure on the producer, aborted consumer requests.
The shared scheduler (`SeededWorld.maybe_fault`) rolls the world's dice for one of them;
restarts and heals that are due come first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.protocol.ec_config import DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S
from kvhandoff.sim.ec.engine import Engine
from kvhandoff.sim.ec.settings import Phase

if TYPE_CHECKING:
    from kvhandoff.sim.ec.world import SimulatedECWorld

__all__ = [
    "abort_one",
    "clock_jump",
    "crash",
    "eviction_pressure",
    "heal",
    "partition",
    "restart",
]


def eviction_pressure(world: SimulatedECWorld) -> None:
    """A burst of unpublished encodings fills the producer's tier (FIFO evictions)."""
    producer = world.plane.producer
    if not producer.alive:
        return
    world.note("EVICTION PRESSURE")
    allocs = []
    for _ in range(world.rng.randint(2, 5)):
        world.fillers += 1
        name = f"filler{world.fillers}"
        req = ECRequestInfo(
            f"filler-{world.fillers}", (name,), mm_tokens=(world.settings.max_tokens,)
        )
        allocs.append((req, 0))
    world.plane.engine_step(producer, allocs)
    for req, _ in allocs:
        producer.scheduler.request_finished(req, world.clock.now)


def abort_one(world: SimulatedECWorld) -> None:
    """A client waiting on the consumer goes away: its request is finished (aborted)."""
    waiting = [c for c in world.waiting() if c.phase is Phase.WAITING and not c.probe]
    consumer = world.plane.consumer
    if not waiting or not consumer.alive:
        return
    client = world.rng.choice(waiting)
    assert client.request is not None
    consumer.scheduler.request_finished(client.request, world.clock.now)
    world.resolve(client, Phase.ABORTED, "client went away")


def crash(world: SimulatedECWorld, which: str, downtime: float) -> None:
    plane = world.plane
    engine = plane.producer if which == "producer" else plane.consumer
    if not engine.alive:
        return
    world.note(f"CRASH {which}")
    plane.crash(which)
    world.restart_at[which] = world.clock.now + downtime
    if which == "consumer":
        for client in world.clients.values():
            if client.phase is Phase.WAITING and client.consumer_epoch == engine.epoch:
                world.resolve(client, Phase.LOST, "consumer crashed")
    # The survivor's ZMQ heartbeat notices within its timeout.
    detect = world.rng.uniform(0.5, DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S)
    world.plane.at(world.clock.now + detect, lambda: lost_peer(world, which, engine))


def lost_peer(world: SimulatedECWorld, which: str, dead: Engine) -> None:
    plane, now = world.plane, world.clock.now
    if which == "producer":
        consumer = plane.consumer
        if consumer.alive:
            consumer.scheduler.on_peer_disconnected(dead.host, dead.port, now)
    else:
        producer = plane.producer
        if producer.alive:
            producer.scheduler.on_consumer_disconnected(dead.identity, now)


def restart(world: SimulatedECWorld, which: str) -> None:
    world.note(f"RESTART {which}")
    world.restart_at.pop(which, None)
    world.plane.restart(which)


def partition(world: SimulatedECWorld, duration: float) -> None:
    world.note("PARTITION")
    world.plane.partition()
    heal_at = world.heal_at = world.clock.now + duration

    def heartbeat_lost() -> None:  # unless healed first (or a later partition's)
        if world.plane.partitioned and world.heal_at == heal_at:
            world.note("PARTITION costs the heartbeat: disconnect")
            world.plane.disconnect()

    world.plane.at(world.clock.now + DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S, heartbeat_lost)


def heal(world: SimulatedECWorld) -> None:
    world.note("HEAL")
    world.heal_at = None
    world.plane.heal()


def clock_jump(world: SimulatedECWorld, seconds: float) -> None:
    """The engines stall (no step, no arrival) while the clock leaps; the planes and
    the machines' timers keep their own time meanwhile, in order: a DMA lands when it
    lands, whatever the processes are doing (a raw jump would replay it late, against
    memory the timers had already moved on)."""
    world.note(f"CLOCK JUMP {seconds:.1f}")
    world.plane.run_until(world.clock.now + seconds)
