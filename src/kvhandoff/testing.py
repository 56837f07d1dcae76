"""Model-based testing of declared machines with Hypothesis (public API).

For any declaration, `machine_test_case` builds a `RuleBasedStateMachine` whose rules

- fire an event legal in the current state (with a payload drawn from the strategy you
  give for that event), expecting the declared destination or a guard's refusal;
- fire an event the state does not declare, expecting `LocalProtocolError` and no change;
- fire an event the state explicitly ignores, expecting no change and no error;
- advance the virtual clock and fire due timeouts;

and after every step checks the runtime's own invariants (a timer is armed exactly in
states that declare a timeout, never in the past of an unchanged state) and yours.

`TransitionCoverage` accumulates the transitions taken across all examples; its
`assert_complete()` fails naming every declared transition that never ran.

    coverage = TransitionCoverage(LEASE)
    LeaseModel = machine_test_case(LEASE, coverage=coverage)
    TestLease = LeaseModel.TestCase          # collected by pytest / unittest

    def test_lease_coverage():               # or call run_model_test(LEASE)
        run_state_machine_as_test(LeaseModel)
        coverage.assert_complete()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
    run_state_machine_as_test,
)

from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Emit
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

Invariant = Callable[[Instance[Any]], None]
Payloads = Mapping[type[Event], st.SearchStrategy[Event]]


class TransitionCoverage:
    """The declared transitions of one machine that model-based runs have exercised."""

    def __init__(self, decl: Declaration[Any]) -> None:
        self.decl = decl
        self.declared = decl.edges()
        self.seen: set[tuple[str, str, str]] = set()

    def add(self, edges: Sequence[tuple[str, str, str]] | frozenset[tuple[str, str, str]]) -> None:
        self.seen.update(edges)

    def missing(self) -> list[tuple[str, str, str]]:
        return sorted(self.declared - self.seen)

    def report(self) -> str:
        done = len(self.declared & self.seen)
        lines = [f"{self.decl.name}: {done}/{len(self.declared)} transitions exercised"]
        lines += [f"  never: {s} --{e}--> {d}" for s, e, d in self.missing()]
        return "\n".join(lines)

    def assert_complete(self) -> None:
        if self.missing():
            raise AssertionError(self.report())


def machine_test_case(
    decl: Declaration[Any],
    *,
    config: Mapping[str, float] | None = None,
    context: st.SearchStrategy[Mapping[str, Any]] | None = None,
    payloads: Payloads | None = None,
    invariants: Sequence[Invariant] = (),
    coverage: TransitionCoverage | None = None,
    max_clock_step: float | None = None,
) -> type[RuleBasedStateMachine]:
    """A Hypothesis state machine exercising one instance of `decl` at a time.

    `context` draws the fields (besides `key`) each new instance's context is built
    with; `payloads` maps an event class to the strategy its events are drawn from
    (default: `st.builds(cls)`, from the class's annotations); `invariants` are called
    with the live instance after every step; `coverage` collects taken edges.
    """
    payload_for = _payload_strategies(decl, payloads)
    fields_strategy: st.SearchStrategy[Mapping[str, Any]] = (
        context if context is not None else st.just({})
    )
    all_events = sorted(decl.events, key=_trigger)

    class MachineModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.clock = VirtualClock()
            self.bus = EventBus()
            self.machine = self.bus.register(decl, config)
            self.emitted: list[Emit] = []
            self.bus.handle(Emit, lambda _inst, effect: self.emitted.append(effect))
            self.serial = 0
            self.inst: Instance[Any] | None = None
            self.step = max_clock_step or _default_step(self.machine.nodes.values())

        def _live(self, data: st.DataObject) -> Instance[Any]:
            """The instance under test; a new one once the last reached a final state."""
            inst = self.inst
            if inst is None or self.bus.get(decl, inst.key) is not inst:
                self.serial += 1
                fields = data.draw(fields_strategy, label="context")
                ctx = decl.new_context(f"{decl.name}-{self.serial}", fields)
                inst = self.bus.create(decl, ctx, self.clock.now)
                self.inst = inst
            return inst

        @rule(data=st.data())
        def fire_legal_event(self, data: st.DataObject) -> None:
            inst = self._live(data)
            events = sorted(inst.node.on, key=_trigger)
            if not events:
                return
            cls = data.draw(st.sampled_from(events), label="event")
            event = data.draw(payload_for[cls], label="payload")
            before = inst.node
            try:
                self.bus.dispatch(decl, inst.key, event, self.clock.now)
            except (LocalProtocolError, RemoteProtocolError) as exc:
                assert "no guard admits" in str(exc), str(exc)
                assert isinstance(exc, RemoteProtocolError) == event.from_peer, repr(exc)
                assert inst.node is before, "a refused event must not change state"

        @rule(data=st.data())
        def fire_undeclared_event(self, data: st.DataObject) -> None:
            inst = self._live(data)
            node = inst.node
            illegal = [e for e in all_events if e not in node.on and e not in node.ignored]
            if not illegal:
                return
            cls = data.draw(st.sampled_from(illegal), label="undeclared")
            event = data.draw(payload_for[cls], label="payload")
            expected = RemoteProtocolError if event.from_peer else LocalProtocolError
            try:
                self.bus.dispatch(decl, inst.key, event, self.clock.now)
            except (LocalProtocolError, RemoteProtocolError) as exc:
                message = str(exc)
                assert type(exc) is expected, f"{cls.__name__} must raise {expected.__name__}"
                assert decl.name in message and node.name in message and cls.trigger in message
            else:
                raise AssertionError(f"{cls.__name__} in {node.name!r} must raise")
            assert inst.node is node, "an undeclared event must not change state"

        @rule(data=st.data())
        def fire_ignored_event(self, data: st.DataObject) -> None:
            inst = self._live(data)
            node = inst.node
            if not node.ignored:
                return
            cls = data.draw(st.sampled_from(sorted(node.ignored, key=_trigger)), label="ignored")
            event = data.draw(payload_for[cls], label="payload")
            self.bus.dispatch(decl, inst.key, event, self.clock.now)
            assert inst.node is node, "an ignored event must not change state"

        # Mostly small steps, so deep paths survive; sometimes past every timeout.
        @rule(fraction=st.one_of(st.floats(0.0, 0.01), st.floats(0.0, 1.0)))
        def advance_clock(self, fraction: float) -> None:
            self.clock.advance(fraction * self.step)
            self.bus.fire_due(self.clock.now)

        @invariant()
        def runtime_invariants(self) -> None:
            inst = self.inst
            if inst is None:
                return
            if self.bus.get(decl, inst.key) is not inst:
                assert inst.node.final, "only final states leave the bus"
                assert inst.timer is None, "a retired instance keeps no timer"
                return
            armed = inst.timer is not None
            assert armed == (inst.node.timeout_seconds is not None), (
                f"timer armed={armed} in state {inst.node.name!r}"
            )
            if inst.timer is not None:
                assert inst.timer[0] >= self.clock.now, "a due timeout was not fired"
            for check in invariants:
                check(inst)

        def teardown(self) -> None:
            if coverage is not None:
                coverage.add(self.machine.taken_edges())

    MachineModel.__name__ = f"{_camel(decl.name)}Model"
    MachineModel.__qualname__ = MachineModel.__name__
    return MachineModel


def run_model_test(
    decl: Declaration[Any],
    *,
    max_examples: int = 200,
    require_full_coverage: bool = True,
    derandomize: bool = True,
    **options: Any,
) -> TransitionCoverage:
    """Run the model-based test of `decl` and, by default, demand full transition coverage.

    Derandomized by default, so a coverage verdict is the same on every run; pass
    `derandomize=False` to explore new sequences each time.
    """
    coverage = TransitionCoverage(decl)
    model = machine_test_case(decl, coverage=coverage, **options)
    run_state_machine_as_test(
        model,
        settings=settings(
            max_examples=max_examples,
            stateful_step_count=40,
            deadline=None,
            derandomize=derandomize,
            database=None,
        ),
    )
    if coverage.missing():
        _tour_missing_edges(decl, coverage, options)
    if require_full_coverage:
        coverage.assert_complete()
    return coverage


def _tour_missing_edges(
    decl: Declaration[Any], coverage: TransitionCoverage, options: Mapping[str, Any]
) -> None:
    """Drive a fresh instance along a shortest event path into each edge still missing.

    Random walks rarely reach deep edges guarded by several steps; the tour reaches them
    deterministically, with the simplest context and payloads the strategies allow.
    """
    from hypothesis import find
    from hypothesis.errors import NoSuchExample

    context = options.get("context")
    fields = find(context, lambda _: True) if context is not None else {}
    strategies = _payload_strategies(decl, options.get("payloads"))
    simplest: dict[type[Event], Event] = {}
    by_trigger = {cls.trigger: cls for cls in decl.events}

    def walk(events: Sequence[Event]) -> frozenset[tuple[str, str, str]]:
        """A fresh instance driven through `events`: the edges it took (a guard refusing
        on the way ends the walk)."""
        bus = EventBus()
        machine = bus.register(decl, options.get("config"))
        bus.handle(Emit, lambda _inst, _effect: None)
        bus.create(decl, decl.new_context("tour", dict(fields)), 0.0)
        try:
            for event in events:
                bus.dispatch(decl, "tour", event, 0.0)
        except (LocalProtocolError, RemoteProtocolError):
            pass  # a guard refused on this path: leave the edge to the random runs
        return machine.taken_edges()

    for edge in coverage.missing():
        source, trigger, _dest = edge
        path = _shortest_path(decl, source)
        if path is None:
            continue
        classes = [*path, by_trigger[trigger]]
        for cls in classes:
            if cls not in simplest:
                simplest[cls] = find(strategies[cls], lambda _: True)
        taken = walk([simplest[cls] for cls in classes])
        if edge not in taken:
            # The simplest payloads' guards refuse a step: search the payloads along the
            # path for ones they admit (derandomized: the same verdict on every run).
            def admitted(drawn: tuple[Event, ...], edge: tuple[str, str, str] = edge) -> bool:
                return edge in walk(drawn)

            try:
                events = find(
                    st.tuples(*(strategies[cls] for cls in classes)),
                    admitted,
                    settings=settings(max_examples=300, derandomize=True, database=None),
                )
            except NoSuchExample:
                events = ()
            if events:
                taken = walk(events)
        coverage.add(taken)


def _shortest_path(decl: Declaration[Any], target: str) -> list[type[Event]] | None:
    frontier: list[tuple[str, list[type[Event]]]] = [(decl.initial_state, [])]
    seen = {decl.initial_state}
    while frontier:
        state, path = frontier.pop(0)
        if state == target:
            return path
        for t in decl.transition_decls:
            if t.source == state and t.dest is not None and t.dest not in seen:
                seen.add(t.dest)
                frontier.append((t.dest, [*path, t.event]))
    return None


def _payload_strategies(
    decl: Declaration[Any], given: Payloads | None
) -> dict[type[Event], st.SearchStrategy[Event]]:
    """A strategy per event class of `decl`: the given one, else built from its fields."""
    given = given or {}
    return {cls: given[cls] if cls in given else st.builds(cls) for cls in decl.events}


def _trigger(cls: type[Event]) -> str:
    return cls.trigger


def to_transitions_machine(decl: Declaration[Any], model: Any) -> Any:
    """A `transitions.Machine` for `model` built from the same declaration.

    Guards receive `(model.ctx, event)`; pass the event object as `event=` to the
    trigger named by its class. Ignored events become internal transitions. Used as a
    reference executor.
    """
    from transitions import Machine

    def guard(name: str) -> Callable[[Any], bool]:
        fn = decl.callbacks[name]
        return lambda event_data: bool(fn(model.ctx, event_data.kwargs.get("event")))

    transitions = [
        {
            "trigger": t.trigger,
            "source": t.source,
            "dest": t.dest,
            "conditions": [guard(n) for n in t.conditions],
            "unless": [guard(n) for n in t.unless],
        }
        for t in decl.transition_decls
    ]
    transitions += [
        {"trigger": event.trigger, "source": state, "dest": None}
        for state, event in decl.ignored_pairs
    ]
    return Machine(
        model=model,
        states=[{"name": s.name, "final": s.final} for s in decl.state_decls],
        transitions=transitions,
        initial=decl.initial_state,
        auto_transitions=False,
        send_event=True,
    )


def _default_step(nodes: Any) -> float:
    timeouts = [n.timeout_seconds for n in nodes if n.timeout_seconds is not None]
    return 1.5 * max(timeouts) if timeouts else 1.0


def _camel(name: str) -> str:
    return "".join(part.capitalize() for part in name.replace(".", "_").split("_"))
