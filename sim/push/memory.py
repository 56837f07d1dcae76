"""Block bookkeeping of the simulated engines (deterministic simulation only).

A `SimBlockPool` hands out *logical* KV blocks of one simulated engine (every rank uses
the same block ids), remembers which request owns each one, and keeps the blocks of a
receive that did not complete in quarantine for a while before reuse, the way an engine
must treat memory a peer might still be writing into. `fill_pattern` / `pattern_ok` are
P's prefill and D's check: each physical block of each member holds bytes derived from
the client request id, the member name and the block's ordinal, so a byte written to the
wrong place shows; a TP rank holds its slice of those bytes (its heads, R-T03).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvhandoff.protocol.blocks import expand_to_physical
from kvhandoff.sim.push.transport import SimPushTransport

SCRIBBLE = 0xEE  # what freed P blocks are overwritten with: a late read shows


def pattern(client_id: str, member: str, ordinal: int, block_len: int) -> bytes:
    seed = hashlib.blake2b(f"{client_id}/{member}/{ordinal}".encode(), digest_size=16).digest()
    return (seed * (block_len // len(seed) + 1))[:block_len]


def physical_ids(transport: SimPushTransport, logical: Sequence[int]) -> list[int]:
    return expand_to_physical(logical, transport.physical_blocks_per_logical)


def rank_pattern(transport: SimPushTransport, client_id: str, member: str, ordinal: int) -> bytes:
    """This rank's slice of a block's bytes: its share of the heads."""
    length = transport.block_len
    full = pattern(client_id, member, ordinal, length * transport.tp_size)
    start = transport.tp_rank * length
    return full[start : start + length]


def fill_pattern(
    transport: SimPushTransport, client_id: str, logical: Sequence[int], *, first: int = 0
) -> None:
    """P's prefill (and D's cached prefix): every member's blocks hold the request's
    pattern; ordinals count from `first` (D's cached blocks are the head of the request)."""
    for slot in transport.layout.slots:
        for ordinal, block in enumerate(physical_ids(transport, logical), start=first):
            data = rank_pattern(transport, client_id, slot.name, ordinal)
            transport.write_block(slot.allocation, block, data)


def fill_constant(transport: SimPushTransport, logical: Sequence[int], value: int) -> None:
    data = bytes([value]) * transport.block_len
    for allocation in range(len(transport.layout.allocations)):
        for block in physical_ids(transport, logical):
            transport.write_block(allocation, block, data)


def pattern_ok(transport: SimPushTransport, client_id: str, logical: Sequence[int]) -> bool:
    """D's check: every member's blocks hold P's pattern for the request."""
    for slot in transport.layout.slots:
        for ordinal, block in enumerate(physical_ids(transport, logical)):
            expected = rank_pattern(transport, client_id, slot.name, ordinal)
            if transport.block(slot.allocation, block) != expected:
                return False
    return True


@dataclass(slots=True)
class SimBlockPool:
    """Logical blocks of one engine: free, owned by a request, or in quarantine."""

    capacity: int
    rng: random.Random
    free: list[int] = field(default_factory=list)
    owner: dict[int, str] = field(default_factory=dict)
    quarantined: dict[int, tuple[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(self.capacity))

    def allocate(self, count: int, request_id: str) -> list[int] | None:
        if count > len(self.free):
            return None
        picked = self.rng.sample(self.free, count)
        taken = set(picked)
        self.free = [b for b in self.free if b not in taken]
        for block in picked:
            self.owner[block] = request_id
        return picked

    def release(self, blocks: Sequence[int], request_id: str) -> list[int]:
        """Free `request_id`'s blocks; returns any it did not own (a double free)."""
        wrong = [b for b in blocks if self.owner.get(b) != request_id]
        for block in blocks:
            if self.owner.get(block) == request_id:
                del self.owner[block]
                self.free.append(block)
        return wrong

    def quarantine(self, blocks: Sequence[int], request_id: str, until: float) -> list[int]:
        """Hold `request_id`'s blocks out of reuse until `until`; returns wrongly owned ones."""
        wrong = [b for b in blocks if self.owner.get(b) != request_id]
        for block in blocks:
            if self.owner.get(block) == request_id:
                del self.owner[block]
                self.quarantined[block] = (request_id, until)
        return wrong

    def expire_quarantine(self, now: float) -> None:
        done = [b for b, (_rid, until) in self.quarantined.items() if until <= now]
        for block in done:
            del self.quarantined[block]
            self.free.append(block)

    def held_by(self, block: int) -> str | None:
        """The request a block is owned by or quarantined for, if any."""
        owner = self.owner.get(block)
        if owner is not None:
            return owner
        held = self.quarantined.get(block)
        return None if held is None else held[0]
