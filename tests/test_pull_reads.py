"""Pull mode's READs from a D rank (B-09, R-T03): one READ per P rank it reads from, and
what happens when only some of them post.

D at TP 1 reads from P at TP 2: both P ranks' head shares land in halves of D's blocks,
one READ each. When the second READ fails to post after the first did, the receive fails,
but only once the first READ ended: D's blocks are reused only after every READ into
them is over. A D that found part of the prefix cached reads only the tail of P's blocks
it lacks (R-T05). The transport is the in-memory stand-in (no bytes move; what is posted,
where, is the point here); the bytes are checked over real NIXL in
`test_push_topology_processes.py` and under vLLM in `tests_vllm/test_vllm_connector_tp.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvhandoff.adapters.nixl.errors import NixlTransferError
from kvhandoff.adapters.push_side import PushSide
from kvhandoff.adapters.push_transport import EngineInfo, RankInfo
from kvhandoff.bench.probes.push_writer_pass import (
    D_AGENT,
    P_AGENT,
    MemoryTransport,
    _Handle,
    connect_deferred,
)
from kvhandoff.machines.push.scheduler import LocalEngine
from kvhandoff.protocol.legs import PrefillCoordinates, pull_params
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk

P_TP = 2


@dataclass
class _Reads(MemoryTransport):
    """D's side of a TP-2 prefill engine: READs are noted and stay in flight until the
    test ends them; READs from `refuse_rank` fail to post."""

    refuse_rank: int | None = None
    reads: list[tuple[int, tuple[int, ...], tuple[int, ...], Chunk, Chunk, _Handle]] = field(
        default_factory=list
    )

    def engine(self, engine_id: str) -> EngineInfo | None:
        if engine_id != self.peer_engine:
            return None
        ranks = tuple(RankInfo(r, f"{self.peer_agent}-{r}", 1, self.capacity) for r in range(P_TP))
        return EngineInfo(self.peer_engine, P_TP, 1, frozenset(), ranks)

    def read_blocks(
        self,
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        *,
        local_chunk: Chunk = WHOLE,
        remote_chunk: Chunk = WHOLE,
    ) -> _Handle:
        if rank == self.refuse_rank:
            raise NixlTransferError("read", "injected post failure")
        handle = _Handle(notif)
        read = (rank, tuple(local_block_ids), tuple(remote_block_ids))
        self.reads.append((*read, local_chunk, remote_chunk, handle))
        return handle

    def poll(self, handle: object) -> str:  # type: ignore[override]
        assert isinstance(handle, _Handle)
        return handle.xfer_status


def _decode(refuse_rank: int | None) -> tuple[PushSide, _Reads]:
    transport = _Reads("D", D_AGENT, "P", P_AGENT, 1024, refuse_rank=refuse_rank)
    side = PushSide(
        "decode", LocalEngine("D", "127.0.0.1", 5700), transport, lambda job: None, mode="pull"
    )
    return side, transport


def _read(
    side: PushSide, request_id: str, blocks: list[int], p_blocks: list[int] | None = None
) -> None:
    prefill = PrefillCoordinates("P", "127.0.0.1", 5600, P_TP)
    params = {"do_remote_prefill": True, **pull_params(prefill, "p-req-1", p_blocks or [7, 8])}
    side.update_state_after_alloc(request_id, blocks, params)
    side.step()
    side.writer_pass()
    connect_deferred(side.ranks[0])
    side.writer_pass()


def test_B09_R_T03_d_reads_each_p_rank_share_into_its_half_of_the_blocks() -> None:
    side, transport = _decode(refuse_rank=None)
    _read(side, "d-req-1", [3, 4])
    assert [(r[0], r[1], r[2], r[3], r[4]) for r in transport.reads] == [
        (0, (3, 4), (7, 8), Chunk(0, 2), Chunk()),
        (1, (3, 4), (7, 8), Chunk(1, 2), Chunk()),
    ]
    assert {r[5].notif for r in transport.reads} == {b"p-req-1:1"}, "D's TP on each READ"
    assert not side.step().finished_recving, "both READs in flight"
    transport.reads[0][5].xfer_status = "DONE"
    assert not side.step().finished_recving, "one READ still in flight"
    transport.reads[1][5].xfer_status = "DONE"
    out = side.step()
    assert out.finished_recving == {"d-req-1"} and not out.failed_recving


def test_B09_a_read_that_fails_to_post_beside_a_posted_one_fails_after_it_ended() -> None:
    side, transport = _decode(refuse_rank=1)
    _read(side, "d-req-2", [5, 6])
    assert [r[0] for r in transport.reads] == [0], "rank 0's READ posted, rank 1's refused"
    for _ in range(3):
        out = side.step()
        assert not out.finished_recving and not out.failed_recving, "rank 0's READ in flight"
    transport.reads[0][5].xfer_status = "DONE"
    out = side.step()
    assert out.failed_recving == {"d-req-2": "pull read failed"}, out
    assert out.invalid_block_ids == {5, 6}, "its blocks are load errors"


def test_B09_R_T05_a_partial_prefix_hit_reads_only_the_tail_d_lacks() -> None:
    """D found the first of three blocks cached: it passes vLLM only the two it lacks,
    and reads them from the tail of P's three (as vLLM's pull connector does)."""
    side, transport = _decode(refuse_rank=None)
    _read(side, "d-req-3", [11, 12], p_blocks=[7, 8, 9])
    assert [(r[0], r[1], r[2]) for r in transport.reads] == [
        (0, (11, 12), (8, 9)),
        (1, (11, 12), (8, 9)),
    ]


def test_B09_a_read_of_more_blocks_than_p_holds_fails_cleanly() -> None:
    side, transport = _decode(refuse_rank=None)
    _read(side, "d-req-4", [11, 12, 13], p_blocks=[7, 8])
    assert transport.reads == [], "nothing posted"
    out = side.step()
    assert out.failed_recving == {"d-req-4": "pull read failed"}
    assert out.invalid_block_ids == {11, 12, 13}
