"""Framework core: the public model-based test helper and the differential test
against `transitions` (issue 2, items 8 and 9)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.testing import (
    TransitionCoverage,
    machine_test_case,
    run_model_test,
    to_transitions_machine,
)

from core_example import LEASE, Chain, LeaseCtx, StartWrite

EXAMPLE_CONTEXT = st.lists(st.integers(0, 9), max_size=2)


def test_core_model_based_full_transition_coverage() -> None:
    coverage = run_model_test(LEASE, context=FIELDS, max_examples=150)
    assert not coverage.missing()


FIELDS = st.fixed_dictionaries({"blocks": EXAMPLE_CONTEXT})

TestExampleLeaseModel = machine_test_case(LEASE, context=FIELDS).TestCase


def test_core_coverage_report_names_missing_transitions() -> None:
    coverage = TransitionCoverage(LEASE)
    coverage.add([("finished", StartWrite.trigger, "writing")])
    with pytest.raises(AssertionError, match=r"never: writing --write_done--> sent"):
        coverage.assert_complete()


def test_core_user_invariant_failure_is_reported() -> None:
    def never_writing(inst: Any) -> None:
        assert not inst.has("in_flight"), "writing reached"

    with pytest.raises(AssertionError, match="writing reached"):
        run_model_test(
            LEASE,
            context=st.just({"blocks": [1]}),
            invariants=[never_writing],
            require_full_coverage=False,
            max_examples=100,
        )


class _Model:
    def __init__(self, blocks: list[int]) -> None:
        self.ctx = LeaseCtx("k", blocks)
        self.state = ""


@settings(max_examples=200, deadline=None)
@given(
    blocks=EXAMPLE_CONTEXT,
    # "chain" emits a follow-up event through an effect, which the reference does not run.
    events=st.lists(
        st.sampled_from(sorted(LEASE.events - {Chain}, key=lambda e: e.trigger)), max_size=12
    ),
)
def test_core_differential_against_transitions(
    blocks: list[int], events: list[type[Event]]
) -> None:
    """The compiled runtime and a transitions.Machine agree after any event sequence."""
    _differential(LEASE, blocks, events)


def _differential(
    decl: Declaration[LeaseCtx], blocks: list[int], events: list[type[Event]]
) -> None:
    bus = EventBus()
    bus.register(decl)
    bus.handle(Effect, lambda inst, effect: None)
    inst = bus.create(decl, LeaseCtx("k", list(blocks)), 0.0)
    reference = _Model(list(blocks))
    to_transitions_machine(decl, reference)
    for cls in events:
        if inst.node.final:
            break
        event = cls()
        ours_ok = _try(lambda e=event: bus.dispatch(decl, "k", e, 0.0))
        theirs_ok = _try(lambda e=event: reference.trigger(e.trigger, event=e))
        assert inst.state == reference.state, (event, inst.state, reference.state)
        assert ours_ok == theirs_ok, event


def _try(call: Any) -> bool:
    from transitions.core import MachineError

    try:
        result = call()
    except (LocalProtocolError, RemoteProtocolError, MachineError):
        return False
    return result is not False
