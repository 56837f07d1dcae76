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
- `unpin-on-first-report`: a load's transfer ends on the first rank's report, so its
  entry is unpinned (and may be evicted and reused) while another rank still reads it
  (R-T02, R-T06).
- `ack-from-any-peer`: the consumer accepts an ack for its transfer id from whichever
  producer sends it, so a hostile producer's forged grant is READ (S-02).
- `size-trusted`: the consumer reserves (and evicts for) the size a publication
  announces without checking it against the request and its layout (S-04).
"""

from __future__ import annotations

from typing import Any

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.consumer_read import (
    EC_CONSUMER_READ,
    Ack,
    ReadCtx,
    ReadTimeout,
    quarantine,
)
from kvhandoff.machines.ec.events import Discard, PeerDisconnected
from kvhandoff.machines.ec.producer_grant import EC_PRODUCER_GRANT, GrantCtx, XferDone
from kvhandoff.machines.ec.settlement import EC_SETTLEMENT
from kvhandoff.machines.ec.transfer import EC_TRANSFER, RankReported, TransferCtx
from kvhandoff.machines.runtime.compiled import Route
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Emit
from kvhandoff.protocol.ec_wire import decode_xfer_ack
from kvhandoff.sim.ec.plane import Engine
from kvhandoff.sim.ec.world import ECVariant, SimulatedECWorld


def _routes(engine: Engine, kind: Declaration[Any]) -> list[Route]:
    return engine.scheduler.bus.machine(kind).routes


def not_ready_fatal(world: SimulatedECWorld, engine: Engine) -> None:
    if engine.name != "consumer":
        return
    machine = engine.scheduler.bus.machine(EC_CONSUMER_READ)
    chooser = machine.nodes["xfer_req_sent"].on[Ack]
    chooser.alternatives = tuple(
        (conditions, unless, alt)
        for conditions, unless, alt in chooser.alternatives
        if alt.dest is None or "retry_pending" not in alt.dest.tags
    )
    machine.refresh()


def grant_never_unpinned(world: SimulatedECWorld, engine: Engine) -> None:
    if engine.name != "producer":
        return

    def forget_the_pin(ctx: GrantCtx, event: XferDone) -> list[Effect]:
        return []

    for route in _routes(engine, EC_PRODUCER_GRANT):
        if route.edge[0] == "granted" and route.edge[2] == "released":
            route.action = forget_the_pin
    engine.scheduler.bus.machine(EC_PRODUCER_GRANT).refresh()


def no_quarantine(world: SimulatedECWorld, engine: Engine) -> None:
    if engine.name != "consumer":
        return

    def free_at_once(ctx: ReadCtx, event: ReadTimeout | PeerDisconnected) -> list[Effect]:
        return [Emit(EC_CACHE_ENTRY, ctx.key, Discard()), *quarantine(ctx, "read_timeout")]

    for route in _routes(engine, EC_CONSUMER_READ):
        if route.edge[0] == "reading" and route.edge[2] == "quarantined":
            route.action = free_at_once
    engine.scheduler.bus.machine(EC_CONSUMER_READ).refresh()


def unpin_on_first_report(world: SimulatedECWorld, engine: Engine) -> None:
    if engine.name != "consumer":
        return
    machine = engine.scheduler.bus.machine(EC_TRANSFER)
    chooser = machine.nodes["copying"].on[RankReported]
    pending_rank = EC_TRANSFER.callbacks["pending_rank"]

    def pending(ctx: TransferCtx, event: RankReported) -> bool:
        return bool(pending_rank(ctx, event))

    (_, unless, first), *rest = chooser.alternatives
    chooser.alternatives = ((pending,), unless, first), *rest  # any rank's report lands it
    machine.refresh()


def ack_from_any_peer(world: SimulatedECWorld, engine: Engine) -> None:
    consumer = engine.scheduler.consumer
    if engine.name != "consumer" or consumer is None:
        return
    original = consumer.on_xfer_ack

    def trusting(data: bytes, now: float, *, peer: str) -> None:
        try:
            read = consumer.read(decode_xfer_ack(data).mm_hash)
        except Exception:
            read = None
        original(data, now, peer=peer if read is None else read.ctx.peer)

    consumer.on_xfer_ack = trusting  # type: ignore[method-assign]


def size_trusted(world: SimulatedECWorld, engine: Engine) -> None:
    if engine.name != "consumer":
        return
    machine = engine.scheduler.bus.machine(EC_SETTLEMENT)
    bad_size = EC_SETTLEMENT.callbacks["local_bad_size"]
    for node in machine.nodes.values():
        for chooser in node.on.values():
            if chooser.alternatives:
                chooser.alternatives = tuple(
                    alt for alt in chooser.alternatives if alt[2].action is not bad_size
                )
    machine.refresh()


EC_VARIANTS: dict[str, ECVariant] = {
    "not-ready-fatal": not_ready_fatal,
    "grant-never-unpinned": grant_never_unpinned,
    "no-quarantine": no_quarantine,
    "unpin-on-first-report": unpin_on_first_report,
    "ack-from-any-peer": ack_from_any_peer,
    "size-trusted": size_trusted,
}
