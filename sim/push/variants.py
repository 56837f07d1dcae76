"""Deliberately broken variants of push mode, for the simulator's self-check (simulation only).

Each variant breaks one promise inside one simulated engine, right after it boots, without
touching any shared declaration: a simulator that stops catching these has stopped
finding bugs. `tests/test_push_simulate.py` demands each is caught within 200 seeds.

- `lease-never-freed`: an expired P lease is evicted but never reports `finished_sending`.
- `eviction-ignored`: P's writer ignores the evict inbox, so stale entries stay forever.
- `exact-id-only`: the writer matches exact request ids only (no base-id fallback, R-P04).
- `write-wrong-blocks`: P writes one block past what D registered (R-P06).
"""

from __future__ import annotations

import msgspec

from kvhandoff.machines.push import p_lease as push_p_lease
from kvhandoff.machines.push.effects import IssueWrite, QueueEviction
from kvhandoff.machines.push.events import LeaseExpired
from kvhandoff.machines.push.p_lease import P_LEASE, PLeaseCtx
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.sim.push.engine import SimEngine
from kvhandoff.sim.push.settings import Variant


def lease_never_freed(engine: SimEngine) -> None:
    if engine.role != "prefill":
        return

    def reap_without_free(ctx: PLeaseCtx, event: LeaseExpired) -> list[Effect]:
        return [QueueEviction(ctx.key), Metric("push.p.lease_expired")]

    for route in engine.side.bus.machine(P_LEASE).routes:
        if route.action is push_p_lease.reap:
            route.action = reap_without_free


def eviction_ignored(engine: SimEngine) -> None:
    if engine.role == "prefill":
        engine.side.writer.on_evict = lambda request_id: None  # type: ignore[method-assign]


class _Forgetful(dict[str, str]):
    """A base-id index that never remembers anything."""

    def __setitem__(self, key: str, value: str) -> None:
        return None


def exact_id_only(engine: SimEngine) -> None:
    writer = engine.side.writer
    writer._finished_by_base = _Forgetful()
    writer._pending_by_base = _Forgetful()


def write_wrong_blocks(engine: SimEngine) -> None:
    if engine.role != "prefill":
        return
    side = engine.side
    issue = side._issue_write

    def shifted(effect: IssueWrite, now: float) -> None:
        reg = effect.registration
        moved = tuple(b + 1 for b in reg.block_ids)
        wrong = msgspec.structs.replace(reg, block_ids=moved)
        issue(IssueWrite(effect.request_id, effect.block_ids, wrong, effect.sender_agent), now)

    side._issue_write = shifted  # type: ignore[method-assign]


VARIANTS: dict[str, Variant] = {
    "lease-never-freed": lease_never_freed,
    "eviction-ignored": eviction_ignored,
    "exact-id-only": exact_id_only,
    "write-wrong-blocks": write_wrong_blocks,
}
