"""R-P14: member-major layouts and member routing for PP-sharded / hybrid KV caches."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    HandshakePayload,
    compatibility_hash,
    decode_handshake,
    encode_handshake,
)
from kvhandoff.protocol.member_routing import (
    LocalRegion,
    MemberLayout,
    RemoteRoute,
    check_pipeline_support,
    derive_member_major_layout,
    route_remote_regions,
)

P, D = "engine-P", "engine-D"


def _route(
    layout: MemberLayout,
    members: list[tuple[str, ...]],
    block_lens: list[int] | None = None,
    capacities: list[int] | None = None,
) -> RemoteRoute:
    n = len(members)
    return route_remote_regions(
        layout,
        members,
        block_lens if block_lens is not None else [64] * n,
        capacities if capacities is not None else [8] * n,
        local_engine_id=P,
        remote_engine_id=D,
        peer="peer-D",
    )


def _stage1_layout() -> MemberLayout:
    """P is PP stage 1 of 2: it owns layers 2 and 3; layers 2 and 3 share one tensor."""
    return derive_member_major_layout(
        [
            LocalRegion(0x1000, ("layers.2.attn",), 128, 10),
            LocalRegion(0x1000, ("layers.3.attn",), 128, 10),
        ],
        pp_size=2,
    )


# --- examples ---------------------------------------------------------------------


def test_R_P14_shared_allocation_is_registered_once() -> None:
    layout = _stage1_layout()
    assert len(layout.allocations) == 1
    assert layout.allocations[0].members == ("layers.2.attn", "layers.3.attn")
    assert layout.region_members == (("layers.2.attn", "layers.3.attn"),)
    assert layout.members == ("layers.2.attn", "layers.3.attn")
    assert [s.allocation for s in layout.slots] == [0, 0]
    assert layout.needs_member_routing


def test_R_P14_pp_sharded_producer_routes_by_member_and_ignores_remote_only_members() -> None:
    layout = _stage1_layout()
    remote_members = [
        ("layers.3.attn",),
        ("layers.0.attn", "layers.1.attn"),  # stage 0's members: remote-only, ignored
        ("layers.2.attn",),
    ]
    route = _route(layout, remote_members, block_lens=[256, 512, 1024], capacities=[40, 50, 60])
    assert route.by_member
    assert route.members == ("layers.2.attn", "layers.3.attn")
    assert route.regions == (2, 0)
    assert route.block_lens == (1024, 256)
    assert route.capacities == (60, 40)
    assert route.pick([0xA000, 0xB000, 0xC000]) == (0xC000, 0xA000)


def test_R_P14_descriptor_offsets_use_each_members_own_capacity() -> None:
    layout = derive_member_major_layout(
        [LocalRegion(0x1000, ("a",), 64, 10), LocalRegion(0x9000, ("b",), 64, 4)], pp_size=2
    )
    route = _route(layout, [("b",), ("a",)], capacities=[7, 30])
    # Local: a has 10 blocks, b has 4. Remote (D allocated differently): a 30, b 7.
    assert layout.block_descriptor_offset(0, 9) == 9
    assert layout.block_descriptor_offset(1, 3) == 13
    assert layout.num_descriptors == 14
    assert route.block_descriptor_offset(0, 29) == 29
    assert route.block_descriptor_offset(1, 6) == 36


@pytest.mark.parametrize(("member_idx", "block_id"), [(0, 10), (1, 4), (2, 0), (-1, 0), (0, -1)])
def test_R_P14_descriptor_offset_out_of_range_is_a_local_error(
    member_idx: int, block_id: int
) -> None:
    layout = derive_member_major_layout(
        [LocalRegion(0x1000, ("a",), 64, 10), LocalRegion(0x9000, ("b",), 64, 4)]
    )
    with pytest.raises(LocalProtocolError):
        layout.block_descriptor_offset(member_idx, block_id)


def test_R_P14_pick_needs_one_value_per_remote_region() -> None:
    route = _route(_stage1_layout(), [("layers.2.attn", "layers.3.attn"), ("x",)])
    with pytest.raises(LocalProtocolError, match="expected 2 per-region values"):
        route.pick([1, 2, 3])


def test_R_P14_missing_member_fails_naming_member_and_engines() -> None:
    with pytest.raises(RemoteProtocolError) as info:
        _route(_stage1_layout(), [("layers.2.attn",), ("layers.0.attn",)])
    message = str(info.value)
    assert "'layers.3.attn'" in message
    assert "not advertised" in message
    assert repr(P) in message
    assert repr(D) in message
    assert info.value.peer == "peer-D"


@pytest.mark.parametrize(
    "remote_members",
    [
        [("layers.2.attn", "layers.3.attn"), ("layers.3.attn",)],
        [("layers.2.attn", "layers.3.attn", "layers.3.attn")],
    ],
)
def test_R_P14_duplicated_member_fails_naming_member_and_engines(
    remote_members: list[tuple[str, ...]],
) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        _route(_stage1_layout(), remote_members)
    message = str(info.value)
    assert "'layers.3.attn'" in message
    assert "advertised 2 times" in message
    assert repr(P) in message
    assert repr(D) in message


def test_R_P14_member_routing_without_remote_metadata_fails_without_index_fallback() -> None:
    layout = _stage1_layout()
    with pytest.raises(RemoteProtocolError) as info:
        route_remote_regions(layout, [], [128], [10], local_engine_id=P, remote_engine_id=D)
    message = str(info.value)
    assert "refusing to fall back to index routing" in message
    assert repr(P) in message
    assert repr(D) in message
    assert "'layers.2.attn'" in message


def test_R_P14_layout_without_pp_falls_back_to_index_routing() -> None:
    layout = derive_member_major_layout(
        [LocalRegion(0x1000, ("a",), 64, 10), LocalRegion(0x9000, ("b", "c"), 64, 4)]
    )
    route = route_remote_regions(
        layout, [], [32, 16], [5, 6], local_engine_id=P, remote_engine_id=D
    )
    assert not route.by_member
    assert route.regions == (0, 1, 1)
    assert route.capacities == (5, 6, 6)
    with pytest.raises(RemoteProtocolError, match="index routing needs equal counts"):
        route_remote_regions(layout, [], [32], [5], local_engine_id=P, remote_engine_id=D)


def test_R_P14_layout_without_pp_still_routes_by_member_when_advertised() -> None:
    layout = derive_member_major_layout(
        [LocalRegion(0x1000, ("a",), 64, 10), LocalRegion(0x9000, ("b",), 64, 4)]
    )
    assert _route(layout, [("b",), ("a",)]).regions == (1, 0)


def test_R_P14_remote_per_region_lists_must_agree() -> None:
    with pytest.raises(RemoteProtocolError, match="2 block lengths, 1 capacities"):
        route_remote_regions(
            _stage1_layout(),
            [("layers.2.attn", "layers.3.attn"), ("x",)],
            [1, 2],
            [3],
            local_engine_id=P,
            remote_engine_id=D,
        )


@pytest.mark.parametrize(
    ("regions", "expected"),
    [
        ([], "no regions"),
        ([LocalRegion(0, ("a",), 64, 4), LocalRegion(64, ("a",), 64, 4)], "'a' appears twice"),
        ([LocalRegion(0, ("a", "a"), 64, 4)], "'a' appears twice"),
        ([LocalRegion(0, ("a",), 64, 4), LocalRegion(0, ("b",), 32, 4)], "block_len/num_blocks"),
        ([LocalRegion(0, ("a",), 64, 4), LocalRegion(0, ("b",), 64, 5)], "block_len/num_blocks"),
        ([LocalRegion(0, (), 64, 4)], "non-empty members"),
        ([LocalRegion(0, ("",), 64, 4)], "non-empty members"),
        ([LocalRegion(0, ("a",), 0, 4)], "block_len >= 1"),
        ([LocalRegion(0, ("a",), 64, 0)], "num_blocks >= 1"),
        ([LocalRegion(-1, ("a",), 64, 4)], "base_addr >= 0"),
    ],
)
def test_R_P14_bad_local_layouts_are_local_errors(
    regions: list[LocalRegion], expected: str
) -> None:
    with pytest.raises(LocalProtocolError, match=expected):
        derive_member_major_layout(regions)


def test_R_P14_decode_side_pp_is_rejected() -> None:
    with pytest.raises(LocalProtocolError, match="decode-side pipeline parallelism"):
        check_pipeline_support(is_decoder=True, pp_size=2, has_ssm_layers=False)
    with pytest.raises(LocalProtocolError, match="decode-side pipeline parallelism"):
        derive_member_major_layout([LocalRegion(0, ("a",), 8, 1)], pp_size=2, is_decoder=True)


def test_R_P14_mamba_under_pp_is_rejected() -> None:
    with pytest.raises(LocalProtocolError, match="Mamba/SSM"):
        check_pipeline_support(is_decoder=False, pp_size=4, has_ssm_layers=True)
    with pytest.raises(LocalProtocolError, match="Mamba/SSM"):
        derive_member_major_layout([LocalRegion(0, ("a",), 8, 1)], pp_size=2, has_ssm_layers=True)


def test_R_P14_supported_parallel_layouts_pass() -> None:
    assert check_pipeline_support(is_decoder=True, pp_size=1, has_ssm_layers=True) is None
    assert check_pipeline_support(is_decoder=False, pp_size=8, has_ssm_layers=False) is None
    with pytest.raises(LocalProtocolError, match="must be >= 1"):
        check_pipeline_support(is_decoder=False, pp_size=0, has_ssm_layers=False)


def test_R_P14_members_travel_in_the_handshake_and_route_on_the_other_side() -> None:
    """D advertises its layout in the handshake; P routes from the decoded payload."""
    d_layout = derive_member_major_layout(
        [
            LocalRegion(0x5000, ("layers.0", "layers.2"), 256, 90),
            LocalRegion(0x9000, ("layers.1",), 256, 90),
            LocalRegion(0x5000, ("layers.3",), 256, 90),
        ],
        is_decoder=True,
    )
    payload = HandshakePayload(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION,
        engine_id=D,
        agent_name="agent-D",
        agent_metadata=b"meta",
        tp_size=1,
        tp_rank=0,
        kv_block_lens=tuple(a.block_len for a in d_layout.allocations),
        num_blocks=tuple(a.num_blocks for a in d_layout.allocations),
        region_base_addrs=tuple(a.base_addr for a in d_layout.allocations),
        physical_blocks_per_logical=1,
        backend="UCX",
        compatibility_hash=compatibility_hash("v", "m", "bf16", 16),
        region_members=d_layout.region_members,
    )
    remote = decode_handshake(encode_handshake(payload))
    p_layout = derive_member_major_layout(
        [LocalRegion(0x100, ("layers.3",), 512, 20), LocalRegion(0x200, ("layers.2",), 512, 20)],
        pp_size=2,
    )
    route = route_remote_regions(
        p_layout,
        remote.region_members,
        remote.kv_block_lens,
        remote.num_blocks,
        local_engine_id=P,
        remote_engine_id=remote.engine_id,
    )
    assert route.regions == (0, 0)
    assert route.pick(remote.region_base_addrs) == (0x5000, 0x5000)
    assert route.block_descriptor_offset(1, 5) == 95


# --- properties over random layouts -----------------------------------------------


@dataclass(frozen=True)
class Scenario:
    local_regions: list[LocalRegion]
    local_groups: list[list[str]]
    remote_members: list[tuple[str, ...]]
    remote_block_lens: list[int]
    remote_capacities: list[int]


def _split(draw: st.DrawFn, items: list[str]) -> list[list[str]]:
    """Cut ``items`` into consecutive non-empty groups at random points."""
    cuts = draw(st.lists(st.booleans(), min_size=len(items) - 1, max_size=len(items) - 1))
    groups, current = [], [items[0]]
    for item, cut in zip(items[1:], cuts, strict=True):
        if cut:
            groups.append(current)
            current = []
        current.append(item)
    return [*groups, current]


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    names = draw(st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=12, unique=True))
    n_local = draw(st.integers(1, len(names)))
    local_names, remote_only = names[:n_local], names[n_local:]

    local_groups = _split(draw, draw(st.permutations(local_names)))
    local_regions = []
    for i, group in enumerate(local_groups):
        block_len, capacity = draw(st.integers(1, 4096)), draw(st.integers(1, 6))
        # A shared allocation may be listed once per member set backed by it.
        for piece in _split(draw, group):
            local_regions.append(LocalRegion(0x10000 * (i + 1), tuple(piece), block_len, capacity))
    local_regions = draw(st.permutations(local_regions))

    remote_groups = _split(draw, draw(st.permutations(local_names + remote_only)))
    remote_members = [tuple(g) for g in draw(st.permutations(remote_groups))]

    def per_remote_region(values: st.SearchStrategy[int]) -> st.SearchStrategy[list[int]]:
        return st.lists(values, min_size=len(remote_members), max_size=len(remote_members))

    return Scenario(
        local_regions=list(local_regions),
        local_groups=local_groups,
        remote_members=remote_members,
        remote_block_lens=draw(per_remote_region(st.integers(1, 4096))),
        remote_capacities=draw(per_remote_region(st.integers(1, 6))),
    )


def _route_scenario(s: Scenario, layout: MemberLayout | None = None) -> RemoteRoute:
    return route_remote_regions(
        layout or derive_member_major_layout(s.local_regions, pp_size=2),
        s.remote_members,
        s.remote_block_lens,
        s.remote_capacities,
        local_engine_id=P,
        remote_engine_id=D,
    )


@settings(deadline=None)
@given(scenarios())
def test_R_P14_layout_registers_each_allocation_once_with_all_its_members(s: Scenario) -> None:
    layout = derive_member_major_layout(s.local_regions, pp_size=2)
    bases = [a.base_addr for a in layout.allocations]
    assert len(bases) == len(set(bases)) == len(s.local_groups)
    assert sorted(layout.members) == sorted(itertools.chain.from_iterable(s.local_groups))
    for alloc in layout.allocations:
        listed = [r for r in s.local_regions if r.base_addr == alloc.base_addr]
        assert alloc.members == tuple(itertools.chain.from_iterable(r.members for r in listed))
    for slot in layout.slots:
        alloc = layout.allocations[slot.allocation]
        assert slot.name in alloc.members
        assert (slot.base_addr, slot.block_len, slot.num_blocks) == (
            alloc.base_addr,
            alloc.block_len,
            alloc.num_blocks,
        )


@settings(deadline=None)
@given(scenarios())
def test_R_P14_routed_order_pairs_every_local_member_with_its_remote_region(
    s: Scenario,
) -> None:
    layout = derive_member_major_layout(s.local_regions, pp_size=2)
    route = _route_scenario(s, layout)
    assert route.by_member
    assert route.members == layout.members
    for m, name in enumerate(route.members):
        region = route.regions[m]
        assert name in s.remote_members[region]
        assert route.block_lens[m] == s.remote_block_lens[region]
        assert route.capacities[m] == s.remote_capacities[region]


@settings(deadline=None)
@given(scenarios(), st.randoms(use_true_random=False))
def test_R_P14_member_order_depends_on_the_local_layout_alone(
    s: Scenario, rnd: random.Random
) -> None:
    """Shuffling the remote's regions changes the chosen indices, never the member order."""
    layout = derive_member_major_layout(s.local_regions, pp_size=2)
    order = list(range(len(s.remote_members)))
    rnd.shuffle(order)
    shuffled = Scenario(
        local_regions=s.local_regions,
        local_groups=s.local_groups,
        remote_members=[s.remote_members[i] for i in order],
        remote_block_lens=[s.remote_block_lens[i] for i in order],
        remote_capacities=[s.remote_capacities[i] for i in order],
    )
    first, second = _route_scenario(s, layout), _route_scenario(shuffled, layout)
    assert first.members == second.members == layout.members
    assert [order[r] for r in second.regions] == list(first.regions)
    assert first.capacities == second.capacities
    assert first.block_lens == second.block_lens


