"""Readable lifecycle diagrams (issue 19, item 0): groups drawn as composite states, a
timeout or abort leaving a whole group drawn once, quiet events in a table, a direction
that fits a page column."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import pytest

from kvhandoff.machines.catalog import DECLARATIONS
from kvhandoff.machines.diagram_groups import GROUPS
from kvhandoff.machines.runtime.declaration import Declaration, Timeout
from kvhandoff.machines.runtime.diagrams import (
    main_path,
    quiet_events,
    render_mermaid,
    timeout_label,
)
from kvhandoff.machines.runtime.events import Event
from kvhandoff.machines.runtime.groups import normalise_groups
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.specs import diagram_groups, expected_specs, mermaid_of


@dataclass(slots=True)
class Ctx:
    key: str


@dataclass(frozen=True, slots=True)
class Go(Event): ...


@dataclass(frozen=True, slots=True)
class Abort(Event): ...


@dataclass(frozen=True, slots=True)
class Ping(Event): ...


@dataclass(frozen=True, slots=True)
class Expired(Event): ...


WATCH = Timeout("watch_s", "expired", Expired)


def _decl(**extra: Any) -> Declaration[Ctx]:
    return Declaration(
        name="t.watched",
        context=Ctx,
        states=[
            {"name": "a", "timeout": WATCH, "tags": ("early",)},
            {"name": "b", "timeout": WATCH, "tags": ("early",)},
            {"name": "c", "timeout": WATCH},
            {"name": "done", "final": True},
            {"name": "expired", "final": True},
            {"name": "aborted", "final": True},
        ],
        initial="a",
        transitions=[
            {"trigger": Go, "source": "a", "dest": "b"},
            {"trigger": Go, "source": "b", "dest": "c"},
            {"trigger": Go, "source": "c", "dest": "done"},
            {"trigger": Abort, "source": ["a", "b", "c"], "dest": "aborted"},
            {"trigger": Ping, "source": ["a", "b"], "dest": None},
        ],
        ignore=[("c", Ping)],
        config_defaults={"watch_s": 5.0},
        **extra,
    )


def _edges(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "-->" in line]


def test_groups_are_validated_at_definition() -> None:
    decl = _decl(groups=[{"label": "early on", "tag": "early"}])
    assert [(g.label, g.states) for g in decl.group_decls] == [("early on", ("a", "b"))]
    for bad, message in [
        ([{"label": "x", "states": ["nope"]}], "unknown states"),
        ([{"label": "x", "tag": "nope"}], "no state carries tag"),
        ([{"label": "", "tag": "early"}], "non-empty label"),
        ([{"label": "x", "tag": "early", "states": ["a"]}], "needs one of"),
        ([{"label": "x", "tag": "early"}, {"label": "y", "states": ["b"]}], "one level deep"),
    ]:
        with pytest.raises(LocalProtocolError, match=message):
            _decl(groups=bad)


def test_a_timeout_and_an_abort_leaving_a_group_are_drawn_once() -> None:
    text = render_mermaid(_decl())  # no groups declared: the watched states form one
    assert 'state "watch_s armed" as g_a {' in text
    edges = _edges(text)
    assert "g_a --> expired: expired (after watch_s)" in edges
    assert "g_a --> aborted: abort" in edges
    labels = [e.partition(": ")[2] for e in edges]
    assert labels.count("abort") == 1 and labels.count("expired (after watch_s)") == 1
    assert not any(e.startswith(("a --> a", "b --> b")) for e in edges), "self-loops not drawn"
    assert text.count("{") == text.count("}") == 1, "composites one level deep"


def test_a_timeout_shared_by_two_groups_goes_through_one_merge_point() -> None:
    decl = _decl(groups=[{"label": "early", "tag": "early"}, {"label": "late", "states": ["c"]}])
    text = render_mermaid(decl)
    assert "<<choice>>" in text
    assert sum("expired (after watch_s)" in e for e in _edges(text)) == 1


def test_quiet_events_are_listed_not_drawn() -> None:
    rows = {(r.event, r.states, r.outcome) for r in quiet_events(_decl())}
    assert rows == {("ping", ("a", "b"), "stays"), ("ping", ("c",), "ignored")}


def test_main_path_and_direction() -> None:
    decl = _decl()
    assert main_path(decl) == ("a", "b", "c", "done")
    assert "direction LR" in render_mermaid(decl)
    assert "class a,b,c,done mainpath" in render_mermaid(decl)
    assert "direction TB" in render_mermaid(decl, direction="TB")


def test_main_path_can_be_pointed_at_the_success() -> None:
    decl = _decl()
    assert main_path(decl, "aborted") == ("a", "b", "c", "aborted")
    assert main_path(decl, "no-such-state") == main_path(decl)


def test_timeout_labels_state_the_timeout_once() -> None:
    assert timeout_label("handshake_timeout", "handshake_timeout") == "after handshake_timeout"
    assert timeout_label("lease_expired", "kv_lease_duration") == (
        "lease_expired (after kv_lease_duration)"
    )
    assert timeout_label("expired", 2.5) == "expired (after 2.5s)"


@pytest.mark.parametrize("decl", DECLARATIONS, ids=lambda d: d.name)
def test_every_machine_draws_each_timeout_and_abort_once(decl: Declaration[Any]) -> None:
    """Each timeout is drawn once, and an abort once per state it leads to (an abort
    with two outcomes, such as drop-then-release and release-now, is two edges)."""
    text = mermaid_of(decl)
    edges = [e.partition(": ") for e in _edges(text)]
    parts = [
        (head.split("-->")[-1].strip(), p.strip())
        for head, _sep, label in edges
        for p in label.split(" | ")
    ]
    watched = {
        timeout_label(s.timeout.event.trigger, s.timeout.after)
        for s in decl.state_decls
        if s.timeout is not None
    } | ({"abort"} & decl.triggers)
    for label in watched:
        drawn = [dest for dest, p in parts if p == label or p.startswith(label + " [")]
        if label == "abort":
            assert len(drawn) == len(set(drawn)), (label, drawn)
        else:
            assert len(drawn) <= 1, (label, drawn)
    assert not re.search(r"\{[^}]*\{", text), "composites are one level deep"
    for group in diagram_groups(decl):
        assert f'state "{group.label}" as' in text


def test_diagram_group_labels_name_catalog_machines() -> None:
    names = {d.name for d in DECLARATIONS}
    assert set(GROUPS) <= names
    for decl in DECLARATIONS:
        normalise_groups(decl.name, GROUPS.get(decl.name, ()), decl.state_decls, lenient=True)


def test_generated_pages_carry_the_quiet_events_table() -> None:
    pages = expected_specs()
    lease = pages["push_p_lease.md"]
    assert "```mermaid" in lease
    if any(quiet_events(d) for d in DECLARATIONS if d.name == "push.p_lease"):
        assert "| event | in | what happens |" in lease


@dataclass(frozen=True, slots=True)
class Look(Event):
    near: bool = False


def _near(ctx: Ctx, event: Look) -> bool:
    return event.near


def _deciding(internal: bool = False) -> Declaration[Ctx]:
    return Declaration(
        name="t.deciding",
        context=Ctx,
        states=[{"name": "a"}, {"name": "b"}, {"name": "far"}, {"name": "done", "final": True}],
        initial="a",
        transitions=[
            {"trigger": Look, "source": "a", "dest": "b", "conditions": "near"},
            (
                {"trigger": Look, "source": "b", "dest": None, "conditions": "near"}
                if internal
                else {"trigger": Look, "source": "b", "dest": "b", "conditions": "near"}
            ),
            {"trigger": Look, "source": ["a", "b"], "dest": "far"},
            {"trigger": Go, "source": ["a", "b", "far"], "dest": "done"},
        ],
        callbacks={"near": _near},
    )


def test_the_same_choice_in_several_states_goes_through_one_decision_point() -> None:
    """`b` re-entering itself on `look [near]` is what `a` does too (it goes to `b`):
    both choose alike, so each alternative is drawn once, out of one diamond."""
    edges = _edges(render_mermaid(_deciding()))
    assert "a --> decide_look" in edges and "b --> decide_look" in edges
    assert "decide_look --> b: look [near]" in edges
    assert "decide_look --> far: look" in edges
    assert sum(e.endswith(": look [near]") for e in edges) == 1
    # An internal transition (b stays, no re-entry) is another choice: drawn per state.
    edges = _edges(render_mermaid(_deciding(internal=True)))
    assert not any("decide_" in e for e in edges)
    assert "a --> b: look [near]" in edges and "b --> far: look" in edges


def test_the_ec_settlement_draws_each_of_its_choices_once() -> None:
    decl = next(d for d in DECLARATIONS if d.name == "ec.settlement")
    edges = _edges(mermaid_of(decl))
    for label in ("consider [computed]", "consider [loadable]", "consider [own_save_pending]"):
        assert sum(label in e for e in edges) == 1, label
    assert "new --> decide_consider" in edges and "awaiting_save --> decide_consider" in edges
