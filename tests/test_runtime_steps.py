"""The generated steps (`machines/runtime/steps.py`) do what the bus's general step does.

Two ways: the scheduler's D and P lifecycles driven by Hypothesis through the same event
sequences on two buses, one running the generated steps and one the general step, with
every observable compared after each event (state, context, armed deadline, watched
tags, effects handled and left in the outbox, counters, and the error raised); and the
deterministic simulator's push, pull and encoder-cache worlds run seed for seed both ways
(every machine of those worlds, every fault), with equal verdicts.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.machines.kv.effects import ReportFailedRecving, ReportReleased, ReportTransferred
from kvhandoff.machines.kv.events import (
    Abort,
    Drained,
    RankEnded,
    RankPosted,
    RankReceived,
    RankRecvFailed,
    RankSent,
)
from kvhandoff.machines.push.d_request import D_REQUEST, DRequestCtx
from kvhandoff.machines.push.p_request import P_REQUEST, PRequestCtx
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import CompiledMachine
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.errors import KvHandoffError

RANKS = 3
KEYS = ("a", "b")


def _no_step(machine: CompiledMachine[Any], node: Any, event: type[Event]) -> None:
    return None  # every route takes the general step


class _Side:
    """One bus with the scheduler's two kinds, watched as the scheduler watches them."""

    def __init__(self, generated: bool) -> None:
        self.bus = EventBus()
        self.bus.register(D_REQUEST, {"push_registration_timeout": 5.0})
        self.bus.register(P_REQUEST)
        self.bus.watch(D_REQUEST, "ending")
        self.bus.watch(D_REQUEST, "given_up")
        self.handled: list[tuple[str, object]] = []
        for effect in (ReportTransferred, ReportFailedRecving, ReportReleased):
            self.bus.handle(effect, self._handler)
        self.machines = [self.bus.machine(D_REQUEST), self.bus.machine(P_REQUEST)]
        for machine in self.machines:
            assert machine.generate
            machine.generate = generated

    def stepped(self) -> int:
        """Generated steps written so far."""
        return sum(len(node.steps) for m in self.machines for node in m.nodes.values())

    def _handler(self, inst: Any, effect: object) -> None:
        self.handled.append((inst.key, effect))

    def observe(self) -> object:
        bus = self.bus
        seen: list[object] = []
        for kind in (D_REQUEST, P_REQUEST):
            for inst in bus.instances(kind):
                ctx = inst.ctx
                fields = {name: getattr(ctx, name) for name in ctx.__slots__}
                seen.append((kind.name, inst.key, inst.state, fields, inst.timer is not None))
                seen.append(bus.deadline_of(kind, inst.key))
            seen.append(bus.counters(kind))
        seen.append([inst.key for inst in bus.tagged(D_REQUEST, "ending")])
        seen.append([inst.key for inst in bus.tagged(D_REQUEST, "given_up")])
        seen.append(self.handled)
        seen.append([(i.key if i else None, e) for i, e in bus.outbox])
        seen.append(dict(bus.metrics))
        return seen


D_EVENTS = st.one_of(
    st.just(Drained()),
    st.just(Abort()),
    st.builds(RankPosted, st.integers(0, RANKS)),
    st.builds(RankReceived, st.integers(0, RANKS)),
    st.builds(RankRecvFailed, st.integers(0, RANKS), st.sampled_from(["", "lost"])),
    st.builds(RankEnded, st.integers(0, RANKS)),
)
P_EVENTS = st.one_of(st.just(Drained()), st.builds(RankSent, st.integers(0, RANKS)))
ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("d"), st.sampled_from(KEYS), D_EVENTS),
        st.tuples(st.just("p"), st.sampled_from(KEYS), P_EVENTS),
        st.tuples(st.just("new"), st.sampled_from(KEYS), st.integers(1, RANKS)),
        st.tuples(st.just("wait"), st.just(""), st.floats(0.5, 4.0)),
    ),
    max_size=40,
)


def _apply(side: _Side, action: tuple[str, str, Any], now: float) -> object:
    what, key, arg = action
    bus = side.bus
    try:
        if what == "new":
            if bus.get(D_REQUEST, key) is None:
                bus.create(D_REQUEST, DRequestCtx(key, (1, 2), ranks=arg, since=now), now)
            if bus.get(P_REQUEST, key) is None:
                bus.create(P_REQUEST, PRequestCtx(key, (3,), ranks=arg, since=now), now)
        elif what == "wait":
            bus.advance(now)
        else:
            event: Event = arg
            kind = D_REQUEST if what == "d" else P_REQUEST
            bus.dispatch(kind, key, event, now)
    except KvHandoffError as exc:
        return (type(exc).__name__, str(exc))
    return None


@settings(max_examples=300, deadline=None)
@given(ACTIONS)
def test_core_generated_steps_match_the_general_step_event_by_event(
    actions: list[tuple[str, str, Any]],
) -> None:
    generated, general = _Side(generated=True), _Side(generated=False)
    now = 0.0
    for action in actions:
        if action[0] == "wait":
            now += action[2]
        outcomes = [_apply(side, action, now) for side in (generated, general)]
        assert outcomes[0] == outcomes[1], action
        assert generated.observe() == general.observe(), action
    assert general.stepped() == 0, "the general side wrote a generated step"


def _verdicts(seeds: range) -> list[dict[str, Any]]:
    from kvhandoff.sim.run import SimulateOptions, _ec_world, _push_world

    options = SimulateOptions()
    out = []
    for seed in seeds:
        out.append(asdict(_push_world(seed, options, record=False).run()))
        out.append(asdict(_push_world(seed, options, record=False, pull=True).run()))
        out.append(asdict(_ec_world(seed, options, record=False).run()))
    return out


def test_core_generated_steps_match_the_general_step_in_the_simulator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Twelve seeds of each world, every fault on: the same verdicts, counters included,
    whichever step ran (and the generated ones did run)."""
    logging.disable(logging.CRITICAL)
    try:
        written: list[int] = []
        step_for = CompiledMachine.step_for

        def counting(machine: CompiledMachine[Any], node: Any, event: type[Event]) -> Any:
            step = step_for(machine, node, event)
            written.append(step is not None)
            return step

        monkeypatch.setattr(CompiledMachine, "step_for", counting)
        seeds = range(12)
        fast = _verdicts(seeds)
        assert sum(written) > 1000, "the generated steps were not written"
        monkeypatch.setattr(CompiledMachine, "step_for", _no_step)
        slow = _verdicts(seeds)
    finally:
        logging.disable(logging.NOTSET)
    assert fast == slow
    assert sum(v["completed"] for v in fast) > 0


def test_core_a_generated_step_shows_its_source_in_tracebacks() -> None:
    """An error raised under a generated step names the step and shows its line (the
    source is in `linecache`), as a hand-written function's traceback would."""
    import traceback

    bus = EventBus()
    bus.register(D_REQUEST)

    def broken(_inst: Any, _effect: object) -> None:
        raise RuntimeError("handler failed")

    bus.handle(ReportTransferred, broken)
    bus.create(D_REQUEST, DRequestCtx("r", (1,)), 0.0)
    bus.dispatch(D_REQUEST, "r", Drained(), 0.0)
    with pytest.raises(RuntimeError) as caught:
        bus.dispatch(D_REQUEST, "r", RankReceived(0), 0.0)
    frames = traceback.extract_tb(caught.value.__traceback__)
    step = [f for f in frames if f.filename.startswith("<kvhandoff step push.d_request.awaiting.")]
    assert step, [f.filename for f in frames]
    assert step[-1].line == "handler(inst, effect)"