@settings(deadline=None)
@given(scenarios())
def test_R_P14_descriptor_offsets_tile_each_descriptor_list_exactly(s: Scenario) -> None:
    layout = derive_member_major_layout(s.local_regions, pp_size=2)
    route = _route_scenario(s, layout)
    for side, capacities in ((layout, layout.capacities), (route, route.capacities)):
        offsets = [
            side.block_descriptor_offset(m, b)
            for m, cap in enumerate(capacities)
            for b in range(cap)
        ]
        assert offsets == list(range(sum(capacities)))
    assert layout.num_descriptors == sum(layout.capacities)


@settings(deadline=None)
@given(scenarios(), st.data())
def test_R_P14_a_member_the_remote_omits_fails_the_handshake(
    s: Scenario, data: st.DataObject
) -> None:
    layout = derive_member_major_layout(s.local_regions, pp_size=2)
    victim = data.draw(st.sampled_from(layout.members))
    members, lens, caps = [], [], []
    for group, block_len, capacity in zip(
        s.remote_members, s.remote_block_lens, s.remote_capacities, strict=True
    ):
        remaining = tuple(name for name in group if name != victim)
        if remaining:  # a region left without members is not advertised at all
            members.append(remaining)
            lens.append(block_len)
            caps.append(capacity)
    with pytest.raises(RemoteProtocolError) as info:
        route_remote_regions(layout, members, lens, caps, local_engine_id=P, remote_engine_id=D)
    message = str(info.value)
    assert repr(victim) in message
    assert repr(P) in message and repr(D) in message


