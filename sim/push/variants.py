"""Deliberately broken variants of push and pull mode, for the simulator's self-check
(simulation only).

Each variant breaks one promise inside one simulated engine, right after it boots, without
touching any shared declaration: it patches the engine's own compiled tables or objects.
A simulator that stops catching these has stopped finding bugs;
`tests/test_push_simulate.py` demands each is caught within 200 seeds.

- `lease-never-freed`: a revoked P lease ends without reporting `finished_sending`.
- `eviction-ignored`: P's writer ignores revoked leases (it never answers `Revoked`).
- `exact-id-only`: the writer pairs exact request ids only (no base-id matching, R-P04).
- `write-wrong-blocks`: P writes one block past what D registered (R-P06).
- `completion-from-any-agent`: D takes a completion notif from any agent (S-02).
- `first-stage-completes`: D reports the receive after the first PP stage's completions
  (R-T04).
- `tombstone-swallows-retry`: P's tombstone drops any `PUSH_REG` of a base id it served,
  so a retry under the same id is swallowed.

Pull mode's (`PULL_VARIANTS`, `kvhandoff simulate pull --variant ...`):

- `read-past-lease`: D takes a READ seen done after P's lease may have ended (B-09).
- `lease-freed-on-first-read`: a P rank frees its lease on the first completion notif,
  whatever D's TP (R-T03).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from kvhandoff.machines.kv.effects import RankRegistration, ReplayPush, RevokeLease
from kvhandoff.machines.kv.events import Revoked
from kvhandoff.machines.pull import d_read
from kvhandoff.machines.pull import p_lease as pull_lease
from kvhandoff.machines.pull.d_read import D_READ
from kvhandoff.machines.pull.p_lease import PULL_P_LEASE
from kvhandoff.machines.push import d_registration, match, p_lease
from kvhandoff.machines.push.d_registration import D_REGISTRATION, DRegistrationCtx, Notified
from kvhandoff.machines.push.match import MATCH, MatchCtx, RegArrived
from kvhandoff.machines.push.p_lease import P_LEASE, PLeaseCtx
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.protocol.request_ids import get_base_request_id
from kvhandoff.sim.push.engine import SimEngine
from kvhandoff.sim.push.settings import Variant


def _patch_guard(
    bus: EventBus, decl: Declaration[Any], old: Callable[..., bool], new: Callable[..., bool]
) -> None:
    """Swap one guard in this bus's compiled table (not in the shared declaration)."""
    machine = bus.machine(decl)
    for node in machine.nodes.values():
        for route in node.on.values():
            if route.alternatives:
                route.alternatives = tuple(
                    (
                        tuple(new if g is old else g for g in conditions),
                        tuple(new if g is old else g for g in unless),
                        chosen,
                    )
                    for conditions, unless, chosen in route.alternatives
                )
    machine.refresh()


def lease_never_freed(engine: SimEngine) -> None:
    if engine.role != "prefill":
        return

    def reap_without_free(ctx: PLeaseCtx, event: Revoked) -> list[Effect]:
        return [Metric("push.p.lease_expired")]

    for rank in engine.side.ranks:
        machine = rank.bus.machine(P_LEASE)
        for route in machine.routes:
            if route.action is p_lease.reap:
                route.action = reap_without_free
        machine.refresh()


def eviction_ignored(engine: SimEngine) -> None:
    if engine.role != "prefill":
        return
    for rank in engine.side.ranks:
        writer = rank.writer
        on_command = writer.on_command

        def ignoring(command: Any, now: float, on_command: Any = on_command) -> None:
            if not isinstance(command, RevokeLease):
                on_command(command, now)

        writer.on_command = ignoring  # type: ignore[method-assign]


def exact_id_only(engine: SimEngine) -> None:
    """Slots keyed by the exact request id: P's blocks and D's registrations, whose ids
    differ in their random suffix, never meet."""
    for rank in engine.side.ranks:
        writer = rank.writer
        bus = writer.bus

        def exact(request_id: str, event: Any, writer: Any = writer, bus: EventBus = bus) -> None:
            if bus.get(MATCH, request_id) is None:
                ctx = MatchCtx(request_id, p_tp=writer.config.tp_size, p_tp_rank=writer.tp_rank)
                bus.create(MATCH, ctx, bus.now)
            bus.dispatch(MATCH, request_id, event, bus.now)

        writer._to_slot = exact  # type: ignore[method-assign]


def write_wrong_blocks(engine: SimEngine) -> None:
    if engine.role != "prefill":
        return
    for rank in engine.side.ranks:
        issue = rank._issue_write

        def shifted(op: ReplayPush, now: float, issue: Any = issue) -> None:
            regs = tuple(
                RankRegistration(
                    rr.d_rank,
                    msgspec.structs.replace(
                        rr.registration,
                        block_ids=tuple(b + 1 for b in rr.registration.block_ids),
                    ),
                    rr.sender,
                )
                for rr in op.registrations
            )
            issue(ReplayPush(op.request_id, op.block_ids, op.engine_id, regs), now)

        rank._issue_write = shifted  # type: ignore[method-assign]


def completion_from_any_agent(engine: SimEngine) -> None:
    if engine.role != "decode":
        return

    def anyone(ctx: DRegistrationCtx, event: Notified) -> bool:
        return True

    for rank in engine.side.ranks:
        _patch_guard(rank.bus, D_REGISTRATION, d_registration.from_writer, anyone)


def first_stage_completes(engine: SimEngine) -> None:
    if engine.role != "decode":
        return

    def first_stage(ctx: DRegistrationCtx, event: Notified) -> bool:
        stages = max(1, ctx.registration.remote_pp_size)
        return len(ctx.seen | {event.rank}) >= max(1, len(ctx.writers) // stages)

    for rank in engine.side.ranks:
        _patch_guard(rank.bus, D_REGISTRATION, d_registration.completes, first_stage)


def tombstone_swallows_retry(engine: SimEngine) -> None:
    if engine.role != "prefill":
        return

    def same_base(ctx: MatchCtx, event: RegArrived) -> bool:
        base = get_base_request_id(event.reg.registration.request_id)
        return any(get_base_request_id(d_id) == base for d_id in ctx.served)

    for rank in engine.side.ranks:
        _patch_guard(rank.writer_bus, MATCH, match.seen, same_base)


VARIANTS: dict[str, Variant] = {
    "lease-never-freed": lease_never_freed,
    "eviction-ignored": eviction_ignored,
    "exact-id-only": exact_id_only,
    "write-wrong-blocks": write_wrong_blocks,
    "completion-from-any-agent": completion_from_any_agent,
    "first-stage-completes": first_stage_completes,
    "tombstone-swallows-retry": tombstone_swallows_retry,
}


def read_past_lease(engine: SimEngine) -> None:
    if engine.role != "decode":
        return
    for rank in engine.side.ranks:
        _patch_guard(rank.bus, D_READ, d_read.within_lease, lambda ctx, event: True)


def lease_freed_on_first_read(engine: SimEngine) -> None:
    if engine.role != "prefill":
        return
    for rank in engine.side.ranks:
        _patch_guard(rank.bus, PULL_P_LEASE, pull_lease.last_read, lambda ctx, event: True)


PULL_VARIANTS: dict[str, Variant] = {
    "read-past-lease": read_past_lease,
    "lease-freed-on-first-read": lease_freed_on_first_read,
}
