"""Which prefill rank writes into which decode rank, and how much (R-T03, R-T04).

Push mode moves KV from every rank of the prefill engine (P: `tp` x `pp` ranks) into the
ranks of the decode engine (D: `tp` ranks; decode-side PP is not supported, R-P14). The
mapping is vLLM 0.33's (`compute_tp_mapping`, local = P, remote = D), for KV heads split
evenly over the TP ranks of each side:

- P's TP at least D's (`k = P.tp / D.tp`): P rank `p` writes its whole block into one D
  rank, `p // k`, as chunk `p % k` of D's `k`-times larger block; D rank `d` hears from
  the `k` P ranks `d*k .. d*k+k-1` of every stage.
- P's TP below D's (`k = D.tp / P.tp`): P rank `p` splits its block into `k` chunks and
  writes chunk `j` (a whole block of D's) into D rank `p*k + j`: one WRITE per target
  rank; D rank `d` hears from P rank `d // k` of every stage.

A PP producer's stages each own a slice of the layers (member routing, R-P14), so D
hears from every stage: D expects `pp x max(1, P.tp / D.tp)` completions, vLLM's count.
Ranks are numbered globally as `pp_rank * tp_size + tp_rank`. TP sizes where neither
divides the other are refused.

Pull mode (B-09) moves the same bytes the other way: D rank `d` READs from each P rank
what that rank would have written into it (`read_sources`, the mirror of
`write_targets`), and each P rank waits for one completion notif per D rank reading from
it, `max(1, D.tp / P.tp)` (`reads_per_producer`, vLLM 0.33's count). Pull reads from a
prefill engine without pipeline parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvhandoff.protocol.errors import RemoteProtocolError

__all__ = [
    "Chunk",
    "ReadSource",
    "WriteTarget",
    "check_tp_sizes",
    "completions_expected",
    "global_rank",
    "read_sources",
    "reads_per_producer",
    "split_rank",
    "target_ranks",
    "write_targets",
    "writers_of",
]


@dataclass(frozen=True, slots=True)
class Chunk:
    """Part `index` of a block cut into `count` equal parts (`Chunk(0, 1)`: the block)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"chunk {self.index} of {self.count} does not exist")

    @property
    def whole(self) -> bool:
        return self.count == 1

    def span(self, block_len: int) -> tuple[int, int]:
        """(offset, length) of this chunk in a block of `block_len` bytes."""
        length = block_len // self.count
        return self.index * length, length


WHOLE = Chunk()


@dataclass(frozen=True, slots=True)
class WriteTarget:
    """One WRITE of a P rank: into D rank `d_rank`, from `local` of P's block into
    `remote` of D's block."""

    d_rank: int
    local: Chunk = WHOLE
    remote: Chunk = WHOLE


@dataclass(frozen=True, slots=True)
class ReadSource:
    """One READ of a D rank in pull mode: from P rank `p_rank`, `remote` of P's block into
    `local` of D's block."""

    p_rank: int
    local: Chunk = WHOLE
    remote: Chunk = WHOLE


def check_tp_sizes(p_tp: int, d_tp: int, *, peer: str | None = None) -> None:
    """Refuse TP sizes that do not map evenly onto each other."""
    if p_tp < 1 or d_tp < 1:
        raise RemoteProtocolError(
            f"TP sizes must be positive, got P {p_tp} and D {d_tp}", peer=peer
        )
    if max(p_tp, d_tp) % min(p_tp, d_tp):
        raise RemoteProtocolError(
            f"prefill TP {p_tp} and decode TP {d_tp} do not divide each other", peer=peer
        )


def global_rank(pp_rank: int, tp_rank: int, tp_size: int) -> int:
    return pp_rank * tp_size + tp_rank


def split_rank(rank: int, tp_size: int) -> tuple[int, int]:
    """(pp_rank, tp_rank) of a global rank."""
    return divmod(rank, tp_size)


@lru_cache(maxsize=256)
def write_targets(p_tp: int, p_tp_rank: int, d_tp: int) -> tuple[WriteTarget, ...]:
    """The D ranks P TP rank `p_tp_rank` writes into, each with its chunks (memoised: a
    pure function of three sizes, asked on every push; bad sizes raise and are not kept)."""
    check_tp_sizes(p_tp, d_tp)
    if not 0 <= p_tp_rank < p_tp:
        raise ValueError(f"P TP rank {p_tp_rank} is not below P TP {p_tp}")
    if p_tp >= d_tp:
        k = p_tp // d_tp
        return (WriteTarget(p_tp_rank // k, WHOLE, Chunk(p_tp_rank % k, k)),)
    k = d_tp // p_tp
    return tuple(WriteTarget(p_tp_rank * k + j, Chunk(j, k), WHOLE) for j in range(k))


@lru_cache(maxsize=256)
def target_ranks(p_tp: int, p_tp_rank: int, d_tp: int) -> frozenset[int]:
    """The D ranks of `write_targets`, as a set."""
    return frozenset(t.d_rank for t in write_targets(p_tp, p_tp_rank, d_tp))


@lru_cache(maxsize=256)
def writers_of(d_rank: int, d_tp: int, p_tp: int, p_pp: int) -> tuple[int, ...]:
    """The global P ranks (every stage) that write into D rank `d_rank` (memoised like
    `write_targets`: asked for every registration, on D's rank and on its writer)."""
    check_tp_sizes(p_tp, d_tp)
    if not 0 <= d_rank < d_tp:
        raise ValueError(f"D rank {d_rank} is not below D TP {d_tp}")
    if p_tp >= d_tp:
        k = p_tp // d_tp
        tps: tuple[int, ...] = tuple(range(d_rank * k, d_rank * k + k))
    else:
        tps = (d_rank // (d_tp // p_tp),)
    return tuple(global_rank(pp, tp, p_tp) for pp in range(p_pp) for tp in tps)


@lru_cache(maxsize=256)
def read_sources(d_tp: int, d_tp_rank: int, p_tp: int) -> tuple[ReadSource, ...]:
    """The P ranks D TP rank `d_tp_rank` READs from in pull mode, each with its chunks: for
    every P rank that would write into it in push mode, the same chunk pair the other way
    round (memoised like `write_targets`)."""
    return tuple(
        ReadSource(p_rank, local=target.remote, remote=target.local)
        for p_rank in writers_of(d_tp_rank, d_tp, p_tp, 1)
        for target in write_targets(p_tp, p_rank, d_tp)
        if target.d_rank == d_tp_rank
    )


def reads_per_producer(p_tp: int, d_tp: int) -> int:
    """Pull mode: the READs (and so completion notifs) one P rank waits for, one per D
    rank that reads from it: `max(1, D.tp / P.tp)` (vLLM 0.33's count)."""
    check_tp_sizes(p_tp, d_tp)
    return max(1, d_tp // p_tp)


def completions_expected(d_tp: int, p_tp: int, p_pp: int) -> int:
    """Completion notifs one D rank waits for: `pp x max(1, P.tp / D.tp)` (vLLM 0.33)."""
    return p_pp * max(1, p_tp // d_tp)
