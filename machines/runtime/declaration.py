"""Machine declarations in the `transitions` format, validated when they are defined.

A declaration is the one table that states a lifecycle: its states (with their tags and
the timeout each arms on entry), the transitions between them (an event class as the
trigger, source, dest, guards, action), and the events a state deliberately ignores.
Dispatch, queries, diagrams, coverage and the model-based tests all read it; nothing
else defines a lifecycle.

    LEASE = Declaration(
        name="example.lease",
        context=LeaseCtx,                      # a slotted record with a `key` field
        states=[
            {"name": "finished", "tags": ("leased",),
             "timeout": Timeout("kv_lease_duration", "expired", LeaseExpired)},
            {"name": "sent", "final": True},
            {"name": "expired", "final": True},
        ],
        transitions=[{"trigger": WriteDone, "source": "finished", "dest": "sent"}],
        config_defaults={"kv_lease_duration": 30.0},
    )

`groups=[{"label": ..., "tag" | "timeout" | "states": ...}]` optionally names groups of
states with a reader's label (`groups.py`); the diagrams draw them as composite states.

Every rule is checked here, so a malformed declaration fails at import time with a
message naming the machine and the offending element: one initial state, every state
reachable, no trap states, guards that distinguish duplicate triggers, every named
callback present, and every callback typed `(ctx: Context, event: Event) -> ...` with
the machine's context, an event type admitting every trigger that runs it, and no `Any`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvhandoff.machines.runtime.events import Event
from kvhandoff.machines.runtime.groups import GroupDecl, normalise_groups
from kvhandoff.machines.runtime.signatures import check_signature, hints_of
from kvhandoff.machines.runtime.signatures import fail as _fail
from kvhandoff.protocol.errors import LocalProtocolError

ANY_STATE = "*"

C = TypeVar("C")


@dataclass(frozen=True, slots=True)
class Timeout:
    """A timeout armed on entry to a state and cancelled on exit.

    `after` is a number of seconds or the name of a config key; when it elapses the
    runtime delivers `event()` to the instance, which takes it to `dest` and runs the
    callback named by `action`, if any.
    """

    after: float | str
    dest: str
    event: type[Event]
    action: str | None = None

    def label(self) -> str:
        after = self.after if isinstance(self.after, str) else f"{self.after:g}s"
        return f"after {after}"


@dataclass(frozen=True, slots=True)
class StateDecl:
    name: str
    final: bool = False
    timeout: Timeout | None = None
    tags: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class TransitionDecl:
    event: type[Event]
    source: str
    dest: str | None
    conditions: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    after: str | None = None
    from_timeout: bool = False

    @property
    def trigger(self) -> str:
        return self.event.trigger

    @property
    def internal(self) -> bool:
        """An internal transition runs its action without leaving the state."""
        return self.dest is None

    def guard_label(self) -> str:
        parts = [*self.conditions, *(f"!{name}" for name in self.unless)]
        return f" [{' && '.join(parts)}]" if parts else ""


@dataclass(frozen=True, eq=False)
class Declaration(Generic[C]):
    """One lifecycle, validated at definition (see the module docstring).

    Compared and hashed by identity: the declaration object is the handle that names
    its kind on a bus (`bus.get(D_REGISTRATION, key)` is typed by its context).
    """

    name: str
    context: type[C]
    states: Sequence[str | Mapping[str, Any]]
    transitions: Sequence[Mapping[str, Any]]
    initial: str | None = None
    ignore: Sequence[tuple[str, type[Event]]] = ()
    callbacks: Mapping[str, Callable[..., object]] = field(default_factory=dict)
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    description: str = ""
    groups: Sequence[Mapping[str, Any]] = ()
    """Labelled groups of states for the diagrams (`groups.py`); dispatch ignores them."""

    # Normalised views, filled in __post_init__.
    state_decls: tuple[StateDecl, ...] = field(init=False)
    transition_decls: tuple[TransitionDecl, ...] = field(init=False)
    ignored_pairs: frozenset[tuple[str, type[Event]]] = field(init=False)
    initial_state: str = field(init=False)
    tags: frozenset[str] = field(init=False)
    group_decls: tuple[GroupDecl, ...] = field(init=False)

    def __post_init__(self) -> None:
        _validate_context(self)
        states = tuple(_state(self.name, raw) for raw in self.states)
        object.__setattr__(self, "state_decls", states)
        names = [s.name for s in states]
        _check_unique(self.name, names)
        object.__setattr__(self, "initial_state", _initial(self.name, self.initial, self.states))
        object.__setattr__(self, "tags", frozenset().union(*(s.tags for s in states)))
        known = frozenset(names)
        transitions = tuple(_expand_transitions(self, known))
        object.__setattr__(self, "transition_decls", transitions)
        object.__setattr__(self, "ignored_pairs", _ignored(self, known))
        object.__setattr__(self, "group_decls", normalise_groups(self.name, self.groups, states))
        _validate(self)

    def __repr__(self) -> str:
        return f"<Declaration {self.name}>"

    # -- reading the table -------------------------------------------------------------

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.state_decls)

    @property
    def final_states(self) -> frozenset[str]:
        return frozenset(s.name for s in self.state_decls if s.final)

    @property
    def events(self) -> frozenset[type[Event]]:
        """Every event class the machine knows, handled or ignored somewhere."""
        return frozenset(t.event for t in self.transition_decls) | frozenset(
            event for _, event in self.ignored_pairs
        )

    @property
    def triggers(self) -> frozenset[str]:
        """The trigger names of `events`."""
        return frozenset(event.trigger for event in self.events)

    def state(self, name: str) -> StateDecl:
        for decl in self.state_decls:
            if decl.name == name:
                return decl
        raise LocalProtocolError(f"machine {self.name!r} has no state {name!r}")

    def states_tagged(self, tag: str) -> frozenset[str]:
        self.check_tag(tag)
        return frozenset(s.name for s in self.state_decls if tag in s.tags)

    def check_tag(self, tag: str) -> None:
        if tag not in self.tags:
            raise LocalProtocolError(
                f"machine {self.name!r} declares no state tag {tag!r} (known: {sorted(self.tags)})"
            )

    def handled_events(self, state: str) -> frozenset[type[Event]]:
        return frozenset(t.event for t in self.transition_decls if t.source == state)

    def ignored_events(self, state: str) -> frozenset[type[Event]]:
        return frozenset(event for src, event in self.ignored_pairs if src == state)

    def edges(self) -> frozenset[tuple[str, str, str]]:
        """Every (source, trigger, dest) the table declares; internal ones keep the source."""
        return frozenset(
            (t.source, t.trigger, t.dest if t.dest is not None else t.source)
            for t in self.transition_decls
        )

    def timeout_seconds(self, timeout: Timeout, config: Mapping[str, float]) -> float:
        if not isinstance(timeout.after, str):
            return float(timeout.after)
        value = config.get(timeout.after, self.config_defaults.get(timeout.after))
        if value is None:
            raise LocalProtocolError(
                f"machine {self.name!r}: config key {timeout.after!r} has no value"
            )
        return float(value)

    def new_context(self, key: object, fields: Mapping[str, Any]) -> C:
        """A context for `key` built from `fields` (tests and generic tools)."""
        factory: Callable[..., C] = self.context
        return factory(key=key, **fields)


# -- normalisation ---------------------------------------------------------------------


def _validate_context(decl: Declaration[Any]) -> None:
    if not isinstance(decl.context, type):
        raise _fail(decl.name, "context must be a class (a slotted record with a `key` field)")
    if "key" not in hints_of(decl.name, decl.context, "context"):
        raise _fail(
            decl.name, f"context {decl.context.__name__} needs a `key` field (the instance key)"
        )


def _state(machine: str, raw: str | Mapping[str, Any]) -> StateDecl:
    if isinstance(raw, str):
        return StateDecl(raw)
    unknown = set(raw) - {"name", "final", "timeout", "initial", "tags"}
    if unknown:
        raise _fail(machine, f"state {raw.get('name')!r} has unknown keys {sorted(unknown)}")
    timeout = raw.get("timeout")
    if timeout is not None and not isinstance(timeout, Timeout):
        raise _fail(machine, f"state {raw['name']!r}: timeout must be a Timeout")
    tags = raw.get("tags", ())
    if isinstance(tags, str) or not all(isinstance(t, str) and t.isidentifier() for t in tags):
        raise _fail(machine, f"state {raw['name']!r}: tags must be a sequence of identifiers")
    return StateDecl(str(raw["name"]), bool(raw.get("final", False)), timeout, frozenset(tags))


def _check_unique(machine: str, names: Sequence[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if not name or name == ANY_STATE:
            raise _fail(machine, f"invalid state name {name!r}")
        if name in seen:
            raise _fail(machine, f"state {name!r} declared twice")
        seen.add(name)


def _initial(machine: str, initial: str | None, raw_states: Sequence[Any]) -> str:
    flagged = [str(s["name"]) for s in raw_states if isinstance(s, Mapping) and s.get("initial")]
    candidates = ([initial] if initial is not None else []) + [n for n in flagged if n != initial]
    if len(candidates) != 1:
        what = "no initial state" if not candidates else f"initial states {candidates}"
        raise _fail(machine, f"needs exactly one initial state, got {what}")
    return candidates[0]


def _as_tuple(value: str | Sequence[str] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def _event_class(machine: str, raw: object, what: str) -> type[Event]:
    if not (isinstance(raw, type) and issubclass(raw, Event)) or raw is Event:
        raise _fail(machine, f"{what} must be an Event subclass, got {raw!r}")
    return raw


def _expand_transitions(decl: Declaration[Any], known: frozenset[str]) -> Iterable[TransitionDecl]:
    allowed = {"trigger", "source", "dest", "conditions", "unless", "after"}
    for raw in decl.transitions:
        unknown = set(raw) - allowed
        if unknown:
            raise _fail(decl.name, f"transition {dict(raw)!r} has unknown keys {sorted(unknown)}")
        event = _event_class(decl.name, raw.get("trigger"), f"trigger of {dict(raw)!r}")
        dest = raw.get("dest")
        if dest is not None and dest not in known:
            raise _fail(decl.name, f"transition {event.trigger!r} names unknown dest {dest!r}")
        sources = _sources(decl, raw.get("source"), known, f"transition {event.trigger!r}")
        for source in sources:
            yield TransitionDecl(
                event=event,
                source=source,
                dest=dest,
                conditions=_as_tuple(raw.get("conditions")),
                unless=_as_tuple(raw.get("unless")),
                after=raw.get("after"),
            )
    for state in decl.state_decls:
        timeout = state.timeout
        if timeout is None:
            continue
        if timeout.dest not in known:
            raise _fail(
                decl.name, f"timeout of state {state.name!r} names unknown dest {timeout.dest!r}"
            )
        event = _event_class(decl.name, timeout.event, f"timeout event of {state.name!r}")
        try:
            event()
        except TypeError as exc:
            raise _fail(
                decl.name, f"timeout event {event.__name__} must be constructible without fields"
            ) from exc
        yield TransitionDecl(
            event, state.name, timeout.dest, after=timeout.action, from_timeout=True
        )


def _sources(
    decl: Declaration[Any], raw: str | Sequence[str] | None, known: frozenset[str], what: str
) -> tuple[str, ...]:
    sources = _as_tuple(raw)
    if not sources:
        raise _fail(decl.name, f"{what} needs a source")
    if ANY_STATE in sources:
        return tuple(s.name for s in decl.state_decls if not s.final)
    for source in sources:
        if source not in known:
            raise _fail(decl.name, f"{what} names unknown source state {source!r}")
    return sources


def _ignored(decl: Declaration[Any], known: frozenset[str]) -> frozenset[tuple[str, type[Event]]]:
    pairs: set[tuple[str, type[Event]]] = set()
    for source, raw_event in decl.ignore:
        event = _event_class(decl.name, raw_event, f"ignored event in state {source!r}")
        if source == ANY_STATE:
            pairs.update((s, event) for s in known)
        elif source not in known:
            raise _fail(
                decl.name, f"ignored event {event.trigger!r} names unknown state {source!r}"
            )
        else:
            pairs.add((source, event))
    return frozenset(pairs)


# -- validation --------------------------------------------------------------------------


def _validate(decl: Declaration[Any]) -> None:
    _validate_callbacks(decl)
    _validate_alternatives(decl)
    _validate_graph(decl)


def _validate_callbacks(decl: Declaration[Any]) -> None:
    runs_on: dict[tuple[str, str], set[type[Event]]] = {}
    for t in decl.transition_decls:
        for name in (*t.conditions, *t.unless):
            runs_on.setdefault((name, "guard"), set()).add(t.event)
        if t.after is not None:
            runs_on.setdefault((t.after, "action"), set()).add(t.event)
    for (name, role), events in sorted(runs_on.items(), key=lambda item: item[0]):
        fn = decl.callbacks.get(name)
        if not callable(fn):
            raise _fail(decl.name, f"a transition names missing callback {name!r}")
        check_signature(decl, name, fn, role, events)
    for state in decl.state_decls:
        timeout = state.timeout
        if timeout is None or not isinstance(timeout.after, str):
            continue
        if timeout.after not in decl.config_defaults:
            raise _fail(
                decl.name,
                f"timeout of state {state.name!r} reads config key {timeout.after!r} "
                "which has no default in config_defaults",
            )


def _validate_alternatives(decl: Declaration[Any]) -> None:
    by_pair: dict[tuple[str, type[Event]], list[TransitionDecl]] = {}
    for t in decl.transition_decls:
        by_pair.setdefault((t.source, t.event), []).append(t)
    for (source, event), options in by_pair.items():
        if (source, event) in decl.ignored_pairs:
            raise _fail(
                decl.name, f"event {event.trigger!r} in state {source!r} is handled and ignored"
            )
        if source in decl.final_states:
            raise _fail(decl.name, f"final state {source!r} has an exit on {event.trigger!r}")
        guards = [(t.conditions, t.unless) for t in options]
        for index, guard in enumerate(guards):
            unguarded_before_last = guard == ((), ()) and index < len(guards) - 1
            if unguarded_before_last or guard in guards[:index]:
                raise _fail(
                    decl.name,
                    f"trigger {event.trigger!r} from state {source!r} is declared twice "
                    "without distinguishing guards",
                )
    triggers: dict[str, type[Event]] = {}
    for event in decl.events:
        other = triggers.setdefault(event.trigger, event)
        if other is not event:
            raise _fail(
                decl.name,
                f"event classes {other.__qualname__} and {event.__qualname__} share the "
                f"trigger name {event.trigger!r}",
            )


def _validate_graph(decl: Declaration[Any]) -> None:
    successors: dict[str, set[str]] = {name: set() for name in decl.state_names}
    for t in decl.transition_decls:
        if t.dest is not None:
            successors[t.source].add(t.dest)
    reachable = _closure({decl.initial_state}, successors)
    unreachable = [n for n in decl.state_names if n not in reachable]
    if unreachable:
        raise _fail(decl.name, f"states {unreachable} are unreachable from {decl.initial_state!r}")
    finals = decl.final_states
    for name in decl.state_names:
        if name in finals:
            continue
        if not successors[name] - {name}:
            raise _fail(decl.name, f"state {name!r} is a trap: no exit and not final")
        if finals and not _closure({name}, successors) & finals:
            raise _fail(decl.name, f"state {name!r} is a trap: no final state is reachable")


def _closure(start: set[str], successors: Mapping[str, set[str]]) -> set[str]:
    seen = set(start)
    frontier = list(start)
    while frontier:
        for nxt in successors[frontier.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return seen
