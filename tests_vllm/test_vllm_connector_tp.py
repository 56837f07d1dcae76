"""kvhandoff's connector at TP sizes other than one on both sides, under two real vLLM 0.33
Schedulers over real NIXL (R-T03, B-09): each worker-role connector in its own
process with its own NIXL agent, vLLM's `KVOutputAggregator` counting the ranks.

- Mixed TP (R-T03): P at TP=2 -> D at TP=1 (each P rank writes its head share into half of
  D's block; D's rank completes after both reported) and P at TP=1 -> D at TP=2 (P's rank
  splits each block and writes one WRITE per D rank).
- Pull with two ranks per engine (B-09): TP 2 -> 2, and the mixed sizes 2 -> 1 and 1 -> 2,
  each D rank READing its head share from the P ranks that hold it (`read_sources`), each
  P rank freeing its lease once every D rank reading from it sent its completion notif.
  Pull with pipeline parallelism is refused when the connector is built.

Each D rank's bytes are checked against what its P writers computed
(`vllm_harness.block_values`); both schedulers end with every block free.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from connector_engines import BLOCK, Engine, engines, pull_transfer, transfer

pytestmark = pytest.mark.integration

LENGTHS = {"a": 4 * BLOCK + 3, "b": 2 * BLOCK, "c": 9 * BLOCK + 1}  # one chunked prefill


def _ids(prefix: str) -> dict[str, int]:
    return {f"cmpl-{prefix}-{name}-0": length for name, length in LENGTHS.items()}


@pytest.fixture
def p_tp2_d_tp1(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 2, 1)


@pytest.fixture
def p_tp1_d_tp2(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 1, 2)


def test_R_T03_p_tp2_into_d_tp1_through_the_connector(
    p_tp2_d_tp1: tuple[Engine, Engine],
) -> None:
    """P's two ranks each push their head share into D's one rank; D's rank reports a
    request received only once both halves of every block landed."""
    prefill, decode = p_tp2_d_tp1
    assert (len(prefill.workers), len(decode.workers)) == (2, 1)
    transfer(prefill, decode, _ids("p2d1"))


def test_R_T03_p_tp1_into_d_tp2_through_the_connector(
    p_tp1_d_tp2: tuple[Engine, Engine],
) -> None:
    """P's one rank splits every block into D's two head shares, one WRITE per D rank;
    vLLM hears of a request once both D ranks reported it."""
    prefill, decode = p_tp1_d_tp2
    assert (len(prefill.workers), len(decode.workers)) == (1, 2)
    transfer(prefill, decode, _ids("p1d2"))


@pytest.fixture
def pull_tp2(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 2, 2, mode="pull")


@pytest.fixture
def pull_p_tp2_d_tp1(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 2, 1, mode="pull")


@pytest.fixture
def pull_p_tp1_d_tp2(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 1, 2, mode="pull")


def test_B_09_R_T02_pull_with_two_ranks_per_engine_through_the_connector(
    pull_tp2: tuple[Engine, Engine],
) -> None:
    """Each D rank READs its head share from the P rank that holds it; each P rank frees
    its lease on its one completion notif, vLLM frees P's blocks once both ranks did."""
    prefill, decode = pull_tp2
    assert (len(prefill.workers), len(decode.workers)) == (2, 2)
    pull_transfer(prefill, decode, _ids("pull22"))


def test_B_09_R_T03_pull_p_tp2_into_d_tp1_through_the_connector(
    pull_p_tp2_d_tp1: tuple[Engine, Engine],
) -> None:
    """D's one rank READs both P ranks' head shares into the halves of its blocks; each P
    rank frees its lease on D's one completion notif."""
    prefill, decode = pull_p_tp2_d_tp1
    assert (len(prefill.workers), len(decode.workers)) == (2, 1)
    pull_transfer(prefill, decode, _ids("pull21"))


def test_B_09_R_T03_pull_p_tp1_into_d_tp2_through_the_connector(
    pull_p_tp1_d_tp2: tuple[Engine, Engine],
) -> None:
    """Each D rank READs its half of P's one rank's blocks; P's rank frees its lease only
    after both D ranks' completion notifs (vLLM 0.33's count, D.tp / P.tp)."""
    prefill, decode = pull_p_tp1_d_tp2
    assert (len(prefill.workers), len(decode.workers)) == (1, 2)
    pull_transfer(prefill, decode, _ids("pull12"))


def test_B_09_pull_with_pipeline_parallelism_is_refused_when_the_connector_is_built(
    tiny_model_dir: Path,
) -> None:
    """Pull reads from one stage: vLLM's Scheduler building kvhandoff's scheduler-role
    connector at PP=2 with `transfer_mode: pull` fails at once, naming the limit, before
    any worker or NIXL agent starts (push mode routes a PP producer's stages, R-T04)."""
    from kvhandoff.protocol.errors import LocalProtocolError

    import vllm_harness

    config = vllm_harness.vllm_config(
        tiny_model_dir,
        kv_connector="KVHandoffConnector",
        kv_connector_module_path="kvhandoff.integrations.vllm",
        kv_role="kv_producer",
        extra_config={"transfer_mode": "pull"},
    )
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(LocalProtocolError, match="pull mode runs without pipeline parallelism"):
        vllm_harness.scheduler(config)
