"""A declaration compiled once into an O(1) dispatch table.

Each state becomes a `Node` whose `on` dict maps an event class straight to a `Route`
(destination node, action, guard chain). Every instance of a kind shares these nodes;
an `Instance` is a slotted record holding only its node, key, context, its one armed
timer and its run-to-completion queue. A route remembers whether it was ever taken (one
flag store, no count, so the hot path allocates nothing): that is the transition coverage
the model-based tests and the integration tests read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from kvhandoff.machines.runtime.declaration import Declaration, Timeout, TransitionDecl
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event
from kvhandoff.machines.runtime.steps import Step, compile_step
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError, RemoteProtocolError

C = TypeVar("C")

Guard = Callable[[Any, Any], bool]
"""`guard(ctx, event) -> bool`; the declaration checked the real signature."""
Action = Callable[[Any, Any], "list[Effect] | None"]
"""`action(ctx, event) -> effects`; runs after the state has changed."""
TimerEntry = tuple[float, "Instance[Any]"]
"""`(deadline, instance)`: one armed timer in its duration's FIFO, live while the
instance holds this very tuple as its `timer`."""


class Node:
    """A compiled state: its outgoing routes, ignored events, tags and timeout."""

    __slots__ = (
        "fast",
        "final",
        "ignored",
        "name",
        "on",
        "steps",
        "tags",
        "timeout",
        "timeout_event",
        "timeout_seconds",
        "timer_queue",
    )

    def __init__(self, name: str, final: bool, tags: frozenset[str]) -> None:
        self.name = name
        self.final = final
        self.tags = tags
        self.on: dict[type[Event], Route] = {}
        # The plain routes of `on` (see Route.plain), which the bus runs on its fast path.
        self.fast: dict[type[Event], Route] = {}
        # The routes of `on` taken so far, each as one generated function (`steps.py`),
        # while the bus records nothing; empty while it does (the general step reports to
        # the recorder).
        self.steps: dict[type[Event], Step] = {}
        self.ignored: frozenset[type[Event]] = frozenset()
        self.timeout: Timeout | None = None
        self.timeout_seconds: float | None = None
        self.timeout_event: Event | None = None
        # The bus's queue of timers of this duration (set when the machine is registered).
        self.timer_queue: deque[TimerEntry] | None = None

    def __repr__(self) -> str:
        return f"<Node {self.name}>"


class Route:
    """Where an event leads from one node.

    `dest` is None for an internal transition. `alternatives` is set when the trigger
    has guarded options; then `dest`/`action` describe nothing and `choose` decides.
    """

    __slots__ = (
        "action",
        "alternatives",
        "dest",
        "edge",
        "keeps_timer",
        "plain",
        "queue",
        "seconds",
        "source",
        "taken",
        "watch",
    )

    def __init__(
        self,
        source: Node,
        dest: Node | None,
        action: Action | None,
        edge: tuple[str, str, str],
    ) -> None:
        self.source = source
        self.dest = dest
        self.action = action
        self.edge = edge
        self.taken = False
        # The destination's timer queue and timeout, copied here for the bus's fast path.
        self.queue: deque[TimerEntry] | None = None
        self.seconds: float | None = None
        self.alternatives: tuple[tuple[tuple[Guard, ...], tuple[Guard, ...], Route], ...] = ()
        # A plain route changes state and timers only: the bus runs it on its fast path.
        self.plain = False
        # `(members, entering)` for each watched tag this route enters or leaves (see
        # `CompiledMachine.watch`); such a route takes the bus's general step.
        self.watch: tuple[tuple[dict[Hashable, Instance[Any]], bool], ...] = ()
        # Between two states declaring an equal timeout, the armed deadline carries over
        # (one watchdog or lease spanning several states).
        self.keeps_timer = (
            dest is not None and source.timeout is not None and source.timeout == dest.timeout
        )

    def choose(self, ctx: object, event: Event) -> Route | None:
        """The first guarded alternative whose conditions hold and `unless` guards do not
        (guards run in order and stop at the first that decides; plain loops, no
        generator per call: this runs once per guarded event)."""
        for conditions, unless, route in self.alternatives:
            for guard in conditions:
                if not guard(ctx, event):
                    break
            else:
                for guard in unless:
                    if guard(ctx, event):
                        break
                else:
                    return route
        return None


@dataclass(frozen=True, slots=True)
class KindCounters:
    """What one kind's instances did: events ignored by declaration, peer events rejected,
    local errors, and instances created, retired and live."""

    ignored: int
    rejected: int
    errors: int
    created: int
    retired: int
    live: int


class Instance(Generic[C]):
    """One live lifecycle: a slotted record shared-nothing with its siblings."""

    __slots__ = ("busy", "ctx", "key", "machine", "node", "queue", "serial", "timer")

    def __init__(self, machine: CompiledMachine[C], key: Hashable, ctx: C, serial: int) -> None:
        self.machine = machine
        self.serial = serial
        self.key = key
        self.ctx = ctx
        self.node = machine.initial
        self.timer: TimerEntry | None = None
        self.busy = False
        self.queue: deque[Event] | None = None

    def has(self, tag: str) -> bool:
        """Whether the current state carries the declared `tag` (an undeclared tag raises)."""
        if tag in self.node.tags:
            return True
        self.machine.decl.check_tag(tag)
        return False

    @property
    def state(self) -> str:
        """The state's name, for logs and reports; decisions ask `has(tag)`."""
        return self.node.name

    @property
    def kind(self) -> str:
        return self.machine.name

    def __repr__(self) -> str:
        return f"<{self.machine.name} {self.key!r} in {self.node.name}>"