@settings(deadline=None)
@given(scenarios(), st.data())
def test_R_P14_a_member_the_remote_advertises_twice_fails_the_handshake(
    s: Scenario, data: st.DataObject
) -> None:
    layout = derive_member_major_layout(s.local_regions, pp_size=2)
    victim = data.draw(st.sampled_from(layout.members))
    target = data.draw(st.integers(0, len(s.remote_members) - 1))
    remote = list(s.remote_members)
    remote[target] = (*remote[target], victim)
    with pytest.raises(RemoteProtocolError) as info:
        route_remote_regions(
            layout,
            remote,
            s.remote_block_lens,
            s.remote_capacities,
            local_engine_id=P,
            remote_engine_id=D,
        )
    message = str(info.value)
    assert repr(victim) in message
    assert "advertised 2 times" in message
    assert repr(P) in message and repr(D) in message


@settings(deadline=None)
@given(scenarios())
def test_R_P14_routing_ignores_remote_only_members(s: Scenario) -> None:
    """Adding a region backed only by another stage's members changes nothing we route."""
    route = _route_scenario(s)
    extended = Scenario(
        local_regions=s.local_regions,
        local_groups=s.local_groups,
        remote_members=[*s.remote_members, ("\x00other-stage-only",)],
        remote_block_lens=[*s.remote_block_lens, 1],
        remote_capacities=[*s.remote_capacities, 1],
    )
    assert _route_scenario(extended).regions == route.regions
