"""Member routing for PP-sharded and hybrid KV layouts (R-P14).

A *member* is a layer name backing a NIXL region. A PP-sharded producer owns only some
members, and hybrid (HMA) layouts pool several members into one region, so region ``i``
here need not be region ``i`` there. Instead:

1. `derive_member_major_layout` turns the local regions into a `MemberLayout` once, at KV
   registration: physical allocations are deduplicated (an allocation shared by several
   members is registered once) and members get a fixed order that depends on the local
   layout alone, so one local descriptor list serves every remote engine and TP rank.
2. `route_remote_regions` pairs each local member with the one remote region that
   advertises it, per remote; members only the remote owns (other PP stages) are ignored.
3. Descriptor lists are member-major: member ``m``'s blocks follow the blocks of the
   members before it, each member counting its own region's capacity, so P and D need
   not allocate the same number of blocks (`block_descriptor_offset`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "LocalRegion",
    "MemberLayout",
    "MemberSlot",
    "RemoteRoute",
    "check_pipeline_support",
    "derive_member_major_layout",
    "route_remote_regions",
]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class LocalRegion:
    """One local KV region: entries with the same ``base_addr`` are one allocation."""

    base_addr: int
    members: tuple[str, ...]
    block_len: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class MemberSlot:
    """One member in member-major order, with the local allocation backing it."""

    name: str
    allocation: int
    """Index into `MemberLayout.allocations`."""
    base_addr: int
    block_len: int
    num_blocks: int


def _starts(capacities: Sequence[int]) -> tuple[int, ...]:
    return (0, *accumulate(capacities))[:-1]


def _offset(
    names: Sequence[str],
    capacities: Sequence[int],
    starts: Sequence[int],
    member_idx: int,
    block_id: int,
) -> int:
    if not 0 <= member_idx < len(names):
        raise LocalProtocolError(f"member index {member_idx} outside 0..{len(names) - 1}")
    if not 0 <= block_id < capacities[member_idx]:
        raise LocalProtocolError(
            f"block {block_id} outside member {names[member_idx]!r}'s capacity of"
            f" {capacities[member_idx]} blocks"
        )
    return starts[member_idx] + block_id


@dataclass(frozen=True, slots=True)
class MemberLayout:
    """The local member-major layout; build it with `derive_member_major_layout`."""

    allocations: tuple[LocalRegion, ...]
    """Physical allocations, each registered once, members merged; also the regions
    advertised in the handshake."""
    slots: tuple[MemberSlot, ...]
    """One per member, in member-major order."""
    members: tuple[str, ...]
    """Member names in member-major order."""
    capacities: tuple[int, ...]
    """Local capacity (physical blocks) per member."""
    descriptor_starts: tuple[int, ...]
    needs_member_routing: bool
    """True for a PP-sharded producer: remotes must advertise ``region_members``."""

    @property
    def region_members(self) -> tuple[tuple[str, ...], ...]:
        """Members per allocation, as advertised in the handshake."""
        return tuple(a.members for a in self.allocations)

    @property
    def num_descriptors(self) -> int:
        """Length of the local member-major descriptor list."""
        return sum(self.capacities)

    def block_descriptor_offset(self, member_idx: int, block_id: int) -> int:
        """Index of (member, physical block) in the local descriptor list."""
        return _offset(self.members, self.capacities, self.descriptor_starts, member_idx, block_id)


@dataclass(frozen=True, slots=True)
class RemoteRoute:
    """Where each local member lands on one remote engine, in local member order."""

    local_engine_id: str
    remote_engine_id: str
    members: tuple[str, ...]
    regions: tuple[int, ...]
    """Remote region index per member."""
    block_lens: tuple[int, ...]
    """Remote block length (the stride between blocks) per member."""
    capacities: tuple[int, ...]
    """Remote region capacity (physical blocks) per member."""
    descriptor_starts: tuple[int, ...]
    num_remote_regions: int
    by_member: bool
    """False when the route fell back to index routing (allowed only when the local
    layout does not need member routing and the remote advertised no members)."""

    def pick(self, per_region: Sequence[T]) -> tuple[T, ...]:
        """Reorder a per-remote-region list (e.g. base addresses) into member order."""
        if len(per_region) != self.num_remote_regions:
            raise LocalProtocolError(
                f"expected {self.num_remote_regions} per-region values for engine"
                f" {self.remote_engine_id!r}, got {len(per_region)}"
            )
        return tuple(per_region[r] for r in self.regions)

    def block_descriptor_offset(self, member_idx: int, block_id: int) -> int:
        """Index of (member, physical block) in this remote's descriptor list."""
        return _offset(self.members, self.capacities, self.descriptor_starts, member_idx, block_id)


def check_pipeline_support(*, is_decoder: bool, pp_size: int, has_ssm_layers: bool) -> None:
    """Reject pipeline-parallel set-ups push mode does not support (`LocalProtocolError`)."""
    if pp_size < 1:
        raise LocalProtocolError(f"pipeline parallel size must be >= 1, got {pp_size}")
    if pp_size > 1 and is_decoder:
        raise LocalProtocolError(
            f"decode-side pipeline parallelism (pp_size={pp_size}) is not supported in push"
            " mode: completions are counted per consumer rank"
        )
    if pp_size > 1 and has_ssm_layers:
        raise LocalProtocolError(
            f"Mamba/SSM hybrid models are not supported under pipeline parallelism"
            f" (pp_size={pp_size})"
        )


