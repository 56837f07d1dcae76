"""Deliberately broken variants of the encoder-cache connector, for the simulator's
self-check (simulation only).

Each variant breaks one promise inside one simulated engine as it boots, by rewiring a
route of that engine's own compiled machine (every bus compiles its own copy, so no
other engine or test sees it). A simulator that stops catching these has stopped finding
bugs: `tests/test_ec_simulate.py` demands each is caught within 200 seeds.

- `not-ready-fatal`: the consumer treats `NACK_NOT_READY` like any other NACK and falls
  back at once (the seed retries it next step, R-E08).
- `grant-never-unpinned`: the producer ends a grant on `XferDone` without unpinning its
  entry, so the entry can never be evicted again (a leaked pin).
- `no-quarantine`: the consumer frees a timed-out READ's destination at once, though the
  DMA may still land there (R-E12).
"""

from __future__ import annotations

from typing import Any

from kvhandoff.machines.ec import consumer_read as ec_consumer_read
from kvhandoff.machines.ec import producer_grant as ec_producer_grant
from kvhandoff.machines.ec.cache_entry import ENTRY_KIND
from kvhandoff.machines.runtime.compiled import Route
from kvhandoff.machines.runtime.effects import Emit
from kvhandoff.sim.ec.plane import Engine
from kvhandoff.sim.ec.world import ECVariant, SimulatedECWorld


def _routes(engine: Engine, kind: str) -> list[Route]:
    return engine.scheduler.bus.machine(kind).routes


def not_ready_fatal(world: SimulatedECWorld, engine: Engine) -> None:
    if engine.name != "consumer":
        return
    machine = engine.scheduler.bus.machine(ec_consumer_read.CONSUMER_READ_KIND)
    chooser = machine.nodes["xfer_req_sent"].on["ack"]
    chooser.alternatives = tuple(
        (conditions, unless, alt)
        for conditions, unless, alt in chooser.alternatives
        if alt.dest is None or alt.dest.name != "retry_next_step"
    )


def grant_never_unpinned(world: SimulatedECWorld, engine: Engine) -> None:
    if engine.name != "producer":
        return
    for route in _routes(engine, ec_producer_grant.GRANT_KIND):
        if route.edge[0] == "granted" and route.edge[2] == "released":
            route.action = lambda inst, payload: []


def no_quarantine(world: SimulatedECWorld, engine: Engine) -> None:
    if engine.name != "consumer":
        return

    def free_at_once(inst: Any, payload: Any) -> list[object]:
        effects = ec_consumer_read._read_timed_out(inst, payload)
        return [Emit(ENTRY_KIND, inst.key, "discard"), *effects]

    for route in _routes(engine, ec_consumer_read.CONSUMER_READ_KIND):
        if route.edge[0] == "reading" and route.edge[2] == "quarantined":
            route.action = free_at_once


EC_VARIANTS: dict[str, ECVariant] = {
    "not-ready-fatal": not_ready_fatal,
    "grant-never-unpinned": grant_never_unpinned,
    "no-quarantine": no_quarantine,
}
