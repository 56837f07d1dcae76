"""Model-based tests of the vLLM connector's machines, full transition coverage (C-05)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st

from kvhandoff.machines.catalog import VLLM_DECLARATIONS
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.vllm.owed_report import (
    VLLM_OWED_REPORT,
    EngineEndedUnheld,
    OwedReportCtx,
    Reported,
    Told,
)
from kvhandoff.machines.vllm.rank_receive import VLLM_RANK_RECEIVE, RankReceiveCtx
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.testing import run_model_test

DIRECTIONS = st.sampled_from(["recv", "send"])


def owed_tags(inst: Instance[OwedReportCtx]) -> None:
    """Every live instance is owed to vLLM exactly once; only a waiting one can end."""
    assert inst.has("owed")
    assert inst.has("engine_waiting") == (inst.state == "owed")
    assert sum(inst.has(tag) for tag in ("engine_waiting", "ending", "due")) == 1


def test_C_05_owed_report_model() -> None:
    coverage = run_model_test(
        VLLM_OWED_REPORT,
        max_examples=80,
        context=st.fixed_dictionaries({"direction": DIRECTIONS}),
        payloads={Reported: st.builds(Reported, DIRECTIONS)},
        invariants=[owed_tags],
    )
    assert not coverage.missing()


def receive_tags(inst: Instance[RankReceiveCtx]) -> None:
    assert inst.has("receiving") != inst.has("load_errors_owed")


def test_R_P12_rank_receive_model() -> None:
    coverage = run_model_test(
        VLLM_RANK_RECEIVE,
        max_examples=40,
        context=st.fixed_dictionaries(
            {"block_ids": st.lists(st.integers(0, 99), max_size=3, unique=True).map(tuple)}
        ),
        invariants=[receive_tags],
    )
    assert not coverage.missing()


def test_every_vllm_machine_has_a_model_test() -> None:
    tests = [name for name in globals() if name.startswith("test_") and name.endswith("_model")]
    assert len(tests) == len(VLLM_DECLARATIONS)


@pytest.mark.parametrize("direction", ["recv", "send"])
def test_C_05_an_id_reaches_vllm_once_and_never_after_it_was_told(direction: Any) -> None:
    """What vLLM asserts, by construction: a second report, one of the other direction,
    and one after the instance was told are refused, and nothing changes."""
    bus = EventBus()
    bus.register(VLLM_OWED_REPORT)
    bus.create(VLLM_OWED_REPORT, OwedReportCtx("r1", direction), 0.0)
    other = "send" if direction == "recv" else "recv"
    with pytest.raises(RemoteProtocolError):
        bus.dispatch(VLLM_OWED_REPORT, "r1", Reported(other), 0.0)
    assert bus.has_tag(VLLM_OWED_REPORT, "r1", "owed")
    bus.dispatch(VLLM_OWED_REPORT, "r1", Reported(direction), 0.0)
    assert bus.get(VLLM_OWED_REPORT, "r1") is None
    with pytest.raises(RemoteProtocolError):
        bus.dispatch(VLLM_OWED_REPORT, "r1", Reported(direction), 0.0)
    assert bus.counters(VLLM_OWED_REPORT).rejected == 2


def test_C_05_an_ended_request_is_told_once() -> None:
    bus = EventBus()
    bus.register(VLLM_OWED_REPORT)
    bus.create(VLLM_OWED_REPORT, OwedReportCtx("r1", "recv"), 0.0)
    bus.dispatch(VLLM_OWED_REPORT, "r1", EngineEndedUnheld(), 0.0)
    assert [inst.key for inst in bus.tagged(VLLM_OWED_REPORT, "due")] == ["r1"]
    bus.dispatch(VLLM_OWED_REPORT, "r1", Told(), 0.0)
    assert bus.live(VLLM_OWED_REPORT) == 0