def _check_local_region(region: LocalRegion) -> None:
    if region.base_addr < 0 or region.block_len < 1 or region.num_blocks < 1:
        raise LocalProtocolError(
            f"local region needs base_addr >= 0, block_len >= 1 and num_blocks >= 1, got {region}"
        )
    if not region.members or "" in region.members:
        raise LocalProtocolError(f"local region at {region.base_addr:#x} needs non-empty members")


def derive_member_major_layout(
    regions: Sequence[LocalRegion],
    *,
    pp_size: int = 1,
    is_decoder: bool = False,
    has_ssm_layers: bool = False,
) -> MemberLayout:
    """Build the local member-major layout once, at KV registration.

    Regions sharing a ``base_addr`` are one allocation (they must agree on block length
    and capacity) and are merged. Allocations keep their first-seen order and members
    their order within it. A member listed twice raises `LocalProtocolError`.
    """
    check_pipeline_support(is_decoder=is_decoder, pp_size=pp_size, has_ssm_layers=has_ssm_layers)
    if not regions:
        raise LocalProtocolError("local layout has no regions")
    merged: dict[int, LocalRegion] = {}
    seen: set[str] = set()
    for region in regions:
        _check_local_region(region)
        for name in region.members:
            if name in seen:
                raise LocalProtocolError(f"member {name!r} appears twice in the local layout")
            seen.add(name)
        first = merged.get(region.base_addr)
        if first is None:
            merged[region.base_addr] = region
            continue
        if (first.block_len, first.num_blocks) != (region.block_len, region.num_blocks):
            raise LocalProtocolError(
                f"allocation at {region.base_addr:#x} is listed with block_len/num_blocks"
                f" {first.block_len}/{first.num_blocks} and {region.block_len}/{region.num_blocks}"
            )
        merged[region.base_addr] = LocalRegion(
            region.base_addr, first.members + region.members, region.block_len, region.num_blocks
        )
    allocations = tuple(merged.values())
    slots = tuple(
        MemberSlot(name, idx, alloc.base_addr, alloc.block_len, alloc.num_blocks)
        for idx, alloc in enumerate(allocations)
        for name in alloc.members
    )
    capacities = tuple(s.num_blocks for s in slots)
    return MemberLayout(
        allocations=allocations,
        slots=slots,
        members=tuple(s.name for s in slots),
        capacities=capacities,
        descriptor_starts=_starts(capacities),
        needs_member_routing=pp_size > 1,
    )


def _route_by_member(
    layout: MemberLayout,
    remote_region_members: Sequence[Sequence[str]],
    local_engine_id: str,
    remote_engine_id: str,
    peer: str | None,
) -> tuple[int, ...]:
    owners: dict[str, list[int]] = {name: [] for name in layout.members}
    for region_idx, members in enumerate(remote_region_members):
        for name in members:
            found = owners.get(name)
            if found is not None:  # remote-only members (other PP stages) are ignored
                found.append(region_idx)
    for name, found in owners.items():
        if len(found) != 1:
            problem = "is not advertised" if not found else f"is advertised {len(found)} times"
            raise RemoteProtocolError(
                f"member {name!r} of local engine {local_engine_id!r} {problem} by remote"
                f" engine {remote_engine_id!r} (regions {found}); expected exactly once",
                peer=peer,
            )
    return tuple(owners[name][0] for name in layout.members)


def route_remote_regions(
    layout: MemberLayout,
    remote_region_members: Sequence[Sequence[str]],
    remote_block_lens: Sequence[int],
    remote_capacities: Sequence[int],
    *,
    local_engine_id: str,
    remote_engine_id: str,
    peer: str | None = None,
) -> RemoteRoute:
    """Select and order the remote regions each local member writes to.

    Routes by member whenever the remote advertises ``region_members``; every local
    member must then be advertised exactly once. Without remote member metadata, a layout
    that needs member routing fails; any other layout falls back to index routing
    (allocation ``k`` to remote region ``k``, equal counts required). Every failure is a
    `RemoteProtocolError` naming both engines (and the member, where one is at fault).
    """
    n = len(remote_block_lens)
    if len(remote_capacities) != n or (remote_region_members and len(remote_region_members) != n):
        raise RemoteProtocolError(
            f"remote engine {remote_engine_id!r} sent {n} block lengths,"
            f" {len(remote_capacities)} capacities and {len(remote_region_members)}"
            f" region_members entries (local engine {local_engine_id!r})",
            peer=peer,
        )
    by_member = bool(remote_region_members)
    if by_member:
        regions = _route_by_member(
            layout, remote_region_members, local_engine_id, remote_engine_id, peer
        )
    elif layout.needs_member_routing:
        raise RemoteProtocolError(
            f"local engine {local_engine_id!r} routes by member (first member"
            f" {layout.members[0]!r}) but remote engine {remote_engine_id!r} advertises no"
            " region_members; refusing to fall back to index routing",
            peer=peer,
        )
    elif n != len(layout.allocations):
        raise RemoteProtocolError(
            f"remote engine {remote_engine_id!r} has {n} regions and local engine"
            f" {local_engine_id!r} has {len(layout.allocations)}; index routing needs equal"
            " counts",
            peer=peer,
        )
    else:
        regions = tuple(s.allocation for s in layout.slots)
    capacities = tuple(remote_capacities[r] for r in regions)
    return RemoteRoute(
        local_engine_id=local_engine_id,
        remote_engine_id=remote_engine_id,
        members=layout.members,
        regions=regions,
        block_lens=tuple(remote_block_lens[r] for r in regions),
        capacities=capacities,
        descriptor_starts=_starts(capacities),
        num_remote_regions=n,
        by_member=by_member,
    )
