"""Framework core: declarations are validated when they are defined, typed callbacks
included (runtime v2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.machines.runtime.events import Event, PeerEvent, snake_case
from kvhandoff.protocol.errors import LocalProtocolError


@dataclass(slots=True)
class Ctx:
    key: str
    n: int = 0


@dataclass(slots=True)
class OtherCtx:
    key: str


class Go(Event):
    __slots__ = ()


class End(Event):
    __slots__ = ()


class X(Event):
    __slots__ = ()


class Y(Event):
    __slots__ = ()


class Again(Event):
    __slots__ = ()


class Abort(Event):
    __slots__ = ()


class Tick(Event):
    __slots__ = ()


@dataclass(frozen=True, slots=True)
class Needs(Event):
    value: int


class Ack(PeerEvent):
    __slots__ = ()


def declare(**overrides: Any) -> Declaration[Ctx]:
    spec: dict[str, Any] = {
        "name": "t.m",
        "context": Ctx,
        "states": ["a", "b", {"name": "z", "final": True}],
        "initial": "a",
        "transitions": [
            {"trigger": Go, "source": "a", "dest": "b"},
            {"trigger": End, "source": "b", "dest": "z"},
        ],
    }
    spec.update(overrides)
    return Declaration(**spec)


def ok(ctx: Ctx, event: Go) -> bool:
    return True


def count(ctx: Ctx, event: Go | End) -> list[Effect]:
    ctx.n += 1
    return [Metric("n")]


def test_core_valid_declaration_reads_back() -> None:
    decl = declare()
    assert decl.initial_state == "a"
    assert decl.final_states == {"z"}
    assert decl.edges() == {("a", "go", "b"), ("b", "end", "z")}
    assert decl.events == {Go, End}
    assert hash(decl) == id(decl) // 16 or decl == decl, "a declaration is its own handle"


def test_core_trigger_names_are_snake_case_of_the_event_class() -> None:
    assert snake_case("WatchdogExpired") == "watchdog_expired"
    assert snake_case("HBNotif") == "hb_notif"
    assert Ack.trigger == "ack" and Ack.from_peer and not Go.from_peer


def test_core_unknown_state_in_transition_is_named() -> None:
    with pytest.raises(LocalProtocolError, match=r"'t.m'.*unknown dest 'nowhere'"):
        declare(transitions=[{"trigger": Go, "source": "a", "dest": "nowhere"}])
    with pytest.raises(LocalProtocolError, match=r"unknown source state 'q'"):
        declare(transitions=[{"trigger": Go, "source": "q", "dest": "z"}])


def test_core_trigger_must_be_an_event_class() -> None:
    with pytest.raises(LocalProtocolError, match=r"must be an Event subclass, got 'go'"):
        declare(transitions=[{"trigger": "go", "source": "a", "dest": "z"}])


def test_core_context_needs_a_key_field() -> None:
    @dataclass(slots=True)
    class Keyless:
        blocks: int = 0

    with pytest.raises(LocalProtocolError, match="needs a `key` field"):
        declare(context=Keyless)


def test_core_two_initial_states_rejected() -> None:
    with pytest.raises(LocalProtocolError, match=r"exactly one initial state.*\['a', 'b'\]"):
        declare(states=["a", {"name": "b", "initial": True}, {"name": "z", "final": True}])


def test_core_missing_initial_state_rejected() -> None:
    with pytest.raises(LocalProtocolError, match="no initial state"):
        declare(initial=None)


def test_core_unreachable_state_named() -> None:
    with pytest.raises(LocalProtocolError, match=r"states \['island'\] are unreachable"):
        declare(
            states=["a", "b", "island", {"name": "z", "final": True}],
            transitions=[
                {"trigger": Go, "source": "a", "dest": "b"},
                {"trigger": End, "source": "b", "dest": "z"},
                {"trigger": X, "source": "island", "dest": "z"},
            ],
        )


def test_core_trap_state_named() -> None:
    with pytest.raises(LocalProtocolError, match=r"state 'b' is a trap"):
        declare(
            transitions=[
                {"trigger": Go, "source": "a", "dest": "b"},
                {"trigger": End, "source": "a", "dest": "z"},
            ]
        )


def test_core_cycle_without_reaching_final_is_a_trap() -> None:
    with pytest.raises(LocalProtocolError, match=r"no final state is reachable"):
        declare(
            states=["a", "b", "c", {"name": "z", "final": True}],
            transitions=[
                {"trigger": Go, "source": "a", "dest": "b"},
                {"trigger": X, "source": "a", "dest": "z"},
                {"trigger": Y, "source": "b", "dest": "c"},
                {"trigger": Y, "source": "c", "dest": "b"},
            ],
        )


def test_core_timeout_counts_as_an_exit() -> None:
    decl = declare(
        states=[
            "a",
            {"name": "b", "timeout": Timeout(1.0, "z", Tick)},
            {"name": "z", "final": True},
        ],
        transitions=[{"trigger": Go, "source": "a", "dest": "b"}],
    )
    assert ("b", "tick", "z") in decl.edges()


def test_core_timeout_event_must_be_constructible_without_fields() -> None:
    with pytest.raises(LocalProtocolError, match="must be constructible without fields"):
        declare(
            states=[
                "a",
                {"name": "b", "timeout": Timeout(1.0, "z", Needs)},
                {"name": "z", "final": True},
            ],
            transitions=[{"trigger": Go, "source": "a", "dest": "b"}],
        )


def test_core_duplicate_trigger_without_guards_rejected() -> None:
    with pytest.raises(LocalProtocolError, match=r"'go' from state 'a' is declared twice"):
        declare(
            transitions=[
                {"trigger": Go, "source": "a", "dest": "b"},
                {"trigger": Go, "source": "a", "dest": "z"},
                {"trigger": End, "source": "b", "dest": "z"},
            ]
        )


def test_core_guarded_alternatives_accepted() -> None:
    decl = declare(
        transitions=[
            {"trigger": Go, "source": "a", "dest": "b", "conditions": "ok"},
            {"trigger": Go, "source": "a", "dest": "z"},
            {"trigger": End, "source": "b", "dest": "z", "after": "count"},
        ],
        callbacks={"ok": ok, "count": count},
    )
    assert ("a", "go", "z") in decl.edges()


def test_core_missing_callback_named() -> None:
    with pytest.raises(LocalProtocolError, match=r"missing callback 'ok'"):
        declare(
            transitions=[
                {"trigger": Go, "source": "a", "dest": "b", "conditions": "ok"},
                {"trigger": End, "source": "b", "dest": "z"},
            ]
        )


def _with_action(fn: Any, role: str = "after") -> Declaration[Ctx]:
    return declare(
        transitions=[
            {"trigger": Go, "source": "a", "dest": "b", role: "cb"},
            {"trigger": End, "source": "b", "dest": "z"},
            *([{"trigger": Go, "source": "a", "dest": "z"}] if role == "conditions" else []),
        ],
        callbacks={"cb": fn},
    )


def any_event(ctx: Ctx, event: Any) -> list[Effect]:
    return []


def any_effects(ctx: Ctx, event: Go) -> list[Any]:
    return []


def wrong_ctx(ctx: OtherCtx, event: Go) -> list[Effect]:
    return []


def wrong_event(ctx: Ctx, event: End) -> list[Effect]:
    return []


def unannotated(ctx, event):  # type: ignore[no-untyped-def]
    return []


def returns_objects(ctx: Ctx, event: Go) -> list[object]:
    return []


def guard_returns_int(ctx: Ctx, event: Go) -> int:
    return 1


def three_params(ctx: Ctx, event: Go, extra: int) -> None:
    return None


def test_core_action_signatures_are_typed_without_any() -> None:
    """Every callback is `(ctx: Context, event: Event) -> list[Effect] | None` (guards
    `-> bool`), checked when the declaration is defined."""
    cases = [
        (any_event, "after", "uses Any"),
        (any_effects, "after", "uses Any"),
        (wrong_ctx, "after", "ctx is annotated"),
        (wrong_event, "after", "does not admit Go"),
        (unannotated, "after", "not fully annotated"),
        (returns_objects, "after", r"not list\[Effect\] or None"),
        (guard_returns_int, "conditions", "not bool"),
        (three_params, "after", "must take"),
    ]
    for fn, role, message in cases:
        with pytest.raises(LocalProtocolError, match=message):
            _with_action(fn, role)
    assert _with_action(count).callbacks["cb"] is count


def test_core_final_state_with_exit_rejected() -> None:
    with pytest.raises(LocalProtocolError, match=r"final state 'z' has an exit"):
        declare(
            transitions=[
                {"trigger": Go, "source": "a", "dest": "b"},
                {"trigger": End, "source": "b", "dest": "z"},
                {"trigger": Again, "source": "z", "dest": "a"},
            ]
        )


def test_core_handled_and_ignored_conflict_rejected() -> None:
    with pytest.raises(LocalProtocolError, match=r"'go' in state 'a' is handled and ignored"):
        declare(ignore=[("a", Go)])


def test_core_timeout_config_key_needs_default() -> None:
    with pytest.raises(LocalProtocolError, match=r"config key 'ttl'"):
        declare(
            states=[
                "a",
                {"name": "b", "timeout": Timeout("ttl", "z", Tick)},
                {"name": "z", "final": True},
            ]
        )


def test_core_tags_must_be_identifiers() -> None:
    with pytest.raises(LocalProtocolError, match="tags must be a sequence of identifiers"):
        declare(states=[{"name": "a", "tags": "leased"}, "b", {"name": "z", "final": True}])
    decl = declare(states=[{"name": "a", "tags": ["leased"]}, "b", {"name": "z", "final": True}])
    assert decl.tags == {"leased"} and decl.states_tagged("leased") == {"a"}


def test_core_star_source_expands_to_non_final_states() -> None:
    decl = declare(
        transitions=[
            {"trigger": Go, "source": "a", "dest": "b"},
            {"trigger": Abort, "source": "*", "dest": "z"},
        ]
    )
    assert {("a", "abort", "z"), ("b", "abort", "z")} <= decl.edges()
