"""The rules a simulated encoder-cache run checks as it goes (simulation only).

`check_invariants(world)` runs after every action: the pools, the eviction order and the
entries agree (no block owned twice, no double free); every pin is accounted for
(producer: one per live grant; consumer: one per hold and per load in flight); no grant
outlives its lease; a read waiting on a deadline has one armed, and no read retries past
its bound; a request encodes locally only what it has media for. The observers check
each eviction (only evictable entries) and each read as it ends (a fallback or a
quarantine only for a reason the seed allows).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ
from kvhandoff.machines.ec.producer_grant import EC_PRODUCER_GRANT
from kvhandoff.machines.ec.publication_hold import EC_PUBLICATION_HOLD
from kvhandoff.machines.ec.request import EC_REQUEST
from kvhandoff.machines.ec.settlement import EC_SETTLEMENT
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_config import DEFAULT_PIN_LEASE_S
from kvhandoff.sim.ec.plane import Engine
from kvhandoff.sim.ec.settings import EPS, QUARANTINE_REASONS, READ_FALLBACKS

if TYPE_CHECKING:
    from kvhandoff.sim.ec.world import SimulatedECWorld

__all__ = ["check_evicting", "check_invariants", "check_read_retired"]


def check_evicting(world: SimulatedECWorld, engine: Engine, victim: str) -> None:
    """Only an evictable (ready, unpinned) entry may be evicted."""
    cache = engine.scheduler.cache
    if not cache.has(victim, "evictable"):
        world.violation(f"{engine.name} evicts {victim} in state {cache.state(victim)}")


def check_read_retired(world: SimulatedECWorld, inst: Instance[Any]) -> None:
    """Count how a read ended; it falls back or quarantines only for an allowed reason."""
    if inst.machine.decl is not EC_CONSUMER_READ:
        return
    ctx = inst.ctx
    reason = ctx.reason
    timed_out = world.clock.now - ctx.first_sent_at >= ctx.not_ready_s - EPS
    spent = ctx.not_ready >= world.settings.max_not_ready or timed_out
    outcomes = world.outcomes
    outcome = f"read.{inst.state}" + (f".{reason}" if reason else "")
    outcomes[outcome] = outcomes.get(outcome, 0) + 1
    if ctx.not_ready:
        outcomes["read.retried_not_ready"] = outcomes.get("read.retried_not_ready", 0) + 1
    if inst.has("landed"):
        world.reads_done.add(str(inst.key))
    elif inst.has("fell_back"):
        # The not-ready budget ends a read at a NACK or at the step it is due (R-E08).
        budget = (reason == "NACK_NOT_READY" and spent) or (
            reason == "not_ready_timeout" and timed_out
        )
        if reason not in READ_FALLBACKS and not budget:
            world.violation(f"read of {inst.key} fell back for {reason!r}")
    elif inst.has("quarantine_ended") and reason not in QUARANTINE_REASONS:
        world.violation(f"read of {inst.key} quarantined for {reason!r}")


def check_invariants(world: SimulatedECWorld) -> None:
    plane, now = world.plane, world.clock.now
    world.violations.extend(plane.violations)
    plane.violations.clear()
    for engine in plane.engines():
        if not engine.alive:
            continue
        try:
            engine.scheduler.cache.check()
        except AssertionError as exc:
            world.violation(f"{engine.name} pool and entries disagree: {exc}")
    producer = plane.producer
    p2p = producer.scheduler.producer
    if producer.alive and p2p is not None:
        held = p2p.pins()
        for peer, pins in held.items():
            if pins > p2p.max_per_peer:
                world.violation(f"consumer {peer!r} holds {pins} pins, over its cap (S-03)")
        if held.total() > p2p.max_total:
            world.violation(f"{held.total()} pins held in all, over the cap (S-03)")
    if producer.alive:
        grants: dict[str, int] = {}
        for grant in producer.scheduler.bus.tagged(EC_PRODUCER_GRANT, "leased"):
            granted_at = plane.grant_times.get(grant.ctx.key, now)
            if now - granted_at > DEFAULT_PIN_LEASE_S + EPS:
                world.violation(f"grant {grant.key} outlives its lease")
            grants[grant.ctx.mm_hash] = grants.get(grant.ctx.mm_hash, 0) + 1
        # A just-published entry is pinned once more by its publication hold (R-E06).
        for hold in producer.scheduler.bus.tagged(EC_PUBLICATION_HOLD, "holding"):
            grants[hold.ctx.key] = grants.get(hold.ctx.key, 0) + 1
        for entry in producer.scheduler.cache.entries():
            if entry.ctx.pins != grants.get(entry.ctx.key, 0):
                world.violation(
                    f"producer {entry.key} has {entry.ctx.pins} pins for "
                    f"{grants.get(entry.ctx.key, 0)} live grants and publication holds"
                )
    consumer = plane.consumer
    if consumer.alive:
        _check_consumer(world, consumer)


def _check_consumer(world: SimulatedECWorld, consumer: Engine) -> None:
    bus = consumer.scheduler.bus
    held: dict[str, int] = {}
    for item in bus.tagged(EC_SETTLEMENT, "holds_pin"):
        held[item.ctx.mm_hash] = held.get(item.ctx.mm_hash, 0) + 1
    for request in bus.instances(EC_REQUEST):
        ctx = request.ctx
        if not request.has("failed_cleanly") and set(ctx.local) & ctx.metadata_only:
            world.violation(f"{request.key} encodes locally without media")
    loads = consumer.outstanding_loads()
    for entry in consumer.scheduler.cache.entries():
        key = entry.ctx.key
        expected = held.get(key, 0) + loads.get(key, 0)
        if entry.ctx.pins != expected:
            world.violation(f"consumer {key} has {entry.ctx.pins} pins, {expected} owed")
    for read in bus.instances(EC_CONSUMER_READ):
        wanted = world.settings.tokens(str(read.key))
        if len(read.ctx.dest_blocks) != wanted:
            world.violation(
                f"read of {read.key} reserved {len(read.ctx.dest_blocks)} blocks, its "
                f"encoding takes {wanted} (an announced size trusted, S-04)"
            )
        if read.has("timed_wait"):
            if read.timer is None:
                world.violation(f"read of {read.key} in {read.state} has no deadline")
        elif read.ctx.not_ready > world.settings.max_not_ready:
            world.violation(f"read of {read.key} retried past the bound")
