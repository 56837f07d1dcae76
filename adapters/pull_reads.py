"""What one D rank READs in pull mode (B-09, R-T03, R-T05): the remote ranks and chunks
it routes, and, for one request, the physical blocks it reads from each P rank.

Pure functions over the peer's handshake (`EngineInfo`); the writer thread posts the
READs (`RankWriterSide._issue_read`). Every refusal is a `KvHandoffError` naming the
request, raised before any READ is posted.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvhandoff.adapters.push_transport import EngineInfo, Routes
from kvhandoff.protocol.blocks import check_within_capacity, expand_to_physical
from kvhandoff.protocol.errors import KvHandoffError, RemoteProtocolError
from kvhandoff.protocol.legs import PullSource
from kvhandoff.protocol.tp_mapping import ReadSource, check_tp_sizes, read_sources

__all__ = ["plan_reads", "read_routes"]


def read_routes(tp_size: int, tp_rank: int, engine_tp: int) -> Routes:
    """The P ranks D TP rank `tp_rank` reads from, with (local, remote) chunks per block."""
    check_tp_sizes(engine_tp, tp_size)
    return {
        r.p_rank: (r.local.count, r.remote.count) for r in read_sources(tp_size, tp_rank, engine_tp)
    }


def plan_reads(
    request_id: str,
    block_ids: Sequence[int],
    source: PullSource,
    info: EngineInfo | None,
    *,
    tp_size: int,
    tp_rank: int,
    physical_blocks_per_logical: int,
) -> tuple[list[int], list[tuple[ReadSource, list[int]]]]:
    """D's physical blocks and, per P rank read from, P's physical blocks: the tail of P's
    that D lacks (R-T05), checked against P's handshake (TP, one stage, capacity)."""
    engine = source.prefill.engine_id
    if info is None:
        raise KvHandoffError(f"no connected agents for {engine}")
    if (info.tp_size, info.pp_size) != (source.prefill.tp_size, 1):
        raise RemoteProtocolError(
            f"{engine} runs TP {info.tp_size} x PP {info.pp_size}; pull reads from"
            f" one stage of TP {source.prefill.tp_size}",
            peer=engine,
        )
    lacking = len(block_ids)
    if lacking > len(source.block_ids):
        raise RemoteProtocolError(
            f"{request_id} lacks {lacking} blocks here, {source.request_id}"
            f" names {len(source.block_ids)} on {engine}",
            peer=engine,
        )
    remote_logical = source.block_ids[len(source.block_ids) - lacking :]
    local = expand_to_physical(block_ids, physical_blocks_per_logical)
    plan: list[tuple[ReadSource, list[int]]] = []
    for read in read_sources(tp_size, tp_rank, info.tp_size):
        rank = info.ranks[read.p_rank]
        remote = expand_to_physical(remote_logical, rank.physical_blocks_per_logical)
        check_within_capacity(source.request_id, remote, rank.capacity, engine_id=engine)
        if len(local) != len(remote):
            raise RemoteProtocolError(
                f"{request_id} holds {len(local)} physical blocks here,"
                f" {source.request_id} names {len(remote)} on {engine}"
            )
        plan.append((read, remote))
    return local, plan
