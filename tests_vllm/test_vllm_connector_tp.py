"""kvhandoff's connector at TP sizes other than one on both sides, under two real vLLM 0.33
Schedulers over real NIXL (R-T03, B-09): each worker-role connector in its own
process with its own NIXL agent, vLLM's `KVOutputAggregator` counting the ranks.

- Mixed TP (R-T03): P at TP=2 -> D at TP=1 (each P rank writes its head share into half of
  D's block; D's rank completes after both reported) and P at TP=1 -> D at TP=2 (P's rank
  splits each block and writes one WRITE per D rank).
- Pull with two ranks per engine (B-09) is refused when the connector is built: pull
  runs one worker rank per engine for now.

Each D rank's bytes are checked against what its P writers computed
(`vllm_harness.block_values`); both schedulers end with every block free.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from connector_engines import BLOCK, Engine, engines, transfer

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


def test_B_09_pull_with_two_ranks_per_engine_is_refused_when_the_connector_is_built(
    tiny_model_dir: Path,
) -> None:
    """Pull mode runs one worker rank per engine (not yet more): vLLM's Scheduler building
    kvhandoff's scheduler-role connector at TP=2 with `transfer_mode: pull` fails at once,
    naming the limit, before any worker or NIXL agent starts. (The D rank's READ is routed
    to P's rank 0 only, and P's lease counts one completion per rank; both would have to
    follow the TP mapping first.)"""
    from kvhandoff.protocol.errors import LocalProtocolError

    import vllm_harness

    config = vllm_harness.vllm_config(
        tiny_model_dir,
        kv_connector="KVHandoffConnector",
        kv_connector_module_path="kvhandoff.integrations.vllm",
        kv_role="kv_consumer",
        extra_config={"transfer_mode": "pull"},
    )
    config.parallel_config.tensor_parallel_size = 2
    with pytest.raises(LocalProtocolError, match="pull mode runs one worker rank per engine"):
        vllm_harness.scheduler(config)
