"""Framework core: `dispatch_many` is a loop of `dispatch` over a batch (issue 26's
batch-first hot path), with the batch's refusals returned instead of raised."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

from core_example import LEASE, Chain, Heartbeat, LeaseCtx, StartWrite, WriteDone


@dataclass(frozen=True, slots=True)
class Step(Event):
    pass


@dataclass(frozen=True, slots=True)
class Late(Event):
    pass


@dataclass(slots=True)
class HopCtx:
    key: str


HOP: Declaration[HopCtx] = Declaration(
    name="example.hop",
    context=HopCtx,
    description="Plain routes only: the bus's fast path.",
    states=[
        {"name": "a", "timeout": Timeout(3.0, "gone", Late)},
        {"name": "b", "timeout": Timeout(7.0, "gone", Late)},
        {"name": "c", "timeout": Timeout(2.0, "gone", Late)},
        {"name": "gone", "final": True},
    ],
    initial="a",
    transitions=[
        {"trigger": Step, "source": "a", "dest": "b"},
        {"trigger": Step, "source": "b", "dest": "c"},
    ],
)


def _bus() -> EventBus:
    bus = EventBus()
    bus.register(LEASE)
    bus.register(HOP)
    return bus


def _snapshot(bus: EventBus) -> dict[str, Any]:
    return {
        kind.name: {
            str(inst.key): (inst.state, bus.deadline_of(kind, inst.key))
            for inst in bus.instances(kind)
        }
        for kind in (LEASE, HOP)
    } | {
        "counters": [bus.counters(LEASE), bus.counters(HOP)],
        "outbox": [(None if i is None else i.key, e) for i, e in bus.drain_outbox()],
        "metrics": dict(bus.metrics),
    }


_EVENTS = st.sampled_from([StartWrite(), WriteDone(), Heartbeat(), Chain(), Step()])


@settings(max_examples=200, deadline=None)
@given(
    script=st.lists(
        st.tuples(
            _EVENTS,
            st.lists(st.sampled_from(["k0", "k1", "k2", "k3", "ghost"]), max_size=6),
            st.floats(0.0, 4.0),
        ),
        max_size=8,
    )
)
def test_core_dispatch_many_does_what_a_loop_of_dispatch_does(
    script: list[tuple[Event, list[str], float]],
) -> None:
    """Same states, deadlines, effects and counters as one `dispatch` per key; the keys a
    loop would have failed on (no live instance, a peer's event refused) are the ones
    returned, with the same error class; a local error of a live instance raises and
    stops the batch where the loop stops."""
    batched, looped = _bus(), _bus()
    for bus in (batched, looped):
        for i in range(4):
            bus.create(LEASE, LeaseCtx(f"k{i}", [i] if i % 2 else []), 0.0)
            bus.create(HOP, HopCtx(f"k{i}"), 0.0)
    now = 0.0
    for event, keys, later in script:
        now += later
        kind = HOP if isinstance(event, Step) else LEASE
        looped.advance(now)  # the batch's one time step, taken even when it is empty
        expected: list[tuple[str, type[Exception]]] = []
        raised = False
        for key in keys:
            live = looped.get(kind, key) is not None
            try:
                looped.dispatch(kind, key, event, now)
            except RemoteProtocolError as exc:
                expected.append((key, type(exc)))
            except LocalProtocolError as exc:
                if live:  # a local error of a live instance stops the batch too
                    raised = True
                    break
                expected.append((key, type(exc)))
        if raised:
            with pytest.raises(LocalProtocolError):
                batched.dispatch_many(kind, keys, event, now)
        else:
            refused = batched.dispatch_many(kind, keys, event, now)
            assert [(key, type(exc)) for key, exc in refused] == expected
        assert _snapshot(batched) == _snapshot(looped)


def test_core_dispatch_many_raises_a_local_error_for_an_unregistered_kind() -> None:
    bus = EventBus()
    with pytest.raises(LocalProtocolError, match="not registered"):
        bus.dispatch_many(HOP, ["a"], Step(), 0.0)


def test_core_dispatch_many_fires_due_timeouts_once_before_the_batch() -> None:
    bus = _bus()
    for key in ("x", "y"):
        bus.create(HOP, HopCtx(key), 0.0)
    bus.dispatch(HOP, "x", Step(), 1.0)  # x in b until 8.0; y in a until 3.0
    refused = bus.dispatch_many(HOP, ["x", "y"], Step(), 5.0)
    assert [key for key, _ in refused] == ["y"], "y timed out at 3.0, before the batch"
    assert bus.get(HOP, "x") is not None and bus.get(HOP, "x").state == "c"  # type: ignore[union-attr]
