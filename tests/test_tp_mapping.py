"""The TP rank mapping, both directions (R-T03, B-09): which P rank's heads land in which
D rank, checked against a model of the heads themselves.

A model engine splits H heads evenly over its TP ranks; a rank's block holds its heads in
order, so a `Chunk(j, k)` of it is the j-th of k equal runs of those heads. Push WRITEs
each P rank's chunks into D's (`write_targets`); pull READs D's from P's
(`read_sources`). Either way every D rank must end up holding exactly its own heads, each
once, and each P rank must await one completion per D rank that reads from it.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.protocol.tp_mapping import (
    Chunk,
    read_sources,
    reads_per_producer,
    write_targets,
    writers_of,
)

SIZES = st.sampled_from([1, 2, 4, 8])


def _heads(tp: int, rank: int, heads: int) -> list[int]:
    share = heads // tp
    return list(range(rank * share, (rank + 1) * share))


def _chunk(held: list[int], chunk: Chunk) -> list[int]:
    size = len(held) // chunk.count
    return held[chunk.index * size : (chunk.index + 1) * size]


def _place(block: list[int | None], chunk: Chunk, values: list[int]) -> None:
    size = len(block) // chunk.count
    start = chunk.index * size
    assert all(v is None for v in block[start : start + size]), "a chunk landed twice"
    block[start : start + size] = values


@given(p_tp=SIZES, d_tp=SIZES)
def test_R_T03_push_writes_every_d_rank_exactly_its_heads(p_tp: int, d_tp: int) -> None:
    heads = 8
    d_blocks: list[list[int | None]] = [[None] * (heads // d_tp) for _ in range(d_tp)]
    for p in range(p_tp):
        for target in write_targets(p_tp, p, d_tp):
            values = _chunk(_heads(p_tp, p, heads), target.local)
            _place(d_blocks[target.d_rank], target.remote, values)
    assert d_blocks == [_heads(d_tp, d, heads) for d in range(d_tp)]


@given(p_tp=SIZES, d_tp=SIZES)
def test_B09_R_T03_pull_reads_into_every_d_rank_exactly_its_heads(p_tp: int, d_tp: int) -> None:
    heads = 8
    readers = dict.fromkeys(range(p_tp), 0)
    for d in range(d_tp):
        block: list[int | None] = [None] * (heads // d_tp)
        sources = read_sources(d_tp, d, p_tp)
        assert {s.p_rank for s in sources} == set(writers_of(d, d_tp, p_tp, 1))
        for source in sources:
            _place(block, source.local, _chunk(_heads(p_tp, source.p_rank, heads), source.remote))
            readers[source.p_rank] += 1
        assert block == _heads(d_tp, d, heads), (p_tp, d_tp, d)
    # Each P rank awaits as many completion notifs as D ranks read from it (vLLM 0.33).
    assert readers == dict.fromkeys(range(p_tp), reads_per_producer(p_tp, d_tp))
