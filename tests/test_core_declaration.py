"""Framework core: declarations are validated when they are defined (issue 2, item 3)."""

from __future__ import annotations

from typing import Any

import pytest

from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.protocol.errors import LocalProtocolError


def declare(**overrides: Any) -> Declaration:
    spec: dict[str, Any] = {
        "name": "t.m",
        "states": ["a", "b", {"name": "z", "final": True}],
        "initial": "a",
        "transitions": [
            {"trigger": "go", "source": "a", "dest": "b"},
            {"trigger": "end", "source": "b", "dest": "z"},
        ],
    }
    spec.update(overrides)
    return Declaration(**spec)


def test_core_valid_declaration_reads_back() -> None:
    decl = declare()
    assert decl.initial_state == "a"
    assert decl.final_states == {"z"}
    assert decl.edges() == {("a", "go", "b"), ("b", "end", "z")}


def test_core_unknown_state_in_transition_is_named() -> None:
    with pytest.raises(LocalProtocolError, match=r"'t.m'.*unknown dest state 'nowhere'"):
        declare(transitions=[{"trigger": "go", "source": "a", "dest": "nowhere"}])
    with pytest.raises(LocalProtocolError, match=r"unknown source state 'q'"):
        declare(transitions=[{"trigger": "go", "source": "q", "dest": "z"}])


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
                {"trigger": "go", "source": "a", "dest": "b"},
                {"trigger": "end", "source": "b", "dest": "z"},
                {"trigger": "x", "source": "island", "dest": "z"},
            ],
        )


def test_core_trap_state_named() -> None:
    with pytest.raises(LocalProtocolError, match=r"state 'b' is a trap"):
        declare(
            transitions=[
                {"trigger": "go", "source": "a", "dest": "b"},
                {"trigger": "end", "source": "a", "dest": "z"},
            ]
        )


def test_core_cycle_without_reaching_final_is_a_trap() -> None:
    with pytest.raises(LocalProtocolError, match=r"no final state is reachable"):
        declare(
            states=["a", "b", "c", {"name": "z", "final": True}],
            transitions=[
                {"trigger": "go", "source": "a", "dest": "b"},
                {"trigger": "x", "source": "a", "dest": "z"},
                {"trigger": "y", "source": "b", "dest": "c"},
                {"trigger": "y", "source": "c", "dest": "b"},
            ],
        )


def test_core_timeout_counts_as_an_exit() -> None:
    decl = declare(
        states=["a", {"name": "b", "timeout": Timeout(1.0, "z")}, {"name": "z", "final": True}],
        transitions=[{"trigger": "go", "source": "a", "dest": "b"}],
    )
    assert ("b", "timeout", "z") in decl.edges()


def test_core_duplicate_trigger_without_guards_rejected() -> None:
    with pytest.raises(LocalProtocolError, match=r"'go' from state 'a' is declared twice"):
        declare(
            transitions=[
                {"trigger": "go", "source": "a", "dest": "b"},
                {"trigger": "go", "source": "a", "dest": "z"},
                {"trigger": "end", "source": "b", "dest": "z"},
            ]
        )


def test_core_guarded_alternatives_accepted() -> None:
    decl = declare(
        transitions=[
            {"trigger": "go", "source": "a", "dest": "b", "conditions": "ok"},
            {"trigger": "go", "source": "a", "dest": "z"},
            {"trigger": "end", "source": "b", "dest": "z"},
        ],
        callbacks={"ok": lambda inst, payload: True},
    )
    assert ("a", "go", "z") in decl.edges()


def test_core_missing_callback_named() -> None:
    with pytest.raises(LocalProtocolError, match=r"missing callback 'ok'"):
        declare(
            transitions=[
                {"trigger": "go", "source": "a", "dest": "b", "conditions": "ok"},
                {"trigger": "end", "source": "b", "dest": "z"},
            ]
        )


def test_core_final_state_with_exit_rejected() -> None:
    with pytest.raises(LocalProtocolError, match=r"final state 'z' has an exit"):
        declare(
            transitions=[
                {"trigger": "go", "source": "a", "dest": "b"},
                {"trigger": "end", "source": "b", "dest": "z"},
                {"trigger": "again", "source": "z", "dest": "a"},
            ]
        )


def test_core_handled_and_ignored_conflict_rejected() -> None:
    with pytest.raises(LocalProtocolError, match=r"'go' in state 'a' is handled and ignored"):
        declare(ignore=[("a", "go")])


def test_core_timeout_config_key_needs_default() -> None:
    with pytest.raises(LocalProtocolError, match=r"config key 'ttl'"):
        declare(
            states=[
                "a",
                {"name": "b", "timeout": Timeout("ttl", "z")},
                {"name": "z", "final": True},
            ]
        )


def test_core_star_source_expands_to_non_final_states() -> None:
    decl = declare(
        transitions=[
            {"trigger": "go", "source": "a", "dest": "b"},
            {"trigger": "abort", "source": "*", "dest": "z"},
        ]
    )
    assert {("a", "abort", "z"), ("b", "abort", "z")} <= decl.edges()