class CompiledMachine(Generic[C]):
    """The dispatch table of one declaration under one config, shared by all instances."""

    def __init__(self, decl: Declaration[C], config: Mapping[str, float] | None = None) -> None:
        self.decl = decl
        self.name = decl.name
        self.config = dict(decl.config_defaults) | dict(config or {})
        self.nodes: dict[str, Node] = {
            s.name: Node(s.name, s.final, s.tags) for s in decl.state_decls
        }
        self.initial = self.nodes[decl.initial_state]
        self.index: dict[Hashable, Instance[C]] = {}
        # Watched tags: the live instances whose state carries the tag, kept up to date by
        # the bus so `tagged` costs what it returns, not one test per live instance.
        self.watched: dict[str, dict[Hashable, Instance[C]]] = {}
        # A second key per live instance (`EventBus.alias`): how peers name it, kept up to
        # date by the bus as instances are created and retired.
        self.alias_of: Callable[[Hashable], Hashable] | None = None
        self.aliases: dict[Hashable, Instance[C]] = {}
        self._fast_enabled = True
        # Whether routes run as generated steps (`step_for`): off while recording.
        self.generate = True
        self.ignored_count = 0
        self.rejected_count = 0
        self.error_count = 0
        self.created = 0
        self.retired = 0
        for state in decl.state_decls:
            node = self.nodes[state.name]
            node.ignored = decl.ignored_events(state.name)
            if state.timeout is not None:
                node.timeout = state.timeout
                node.timeout_seconds = decl.timeout_seconds(state.timeout, self.config)
                if node.timeout_seconds <= 0:
                    raise LocalProtocolError(
                        f"machine {self.name!r}: timeout of state {state.name!r} must be "
                        f"positive, got {node.timeout_seconds}"
                    )
                node.timeout_event = state.timeout.event()
        self.routes: list[Route] = []
        grouped: dict[tuple[str, type[Event]], list[TransitionDecl]] = {}
        for t in decl.transition_decls:
            grouped.setdefault((t.source, t.event), []).append(t)
        for (source, event), options in grouped.items():
            self.nodes[source].on[event] = self._route(options)

    def admit(self, inst: Instance[C]) -> None:
        """A new live instance: indexed by key, by alias, and in its watched tags."""
        key = inst.key
        self.index[key] = inst
        self.created += 1
        if self.alias_of is not None:
            self.aliases[self.alias_of(key)] = inst
        if self.watched:
            tags = inst.node.tags
            for tag, members in self.watched.items():
                if tag in tags:
                    members[key] = inst

    def release(self, inst: Instance[C]) -> bool:
        """A retiring instance leaves every index; False if it had left already."""
        key = inst.key
        if self.index.get(key) is not inst:
            return False
        del self.index[key]
        for members in self.watched.values():
            members.pop(key, None)
        if self.alias_of is not None:
            alias = self.alias_of(key)
            if self.aliases.get(alias) is inst:
                del self.aliases[alias]
        self.retired += 1
        return True

    def alias(self, alias_of: Callable[[Hashable], Hashable]) -> None:
        """Index the live instances by `alias_of(key)` too (`EventBus.alias`)."""
        self.alias_of = alias_of
        self.aliases = {alias_of(key): inst for key, inst in self.index.items()}

    def _route(self, options: list[TransitionDecl]) -> Route:
        simple = [self._simple_route(t) for t in options]
        self.routes.extend(simple)
        first = options[0]
        if len(options) == 1 and not first.conditions and not first.unless:
            return simple[0]
        chooser = Route(self.nodes[first.source], None, None, ("", "", ""))
        chooser.alternatives = tuple(
            (self._guards(t.conditions), self._guards(t.unless), route)
            for t, route in zip(options, simple, strict=True)
        )
        return chooser

    def _simple_route(self, t: TransitionDecl) -> Route:
        source = self.nodes[t.source]
        dest = None if t.dest is None else self.nodes[t.dest]
        action: Action | None = self.decl.callbacks[t.after] if t.after else None  # type: ignore[assignment]
        edge = (t.source, t.trigger, t.dest if t.dest is not None else t.source)
        return Route(source, dest, action, edge)

    def _guards(self, names: Iterable[str]) -> tuple[Guard, ...]:
        return tuple(self.decl.callbacks[name] for name in names)  # type: ignore[misc]

    def watch(self, tag: str) -> dict[Hashable, Instance[C]]:
        """Keep the set of live instances whose state carries `tag` (a declared tag) from
        now on: the routes that enter or leave it update it, creation and retirement too."""
        self.decl.check_tag(tag)
        members = self.watched.get(tag)
        if members is None:
            members = {key: inst for key, inst in self.index.items() if tag in inst.node.tags}
            self.watched[tag] = members
            for route in self.routes:
                dest = route.dest
                if dest is not None and (tag in route.source.tags) != (tag in dest.tags):
                    route.watch = (*route.watch, (members, tag in dest.tags))
            self.set_fast_path(self._fast_enabled)
        return members

    def refresh(self) -> None:
        """Rebuild the fast path and the generated steps from the routes as they are now:
        after a route's action, guards or alternatives were changed in place (the
        simulator's planted variants do so on one bus's table), so every path runs the
        changed table."""
        self.set_fast_path(self._fast_enabled)

    def set_fast_path(self, enabled: bool) -> None:
        """Let plain routes skip the general step, and every other route take its generated
        one (`steps.py`); both off while transitions are recorded. Called again whenever a
        route's watched tags change, so the generated steps keep them."""
        self._fast_enabled = enabled
        for route in self.routes:
            dest = route.dest
            route.plain = (
                enabled
                and dest is not None
                and route.action is None
                and not dest.final
                and not route.keeps_timer
                and not route.watch
            )
        for node in self.nodes.values():
            node.fast = {event: route for event, route in node.on.items() if route.plain}
        for route in self.routes:
            if route.dest is not None:
                route.queue, route.seconds = route.dest.timer_queue, route.dest.timeout_seconds
        self.generate = enabled
        for node in self.nodes.values():
            node.steps = {}  # written again on first use, from the routes as they are now

    def step_for(self, node: Node, event: type[Event]) -> Step | None:
        """The generated step of `node`'s route for `event`, written the first time it is
        asked for (`steps.py`); None while recording, or when `node` declares no route."""
        route = node.on.get(event)
        if route is None or not self.generate:
            return None
        step = node.steps[event] = compile_step(self.name, node, event, route)
        return step

    # -- counters ----------------------------------------------------------------------

    def late_error(self, inst: Instance[C], event: Event) -> KvHandoffError:
        """The error for `event` reaching `inst` after it finished (counted if ignored)."""
        if event.__class__ in inst.node.ignored:
            self.ignored_count += 1
        message = (
            f"machine {self.name!r}: event {event.trigger!r} arrived after instance "
            f"{inst.key!r} finished in {inst.node.name!r}"
        )
        return RemoteProtocolError(message) if event.from_peer else LocalProtocolError(message)

    def unknown_error(self, key: Hashable, event: Event) -> KvHandoffError:
        """The error for `event` naming no live instance (a peer's is counted rejected)."""
        message = f"machine {self.name!r}: no live instance {key!r} (event {event.trigger!r})"
        if event.from_peer:
            self.rejected_count += 1
            return RemoteProtocolError(message)
        return LocalProtocolError(message)

    def counters(self) -> KindCounters:
        return KindCounters(
            ignored=self.ignored_count,
            rejected=self.rejected_count,
            errors=self.error_count,
            created=self.created,
            retired=self.retired,
            live=len(self.index),
        )

    def taken_edges(self) -> frozenset[tuple[str, str, str]]:
        return frozenset(route.edge for route in self.routes if route.taken)
