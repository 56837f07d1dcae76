"""The event bus: routes events to instances, runs transitions, timers and effects.

The bus owns every live instance of the kinds registered on it, keyed by (kind, key).
`dispatch` is the hot path: one index lookup, one table lookup, the state change, the
timer arm or cancel, and the action if the route has one. Delivery is run-to-completion:
an event raised for an instance that is still handling one is queued on that instance
and delivered after it; an error while draining one instance's queue is counted and
reported, never thrown into another instance's handling.

Timers live in one FIFO per timeout duration on the injected clock, which never goes
backwards: deadlines armed with one duration are therefore already in order, so arming
is an append (no heap), and `fire_due` merges the heads of the few queues to deliver
what is due in deadline order. Cancelled entries are dropped lazily; the queues are
compacted when they could hold more dead entries than live ones. No thread per timer and
no clock read inside a machine.

The bus is single-threaded: one thread owns it; other threads hand work over through
the inboxes of the adapters.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from kvhandoff.machines.runtime.clock import Clock, real_clock
from kvhandoff.machines.runtime.compiled import CompiledMachine, Instance, Node, Route
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Emit, ExtendDeadline, Metric
from kvhandoff.machines.runtime.recording import TransitionRecorder
from kvhandoff.protocol.errors import LocalProtocolError

log = logging.getLogger("kvhandoff.bus")

E = TypeVar("E")
EffectHandler = Callable[[Any, Any], None]
"""`handler(instance or None, effect)`: None when an API call, not an instance, emitted it."""
ErrorHook = Callable[[Instance, str, BaseException], None]

_MIN_COMPACT = 1024


@dataclass(frozen=True, slots=True)
class KindCounters:
    events: int
    transitions: int
    ignored: int
    errors: int
    created: int
    retired: int
    live: int


class EventBus:
    """Instances of declared machines, their timers, and the execution of their effects."""

    def __init__(self, clock: Clock = real_clock) -> None:
        self.clock = clock
        self.outbox: list[tuple[Instance | None, object]] = []
        self.metrics: dict[str, float] = {}
        self.on_error: ErrorHook = _log_error
        self._machines: dict[str, CompiledMachine] = {}
        self._index: dict[str, dict[Any, Instance]] = {}
        self._timer_queues: dict[float, deque[list[Any]]] = {}  # by duration, in order
        self._serials = itertools.count()
        self._compact_at = _MIN_COMPACT
        self._recorder: TransitionRecorder | None = None
        self._retire_hooks: list[Callable[[Instance], None]] = []
        self._handlers: dict[type, EffectHandler] = {
            Emit: self._emit,
            ExtendDeadline: self._extend_deadline,
            Metric: self._metric,
        }

    # -- kinds and instances -------------------------------------------------------------

    def register(
        self, decl: Declaration, config: Mapping[str, float] | None = None
    ) -> CompiledMachine:
        """Compile `decl` under `config` once; every instance of the kind shares it."""
        if decl.name in self._machines:
            raise LocalProtocolError(f"machine {decl.name!r} is already registered")
        machine = CompiledMachine(decl, config)
        machine.set_fast_path(self._recorder is None)
        for node in machine.nodes.values():
            if node.timeout_seconds is not None:
                node.timer_queue = self._timer_queue(node.timeout_seconds)
        self._machines[decl.name] = machine
        self._index[decl.name] = {}
        return machine

    def machine(self, kind: str) -> CompiledMachine:
        try:
            return self._machines[kind]
        except KeyError:
            raise LocalProtocolError(f"machine {kind!r} is not registered") from None

    def create(self, kind: str, key: Any, **fields: Any) -> Instance:
        """A new instance of `kind` in its initial state; its context gets `fields`."""
        machine = self.machine(kind)
        index = self._index[kind]
        if key in index:
            raise LocalProtocolError(f"machine {kind!r}: instance {key!r} already exists")
        inst = Instance(machine, key, machine.new_context(fields), next(self._serials))
        index[key] = inst
        machine.created += 1
        if machine.initial.timeout_seconds is not None:
            self._arm(inst, machine.initial.timeout_seconds)
        if self._recorder is not None:
            self._recorder.created(self.clock(), inst)
        return inst

    def get(self, kind: str, key: Any) -> Instance | None:
        return self._index[kind].get(key) if kind in self._index else None

    def instances(self, kind: str) -> Iterator[Instance]:
        return iter(list(self._index[self.machine(kind).name].values()))

    def live(self, kind: str) -> int:
        return len(self._index[kind])

    def on_retire(self, hook: Callable[[Instance], None]) -> None:
        """Call `hook(instance)` when an instance reaches a final state and leaves the bus."""
        self._retire_hooks.append(hook)

    # -- effects -------------------------------------------------------------------------

    def handle(self, effect_type: type[E], handler: Callable[[Any, E], None]) -> None:
        """Execute effects of `effect_type` with `handler(instance, effect)`."""
        self._handlers[effect_type] = handler

    def execute(self, *effects: object) -> None:
        """Execute effects that no instance emitted (an API call's own, e.g. a wake-up)."""
        for effect in effects:
            handler = self._handlers.get(type(effect))
            if handler is None:
                self.outbox.append((None, effect))
            else:
                handler(None, effect)

    def drain_outbox(self) -> list[tuple[Instance | None, object]]:
        """Effects no handler was registered for, in emission order."""
        out, self.outbox = self.outbox, []
        return out

    # -- the hot path ----------------------------------------------------------------------

    def dispatch(self, kind: str, key: Any, event: str, payload: Any = None) -> None:
        """Deliver `event` to (kind, key): run-to-completion, errors raised to the caller."""
        try:
            inst = self._index[kind][key]
        except KeyError:
            raise self._unknown(kind, key, event) from None
        route = inst.node.on.get(event)
        if route is None or not route.plain or inst.busy:
            if inst.busy:
                self._enqueue(inst, event, payload)
            else:
                self._deliver(inst, event, payload)
            return
        # The plain route: no guard, no action, not into a final state, no timeout carried
        # over (it cancels the old timer and arms the new state's own). Kept flat on
        # purpose; `_step` is the general form of the same change.
        route.count += 1
        dest: Node = route.dest  # type: ignore[assignment]  # plain routes have a dest
        inst.node = dest
        timer = inst.timer
        if timer is not None:
            timer[2] = False
        queue = dest.timer_queue
        if queue is None:
            inst.timer = None
        else:
            entry = [self.clock() + dest.timeout_seconds, inst, True]  # type: ignore[operator]
            queue.append(entry)
            inst.timer = entry
            if len(queue) > self._compact_at:
                self._compact()

    def _deliver(self, inst: Instance, event: str, payload: Any) -> None:
        try:
            self._step(inst, event, payload)
        finally:
            if inst.queue:
                self._drain(inst)
            if inst.node.final:
                self._retire(inst)

    def _step(self, inst: Instance, event: str, payload: Any) -> None:
        node = inst.node
        route = node.on.get(event)
        if route is None:
            self._unhandled(inst, event)
            return
        if route.alternatives:
            route = self._choose(inst, route, event, payload)
        route.count += 1
        dest = route.dest
        if dest is not None:
            inst.node = dest
            if not route.keeps_timer:
                if inst.timer is not None:
                    self._cancel(inst, inst.timer)
                if dest.timeout_seconds is not None:
                    self._arm(inst, dest.timeout_seconds)
        action = route.action
        effects = None
        if action is not None:
            inst.busy = True
            try:
                effects = action(inst, payload)
                if effects:
                    self._execute(inst, effects)
            finally:
                inst.busy = False
        if self._recorder is not None:
            self._recorder.transition(self.clock(), inst, event, route.edge, effects)

    def _unhandled(self, inst: Instance, event: str) -> None:
        machine = inst.machine
        if event in inst.node.ignored:
            machine.ignored_count += 1
            return
        machine.error_count += 1
        raise LocalProtocolError(
            f"machine {machine.name!r}: event {event!r} is not declared in state "
            f"{inst.node.name!r} (instance {inst.key!r})"
        )

    def _choose(self, inst: Instance, route: Route, event: str, payload: Any) -> Route:
        chosen = route.choose(inst, payload)
        if chosen is None:
            inst.machine.error_count += 1
            raise LocalProtocolError(
                f"machine {inst.machine.name!r}: no guard admits event {event!r} in state "
                f"{inst.node.name!r} (instance {inst.key!r})"
            )
        return chosen

    def _enqueue(self, inst: Instance, event: str, payload: Any) -> None:
        if inst.queue is None:
            inst.queue = deque()
        inst.queue.append((event, payload))

    def _drain(self, inst: Instance) -> None:
        queue = inst.queue
        while queue and not inst.node.final:
            event, payload = queue.popleft()
            try:
                self._step(inst, event, payload)
            except Exception as exc:  # one instance's error stays with it
                self._report(inst, event, exc)
        if queue and inst.node.final:
            for event, _payload in list(queue):
                self._report(inst, event, self._late(inst, event))
            queue.clear()

    def _late(self, inst: Instance, event: str) -> LocalProtocolError:
        if event in inst.node.ignored:
            inst.machine.ignored_count += 1
        return LocalProtocolError(
            f"machine {inst.machine.name!r}: event {event!r} arrived after instance "
            f"{inst.key!r} finished in {inst.node.name!r}"
        )

    def _execute(self, inst: Instance, effects: Iterable[object]) -> None:
        handlers = self._handlers
        for effect in effects:
            handler = handlers.get(type(effect))
            if handler is None:
                self.outbox.append((inst, effect))
            else:
                handler(inst, effect)

    def _retire(self, inst: Instance) -> None:
        index = self._index[inst.machine.name]
        if index.get(inst.key) is not inst:
            return
        del index[inst.key]
        if inst.timer is not None:
            self._cancel(inst, inst.timer)
        inst.machine.retired += 1
        for hook in self._retire_hooks:
            hook(inst)

    def _report(self, inst: Instance, event: str, exc: BaseException) -> None:
        if not isinstance(exc, LocalProtocolError):
            inst.machine.error_count += 1
        self.on_error(inst, event, exc)

    def _unknown(self, kind: str, key: Any, event: str) -> LocalProtocolError:
        if kind not in self._index:
            return LocalProtocolError(f"machine {kind!r} is not registered (event {event!r})")
        return LocalProtocolError(f"machine {kind!r}: no live instance {key!r} (event {event!r})")

    # -- built-in effects ----------------------------------------------------------------

    def _emit(self, source: Instance, effect: Emit) -> None:
        target = self._index.get(effect.kind, {}).get(effect.key)
        if target is None:
            source.machine.error_count += 1
            self._report(source, effect.event, self._unknown(effect.kind, effect.key, effect.event))
        elif target.busy:
            self._enqueue(target, effect.event, effect.payload)
        else:
            try:
                self._deliver(target, effect.event, effect.payload)
            except Exception as exc:  # the target's error is not the emitter's
                self._report(target, effect.event, exc)

    def _extend_deadline(self, inst: Instance, effect: ExtendDeadline) -> None:
        timer = inst.timer
        if timer is None:
            raise LocalProtocolError(
                f"machine {inst.machine.name!r}: ExtendDeadline in state {inst.node.name!r}, "
                "which arms no timeout"
            )
        wanted = self.clock() + effect.seconds
        if wanted > timer[0]:
            self._cancel(inst, timer)
            self._arm(inst, effect.seconds)

    def _metric(self, inst: Instance, effect: Metric) -> None:
        self.metrics[effect.name] = self.metrics.get(effect.name, 0.0) + effect.value

    # -- timers --------------------------------------------------------------------------

    def _timer_queue(self, seconds: float) -> deque[list[Any]]:
        queue = self._timer_queues.get(seconds)
        if queue is None:
            queue = self._timer_queues[seconds] = deque()
        return queue

    def _arm(self, inst: Instance, seconds: float) -> None:
        queue = self._timer_queue(seconds)
        entry = [self.clock() + seconds, inst, True]
        queue.append(entry)
        inst.timer = entry
        if len(queue) > self._compact_at:
            self._compact()

    def _cancel(self, inst: Instance, timer: list[Any]) -> None:
        timer[2] = False
        inst.timer = None

    def _compact(self) -> None:
        """Drop cancelled entries once they could outnumber the live ones (in place: the
        nodes hold their queues)."""
        longest = 0
        for queue in self._timer_queues.values():
            live = [entry for entry in queue if entry[2]]
            queue.clear()
            queue.extend(live)
            longest = max(longest, len(live))
        self._compact_at = max(_MIN_COMPACT, 2 * longest)

    def _earliest(self) -> deque[list[Any]] | None:
        """The queue whose head is the earliest live deadline (dead heads dropped)."""
        best: deque[list[Any]] | None = None
        for queue in self._timer_queues.values():
            while queue and not queue[0][2]:
                queue.popleft()
            if queue and (best is None or queue[0][0] < best[0][0]):
                best = queue
        return best

    def deadline_of(self, kind: str, key: Any) -> float | None:
        inst = self._index[kind].get(key)
        return None if inst is None or inst.timer is None else float(inst.timer[0])

    def next_deadline(self) -> float | None:
        """The earliest armed deadline, or None when no timer is armed."""
        queue = self._earliest()
        return None if queue is None else float(queue[0][0])

    def fire_due(self, now: float | None = None) -> int:
        """Deliver every timeout whose deadline is at or before `now`, in deadline order."""
        now = self.clock() if now is None else now
        fired = 0
        while True:
            queue = self._earliest()
            if queue is None or queue[0][0] > now:
                break
            _deadline, inst, _live = queue.popleft()
            inst.timer = None
            trigger = inst.node.timeout_trigger
            assert trigger is not None, "only nodes with a timeout arm timers"
            fired += 1
            try:
                self._deliver(inst, trigger, None)
            except Exception as exc:  # a timeout's failure belongs to its instance
                self._report(inst, trigger, exc)
        return fired

    # -- observation ---------------------------------------------------------------------

    def record(self, sink: Callable[[str], None] | None) -> None:
        """Write every creation and transition as a JSON line to `sink`; None turns it off."""
        self._recorder = None if sink is None else TransitionRecorder(sink)
        for machine in self._machines.values():
            machine.set_fast_path(sink is None)

    def counters(self, kind: str) -> KindCounters:
        m = self.machine(kind)
        transitions = m.transition_count
        return KindCounters(
            events=transitions + m.ignored_count + m.error_count,
            transitions=transitions,
            ignored=m.ignored_count,
            errors=m.error_count,
            created=m.created,
            retired=m.retired,
            live=len(self._index[kind]),
        )

    def kinds(self) -> list[str]:
        return sorted(self._machines)


def _log_error(inst: Instance, event: str, exc: BaseException) -> None:
    log.warning("%s %r: event %r failed: %s", inst.machine.name, inst.key, event, exc)
