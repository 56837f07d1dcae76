"""Delivery: how the event bus applies events to instances, runs their transitions and
effects, and fires their timeouts (`EventBus` adds kinds, creation, queries and
recording on top).

`dispatch(kind, key, event, now)` is the hot path: fire what is due at `now`, one index
lookup, one table lookup by event class, the state change, the timer arm or cancel, and
the action if the route has one; `dispatch_many` does the same for one event over a batch
of keys (a writer pass, an engine step). A plain route (no guard, no action, not final)
is applied inline; every other route runs as its generated step (`steps.py`), or as the
general step `_step` while transitions are recorded.

Delivery is run-to-completion: an event raised for an instance that is still handling
one is queued on that instance and delivered after it; an error while draining one
instance's queue is counted and reported, never thrown into another instance's handling.
Events from peers (`PeerEvent`) that the current state does not declare, or that name no
live instance, raise `RemoteProtocolError` and change nothing; local misuse raises
`LocalProtocolError`.

Timeouts are delivered like events, each at its own deadline (`fire_due`); the built-in
effects (`Emit`, `ExtendDeadline`, `Metric`) are executed here too.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from kvhandoff.machines.runtime.compiled import CompiledMachine, Instance, Route
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Emit, ExtendDeadline, Metric
from kvhandoff.machines.runtime.events import Event
from kvhandoff.machines.runtime.recording import TransitionRecorder
from kvhandoff.machines.runtime.timers import TimerQueues
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError, RemoteProtocolError

log = logging.getLogger("kvhandoff.bus")

EffectHandler = Callable[[Any, Any], None]
"""`handler(instance or None, effect)`: None when an API call, not an instance, emitted it."""
ErrorHook = Callable[[Instance[Any], Event, BaseException], None]


class Delivery(TimerQueues):
    """The compiled machines' live instances and the delivery of events, effects and
    timeouts to them."""

    def __init__(self) -> None:
        super().__init__()
        self.outbox: list[tuple[Instance[Any] | None, Effect]] = []
        self.metrics: dict[str, float] = {}
        self.on_error: ErrorHook = _log_error
        self._machines: dict[Declaration[Any], CompiledMachine[Any]] = {}
        self._index: dict[Declaration[Any], dict[Hashable, Instance[Any]]] = {}  # hot path
        self._recorder: TransitionRecorder | None = None
        self._retire_hooks: list[Callable[[Instance[Any]], None]] = []
        self._handlers: dict[type, EffectHandler] = {
            Emit: self._emit,
            ExtendDeadline: self._extend_deadline,
            Metric: self._metric,
        }

    # -- the hot path ----------------------------------------------------------------------

    def dispatch(self, kind: Declaration[Any], key: Hashable, event: Event, now: float) -> None:
        """Deliver `event` to (kind, key) at `now`: due timeouts first, then the event."""
        if now > self._now:
            self.advance(now)
        try:
            inst = self._index[kind][key]
        except KeyError:
            raise self._unknown(kind, key, event) from None
        route = inst.node.fast.get(event.__class__)
        if route is None or inst.busy:
            if inst.busy:
                self._enqueue(inst, event)
            else:
                self._deliver(inst, event)
            return
        self._take_plain(inst, route)

    def dispatch_many(
        self, kind: Declaration[Any], keys: Iterable[Hashable], event: Event, now: float
    ) -> list[tuple[Hashable, KvHandoffError]]:
        """Deliver one `event` to (kind, key) for every key, in order: what `dispatch` does
        for each, with one time step and one index lookup for the whole batch (a writer
        pass, an engine step). A key with no live instance, or whose state refuses a
        peer's event, is returned with its error and does not stop the batch; any other
        error raises, as `dispatch`'s would."""
        if now > self._now:
            self.advance(now)
        index = self._index.get(kind)
        if index is None:
            raise self._unknown(kind, None, event)
        refused: list[tuple[Hashable, KvHandoffError]] = []
        cls = event.__class__
        for key in keys:
            inst = index.get(key)
            if inst is None:
                refused.append((key, self._unknown(kind, key, event)))
                continue
            route = inst.node.fast.get(cls)
            if inst.busy:
                self._enqueue(inst, event)
            elif route is None:
                try:
                    self._deliver(inst, event)
                except RemoteProtocolError as exc:
                    refused.append((key, exc))
            else:
                self._take_plain(inst, route)
        return refused

    def _take_plain(self, inst: Instance[Any], route: Route) -> None:
        """A plain route: no guard, no action, not into a final state, no timeout carried
        over; it cancels the old timer (replacing `inst.timer` does: an entry is live
        while its instance holds it) and arms the new state's own. `_step` is the
        general form of the same change."""
        route.taken = True
        inst.node = route.dest  # type: ignore[assignment]  # plain routes have a dest
        queue = route.queue
        if queue is None:
            inst.timer = None
        else:
            deadline = self._now + route.seconds  # type: ignore[operator]
            inst.timer = entry = (deadline, inst)
            queue.append(entry)
            if deadline < self._next_due:
                self._next_due = deadline
            if len(queue) > self._compact_at:
                self._compact()

    def advance(self, now: float) -> None:
        """Move the bus's time to `now`, delivering every timeout due by then first (what
        `dispatch` and `create` do before they apply anything). Call it before querying
        tags at a new time, so the answer is what an event at `now` would meet. A call
        nested in a delivery keeps the step's time: its timeouts wait for the next
        top-level call."""
        if now > self._now and not self._delivering:
            if now >= self._next_due:
                self.fire_due(now)
            self._now = now

    def _deliver(self, inst: Instance[Any], event: Event) -> None:
        outer = self._delivering
        self._delivering = True
        try:
            step = inst.node.steps.get(event.__class__)
            if step is None:
                self._step(inst, event)
            else:
                step(self, inst, event)
        finally:
            if inst.queue:
                self._drain(inst)
            if inst.node.final:
                self._retire(inst)
            self._delivering = outer

    def _step(self, inst: Instance[Any], event: Event) -> None:
        """The general step: the route for `event`, its guards, the state change, timers,
        the action and its effects, and the recorder. Outside recording every declared
        route runs as its generated step instead (`steps.py`), which does the same."""
        node = inst.node
        step = node.steps.get(event.__class__) or inst.machine.step_for(node, event.__class__)
        if step is not None:
            step(self, inst, event)
            return
        route = node.on.get(event.__class__)
        if route is None:
            self._unhandled(inst, event)
            return
        if route.alternatives:
            route = self._choose(inst, route, event)
        route.taken = True
        dest = route.dest
        if dest is not None:
            inst.node = dest
            for members, entering in route.watch:
                if entering:
                    members[inst.key] = inst
                else:
                    members.pop(inst.key, None)
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
                effects = action(inst.ctx, event)
                if effects:
                    self._execute(inst, effects)
            finally:
                inst.busy = False
        if self._recorder is not None:
            self._recorder.transition(self._now, inst, event, route.edge, effects)

    def _unhandled(self, inst: Instance[Any], event: Event) -> None:
        machine = inst.machine
        if event.__class__ in inst.node.ignored:
            machine.ignored_count += 1
            return
        message = (
            f"machine {machine.name!r}: event {event.trigger!r} is not declared in state "
            f"{inst.node.name!r} (instance {inst.key!r})"
        )
        if event.from_peer:
            machine.rejected_count += 1
            raise RemoteProtocolError(message)
        machine.error_count += 1
        raise LocalProtocolError(message)

    def _choose(self, inst: Instance[Any], route: Route, event: Event) -> Route:
        chosen = route.choose(inst.ctx, event)
        if chosen is None:
            raise self._unadmitted(inst, event)
        return chosen

    def _refuse_unadmitted(self, inst: Instance[Any], event: Event) -> None:
        """A generated step's end when no guarded alternative admits `event`."""
        raise self._unadmitted(inst, event)

    def _unadmitted(self, inst: Instance[Any], event: Event) -> KvHandoffError:
        """No guarded alternative admits `event`: a peer's is rejected, a local one is an
        error (both counted); the state does not change."""
        message = (
            f"machine {inst.machine.name!r}: no guard admits event {event.trigger!r} in "
            f"state {inst.node.name!r} (instance {inst.key!r})"
        )
        if event.from_peer:
            inst.machine.rejected_count += 1
            return RemoteProtocolError(message)
        inst.machine.error_count += 1
        return LocalProtocolError(message)

    def _enqueue(self, inst: Instance[Any], event: Event) -> None:
        if inst.queue is None:
            inst.queue = deque()
        inst.queue.append(event)

    def _drain(self, inst: Instance[Any]) -> None:
        queue = inst.queue
        while queue and not inst.node.final:
            event = queue.popleft()
            try:
                self._step(inst, event)
            except Exception as exc:  # one instance's error stays with it
                self._report(inst, event, exc)
        if queue and inst.node.final:
            for event in list(queue):
                self._report(inst, event, inst.machine.late_error(inst, event))
            queue.clear()

    def _execute(self, inst: Instance[Any] | None, effects: Iterable[Effect]) -> None:
        handlers = self._handlers
        for effect in effects:
            handler = handlers.get(type(effect))
            if handler is None:
                self.outbox.append((inst, effect))
            else:
                handler(inst, effect)

    def _retire(self, inst: Instance[Any]) -> None:
        if not inst.machine.release(inst):
            return
        if inst.timer is not None:
            self._cancel(inst, inst.timer)
        for hook in self._retire_hooks:
            hook(inst)

    def _report(self, inst: Instance[Any], event: Event, exc: BaseException) -> None:
        if not isinstance(exc, KvHandoffError):
            inst.machine.error_count += 1
        self.on_error(inst, event, exc)

    def _unknown(self, kind: Declaration[Any], key: Hashable, event: Event) -> KvHandoffError:
        machine = self._machines.get(kind)
        if machine is None:
            what = f"machine {kind.name!r} is not registered"
            return LocalProtocolError(f"{what} (event {event.trigger!r})")
        return machine.unknown_error(key, event)

    # -- built-in effects ----------------------------------------------------------------

    def _emit(self, source: Instance[Any], effect: Emit) -> None:
        machine = self._machines.get(effect.kind)
        target = None if machine is None else machine.index.get(effect.key)
        if target is None:
            source.machine.error_count += 1
            self._report(source, effect.event, self._unknown(effect.kind, effect.key, effect.event))
        elif target.busy:
            self._enqueue(target, effect.event)
        else:
            try:
                self._deliver(target, effect.event)
            except Exception as exc:  # the target's error is not the emitter's
                self._report(target, effect.event, exc)

    def _extend_deadline(self, inst: Instance[Any], effect: ExtendDeadline) -> None:
        timer = inst.timer
        if timer is None:
            raise LocalProtocolError(
                f"machine {inst.machine.name!r}: ExtendDeadline in state {inst.node.name!r}, "
                "which arms no timeout"
            )
        wanted = self._now + effect.seconds
        if wanted > timer[0]:
            self._cancel(inst, timer)
            self._arm(inst, effect.seconds)

    def _metric(self, inst: Instance[Any] | None, effect: Metric) -> None:
        self.metrics[effect.name] = self.metrics.get(effect.name, 0.0) + effect.value

    def fire_due(self, now: float) -> int:
        """Deliver every timeout whose deadline is at or before `now`, in deadline order.

        Each timeout runs at its own deadline (the bus's time steps through them), so
        what it arms or extends counts from when it was due, not from when the caller
        came back: the outcome does not depend on how often `fire_due` is called.
        """
        fired = 0
        outer = self._delivering
        self._delivering = True  # a timeout's action never re-enters the firing loop
        try:
            while True:
                queue = self._earliest()
                if queue is None or queue[0][0] > now:
                    self._next_due = math.inf if queue is None else queue[0][0]
                    break
                deadline, inst = queue.popleft()
                if deadline > self._now:
                    self._now = deadline
                inst.timer = None
                event = inst.node.timeout_event
                assert event is not None, "only nodes with a timeout arm timers"
                fired += 1
                try:
                    self._deliver(inst, event)
                except Exception as exc:  # a timeout's failure belongs to its instance
                    self._report(inst, event, exc)
        finally:
            self._delivering = outer
        if now > self._now:
            self._now = now
        return fired


def _log_error(inst: Instance[Any], event: Event, exc: BaseException) -> None:
    log.warning("%s %r: event %r failed: %s", inst.machine.name, inst.key, event.trigger, exc)
