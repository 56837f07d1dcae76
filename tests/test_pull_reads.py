"""Pull mode's READs from a D rank (B-09, R-T03): one READ per P rank it reads from, and
what happens when only some of them post.

D at TP 1 reads from P at TP 2: both P ranks' head shares land in halves of D's blocks,
one READ each. When the second READ fails to post after the first did, the receive fails,
but only once the first READ ended: D's blocks are reused only after every READ into
them is over. A D that found part of the prefix cached reads only the tail of P's blocks
it lacks (R-T05). A READ seen done after P's lease may have ended (the deadline a
kvhandoff P puts on its params, less the clocks' skew) fails: P may have reused the
blocks it read. The transport is the in-memory stand-in (no bytes move; what is posted,
where, is the point here); the bytes are checked over real NIXL in
`test_push_topology_processes.py` and under vLLM in `tests_vllm/test_vllm_connector_tp.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

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
from kvhandoff.machines.push.scheduler import LocalEngine, PushScheduler
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.legs import LEASE_EXPIRES_KEY, PrefillCoordinates, pull_params, pull_source
from kvhandoff.protocol.push_config import PushConfig
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


def _decode(refuse_rank: int | None, wall: list[float] | None = None) -> tuple[PushSide, _Reads]:
    """D at TP 1 over the stand-in; `wall` is its wall clock (moved by the test)."""
    clock = wall if wall is not None else [5000.0]
    transport = _Reads("D", D_AGENT, "P", P_AGENT, 1024, refuse_rank=refuse_rank)
    side = PushSide(
        "decode",
        LocalEngine("D", "127.0.0.1", 5700),
        transport,
        lambda job: None,
        mode="pull",
        wall=lambda: clock[0],
    )
    return side, transport


def _read(
    side: PushSide,
    request_id: str,
    blocks: list[int],
    p_blocks: list[int] | None = None,
    lease_expires_at: float | None = None,
) -> None:
    prefill = PrefillCoordinates("P", "127.0.0.1", 5600, P_TP)
    returned = pull_params(prefill, "p-req-1", p_blocks or [7, 8], lease_expires_at)
    params = {"do_remote_prefill": True, **returned}
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


def test_B09_a_read_seen_done_before_p_s_lease_deadline_is_received() -> None:
    """P's params say when its lease may end at the earliest; a READ seen done before
    that, less the clocks' skew (`sealed_notif_skew`, 5 s by default), is taken."""
    wall = [5000.0]
    side, transport = _decode(refuse_rank=None, wall=wall)
    _read(side, "d-req-5", [3], p_blocks=[7], lease_expires_at=wall[0] + 30.0)
    wall[0] += 24.0  # 29 s before P's deadline less 5 s of skew: in time
    for read in transport.reads:
        read[5].xfer_status = "DONE"
    assert side.step().finished_recving == {"d-req-5"}


def test_B09_a_read_seen_done_after_p_s_lease_may_have_ended_fails() -> None:
    """P may have reaped the lease and reused the blocks by then: what the READ read is
    not taken as received; the receive fails, its blocks load errors (recomputed)."""
    wall = [5000.0]
    side, transport = _decode(refuse_rank=None, wall=wall)
    _read(side, "d-req-6", [3], p_blocks=[7], lease_expires_at=wall[0] + 30.0)
    wall[0] += 26.0  # past P's deadline less the skew
    for read in transport.reads:
        read[5].xfer_status = "DONE"
    out = side.step()
    assert not out.finished_recving
    assert out.failed_recving == {"d-req-6": "pull read done after P's lease may have ended"}
    assert out.invalid_block_ids == {3}


def test_B09_p_s_lease_deadline_travels_on_the_params_and_is_checked() -> None:
    prefill = PrefillCoordinates("P", "127.0.0.1", 5600, 1)
    params = {"do_remote_prefill": True, **pull_params(prefill, "p-1", [1], 1234.5)}
    assert params[LEASE_EXPIRES_KEY] == 1234.5
    assert pull_source(params).lease_expires_at == 1234.5
    no_deadline = {"do_remote_prefill": True, **pull_params(prefill, "p-1", [1])}
    assert LEASE_EXPIRES_KEY not in no_deadline, "as a stock vLLM P: no deadline, no check"
    assert pull_source(no_deadline).lease_expires_at is None
    for bad in ("soon", True, float("nan"), float("inf"), [1.0]):
        with pytest.raises(RemoteProtocolError, match=LEASE_EXPIRES_KEY):
            pull_source({**params, LEASE_EXPIRES_KEY: bad})


def test_B09_p_names_its_lease_deadline_from_its_wall_clock() -> None:
    """P's `request_finished` in pull mode: its wall clock now plus `kv_lease_duration`
    (its ranks' leases start at the next step, so none ends earlier)."""
    p = PushScheduler("prefill", LocalEngine("P", "127.0.0.1", 5600), mode="pull")
    _delay, params = p.request_finished("p-2", [4], {"do_remote_decode": True}, 0.0, wall=100.0)
    assert params is not None and params[LEASE_EXPIRES_KEY] == 100.0 + 30.0
    _delay, params = p.request_finished("p-3", [], {"do_remote_decode": True}, 0.0, wall=100.0)
    assert params is not None and LEASE_EXPIRES_KEY not in params, "no blocks, no lease"


def test_B09_pull_refuses_a_lease_no_longer_than_the_clocks_skew() -> None:
    """D takes a READ only if it is done within P's lease less the clocks' skew: a lease
    of 5 s against 5 s of skew would fail every READ, so the scheduler says so when built."""
    config = PushConfig(kv_lease_duration=5.0, sealed_notif_skew=5.0)
    with pytest.raises(LocalProtocolError, match="kv_lease_duration"):
        PushScheduler("decode", LocalEngine("D", "127.0.0.1", 5700), config, "pull")
    PushScheduler("decode", LocalEngine("D", "127.0.0.1", 5700), config, "push")  # push: fine
