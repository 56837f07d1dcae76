"""Machine declarations in the `transitions` format, validated when they are defined.

A declaration is the one table that states a lifecycle: its states, the transitions
between them (trigger, source, dest, conditions), the timeouts a state arms on entry,
and the events a state deliberately ignores. Dispatch, diagrams, coverage and the
model-based tests all read it; nothing else defines a lifecycle.

    LEASE = Declaration(
        name="example.lease",
        states=[
            {"name": "finished", "timeout": Timeout("kv_lease_duration", "expired")},
            {"name": "sent", "final": True},
            {"name": "expired", "final": True},
        ],
        transitions=[{"trigger": "write_done", "source": "finished", "dest": "sent"}],
        config_defaults={"kv_lease_duration": 30.0},
    )

Every rule is checked here, so a malformed declaration fails at import time with a
message naming the machine and the offending element.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.protocol.errors import LocalProtocolError

ANY_STATE = "*"

Guard = Callable[[Any, Any], bool]
"""`guard(instance, payload) -> bool`; true admits the transition."""

Action = Callable[[Any, Any], Iterable[object] | None]
"""`action(instance, payload) -> effects`; runs after the state has changed."""


@dataclass(frozen=True, slots=True)
class Timeout:
    """A timeout armed on entry to a state and cancelled on exit.

    `after` is a number of seconds or the name of a config key; when it elapses the
    runtime delivers `trigger` to the instance, which takes it to `dest` and runs the
    callback named by `action`, if any.
    """

    after: float | str
    dest: str
    trigger: str = "timeout"
    action: str | None = None

    def label(self) -> str:
        after = self.after if isinstance(self.after, str) else f"{self.after:g}s"
        return f"after {after}"


@dataclass(frozen=True, slots=True)
class StateDecl:
    name: str
    final: bool = False
    timeout: Timeout | None = None


@dataclass(frozen=True, slots=True)
class TransitionDecl:
    trigger: str
    source: str
    dest: str | None
    conditions: tuple[str, ...] = ()
    unless: tuple[str, ...] = ()
    after: str | None = None
    from_timeout: bool = False

    @property
    def internal(self) -> bool:
        """An internal transition runs its action without leaving the state."""
        return self.dest is None

    def guard_label(self) -> str:
        parts = [*self.conditions, *(f"!{name}" for name in self.unless)]
        return f" [{' && '.join(parts)}]" if parts else ""


@dataclass(frozen=True)
class Declaration:
    """One lifecycle, validated at definition (see the module docstring)."""

    name: str
    states: Sequence[str | Mapping[str, Any]]
    transitions: Sequence[Mapping[str, Any]]
    initial: str | None = None
    ignore: Sequence[tuple[str, str]] = ()
    callbacks: Mapping[str, Callable[..., Any]] = field(default_factory=dict)
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    context: Callable[..., Any] | None = None
    description: str = ""

    # Normalised views, filled in __post_init__.
    state_decls: tuple[StateDecl, ...] = field(init=False)
    transition_decls: tuple[TransitionDecl, ...] = field(init=False)
    ignored_pairs: frozenset[tuple[str, str]] = field(init=False)
    initial_state: str = field(init=False)

    def __post_init__(self) -> None:
        states = tuple(_state(self.name, raw) for raw in self.states)
        object.__setattr__(self, "state_decls", states)
        names = [s.name for s in states]
        _check_unique(self.name, names)
        object.__setattr__(self, "initial_state", _initial(self.name, self.initial, self.states))
        known = frozenset(names)
        transitions = tuple(_expand_transitions(self, known))
        object.__setattr__(self, "transition_decls", transitions)
        object.__setattr__(self, "ignored_pairs", _ignored(self, known))
        _validate(self)

    # -- reading the table -------------------------------------------------------------

    @property
    def state_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.state_decls)

    @property
    def final_states(self) -> frozenset[str]:
        return frozenset(s.name for s in self.state_decls if s.final)

    @property
    def triggers(self) -> frozenset[str]:
        """Every event the machine knows, handled or ignored somewhere."""
        return frozenset(t.trigger for t in self.transition_decls) | frozenset(
            event for _, event in self.ignored_pairs
        )

    def state(self, name: str) -> StateDecl:
        for decl in self.state_decls:
            if decl.name == name:
                return decl
        raise LocalProtocolError(f"machine {self.name!r} has no state {name!r}")

    def handled_events(self, state: str) -> frozenset[str]:
        return frozenset(t.trigger for t in self.transition_decls if t.source == state)

    def ignored_events(self, state: str) -> frozenset[str]:
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


# -- normalisation ---------------------------------------------------------------------


def _fail(machine: str, message: str) -> LocalProtocolError:
    return LocalProtocolError(f"machine {machine!r}: {message}")


def _state(machine: str, raw: str | Mapping[str, Any]) -> StateDecl:
    if isinstance(raw, str):
        return StateDecl(raw)
    unknown = set(raw) - {"name", "final", "timeout", "initial"}
    if unknown:
        raise _fail(machine, f"state {raw.get('name')!r} has unknown keys {sorted(unknown)}")
    timeout = raw.get("timeout")
    if timeout is not None and not isinstance(timeout, Timeout):
        raise _fail(machine, f"state {raw['name']!r}: timeout must be a Timeout")
    return StateDecl(str(raw["name"]), bool(raw.get("final", False)), timeout)


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


def _expand_transitions(decl: Declaration, known: frozenset[str]) -> Iterable[TransitionDecl]:
    allowed = {"trigger", "source", "dest", "conditions", "unless", "after"}
    for raw in decl.transitions:
        unknown = set(raw) - allowed
        if unknown:
            raise _fail(decl.name, f"transition {dict(raw)!r} has unknown keys {sorted(unknown)}")
        trigger = raw.get("trigger")
        if not isinstance(trigger, str) or not trigger:
            raise _fail(decl.name, f"transition {dict(raw)!r} needs a trigger")
        dest = raw.get("dest")
        if dest is not None and dest not in known:
            raise _fail(decl.name, f"transition {trigger!r} names unknown dest state {dest!r}")
        sources = _sources(decl, raw.get("source"), known, f"transition {trigger!r}")
        for source in sources:
            yield TransitionDecl(
                trigger=trigger,
                source=source,
                dest=dest,
                conditions=_as_tuple(raw.get("conditions")),
                unless=_as_tuple(raw.get("unless")),
                after=raw.get("after"),
            )
    for state in decl.state_decls:
        if state.timeout is not None:
            if state.timeout.dest not in known:
                raise _fail(
                    decl.name,
                    f"timeout of state {state.name!r} names unknown dest {state.timeout.dest!r}",
                )
            yield TransitionDecl(
                state.timeout.trigger,
                state.name,
                state.timeout.dest,
                after=state.timeout.action,
                from_timeout=True,
            )


def _sources(
    decl: Declaration, raw: str | Sequence[str] | None, known: frozenset[str], what: str
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


def _ignored(decl: Declaration, known: frozenset[str]) -> frozenset[tuple[str, str]]:
    pairs: set[tuple[str, str]] = set()
    for source, event in decl.ignore:
        if source == ANY_STATE:
            pairs.update((s, event) for s in known)
        elif source not in known:
            raise _fail(decl.name, f"ignored event {event!r} names unknown state {source!r}")
        else:
            pairs.add((source, event))
    return frozenset(pairs)


# -- validation --------------------------------------------------------------------------


def _validate(decl: Declaration) -> None:
    _validate_callbacks(decl)
    _validate_alternatives(decl)
    _validate_graph(decl)


def _validate_callbacks(decl: Declaration) -> None:
    for t in decl.transition_decls:
        for name in (*t.conditions, *t.unless, *_as_tuple(t.after)):
            if not callable(decl.callbacks.get(name)):
                raise _fail(decl.name, f"transition {t.trigger!r} names missing callback {name!r}")
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


def _validate_alternatives(decl: Declaration) -> None:
    by_pair: dict[tuple[str, str], list[TransitionDecl]] = {}
    for t in decl.transition_decls:
        by_pair.setdefault((t.source, t.trigger), []).append(t)
    for (source, trigger), options in by_pair.items():
        if (source, trigger) in decl.ignored_pairs:
            raise _fail(decl.name, f"event {trigger!r} in state {source!r} is handled and ignored")
        if source in decl.final_states:
            raise _fail(decl.name, f"final state {source!r} has an exit on {trigger!r}")
        guards = [(t.conditions, t.unless) for t in options]
        for index, guard in enumerate(guards):
            unguarded_before_last = guard == ((), ()) and index < len(guards) - 1
            if unguarded_before_last or guard in guards[:index]:
                raise _fail(
                    decl.name,
                    f"trigger {trigger!r} from state {source!r} is declared twice "
                    "without distinguishing guards",
                )


def _validate_graph(decl: Declaration) -> None:
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
