"""Mermaid state diagrams rendered from declarations, drawn for a reader.

The text depends on the declaration (and the groups it is drawn with) alone:

- each group of states (`groups.py`) is a labelled composite state, one level deep; a
  machine without declared groups is drawn with the states that share one timeout
  (one watchdog or lease spanning several states) as a group;
- a transition that leaves every state of a group alike (the same event, guard, action
  and destination outside the group: a timeout, an abort) is drawn once, from the group;
- an event that chooses among the same guarded alternatives in several states (the same
  guards, in the same order, to the same destinations; a re-entry of one of those states
  counts as going there) is drawn through one decision point (a small diamond): the
  states lead into it unlabelled and each alternative leaves it once, with its label;
- a timeout or an event still leaving several places alike is drawn through one merge
  point (a small diamond), so its label is written once;
- events that leave the state as it is (internal transitions and self-loops) and the
  events a state ignores are not drawn: `quiet_events` lists them for a table under the
  picture;
- the main path (the longest path from the initial state to a final one without a
  timeout) is emitted first and drawn in bold, and the direction is the one whose
  estimated width fits a page column.
"""

from __future__ import annotations

import itertools
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.runtime.declaration import Declaration, TransitionDecl
from kvhandoff.machines.runtime.groups import GroupDecl

_SAFE = re.compile(r"[^A-Za-z0-9_]")

PAGE_WIDTH_PX = 900
"""What a page column holds; a left-to-right drawing estimated wider is drawn top-down."""
_CHAR_PX = 7.5  # one character of a state name or an edge label, roughly
_NODE_PAD_PX = 40
_RANK_GAP_PX = 50
_LABEL_WRAP_PX = 200


def safe_id(name: str) -> str:
    return _SAFE.sub("_", name)


@dataclass(frozen=True, slots=True)
class QuietEvent:
    """A row of the table under the picture: `event` in `states` does `outcome`."""

    event: str
    states: tuple[str, ...]
    outcome: str


@dataclass(frozen=True, slots=True)
class _Sig:
    """What makes two transitions the same transition (but for their source)."""

    trigger: str
    dest: str
    guard: str
    after: str | None
    timeout: str | None  # the timeout's label, for one fired by a timeout


def derived_groups(decl: Declaration[Any]) -> tuple[GroupDecl, ...]:
    """The default groups: the non-final states sharing one timeout (two or more)."""
    by_timeout: dict[object, list[str]] = defaultdict(list)
    for state in decl.state_decls:
        if state.timeout is not None and not state.final:
            by_timeout[state.timeout].append(state.name)
    return tuple(
        GroupDecl(f"{timeout.after} armed" if isinstance(timeout.after, str) else "timed", tuple(s))
        for timeout, s in by_timeout.items()
        if len(s) >= 2 and hasattr(timeout, "after")
    )


def groups_of(decl: Declaration[Any], extra: Sequence[GroupDecl] = ()) -> tuple[GroupDecl, ...]:
    """The groups `decl` is drawn with: its own, else `extra`, else the derived ones."""
    return decl.group_decls or tuple(extra) or derived_groups(decl)


def timeout_label(trigger: str, after: float | str) -> str:
    if isinstance(after, str):
        return f"after {after}" if after == trigger else f"{trigger} (after {after})"
    return f"{trigger} (after {after:g}s)"


def _sig(decl: Declaration[Any], t: TransitionDecl) -> _Sig:
    timeout = decl.state(t.source).timeout if t.from_timeout else None
    label = None if timeout is None else timeout_label(t.trigger, timeout.after)
    dest = t.dest if t.dest is not None else t.source
    return _Sig(t.trigger, dest, t.guard_label(), t.after, label)


def _label(sig: _Sig) -> str:
    return (sig.timeout or sig.trigger) + sig.guard


def _quiet(t: TransitionDecl) -> bool:
    return t.dest is None or t.dest == t.source


def main_path(decl: Declaration[Any], to: str | None = None) -> tuple[str, ...]:
    """The longest simple path from the initial state to a final one (to `to`, when it
    names a final state) along transitions that no timeout fires (ties: the final state
    declared first, then the earlier declared states)."""
    order = {name: i for i, name in enumerate(decl.state_names)}
    succ: dict[str, list[str]] = defaultdict(list)
    for t in decl.transition_decls:
        if not _quiet(t) and not t.from_timeout and t.dest not in succ[t.source]:
            succ[t.source].append(t.dest)  # type: ignore[arg-type]  # not quiet: a dest
    for targets in succ.values():
        targets.sort(key=order.__getitem__)
    paths: list[tuple[str, ...]] = []
    dead_ends: list[tuple[str, ...]] = []  # for a machine with no final state

    def walk(path: tuple[str, ...]) -> None:
        here = path[-1]
        if here in decl.final_states:
            paths.append(path)
            return
        onward = [nxt for nxt in succ[here] if nxt not in path]
        if not onward:
            dead_ends.append(path)
        for nxt in onward:
            walk((*path, nxt))

    walk((decl.initial_state,))
    if to in decl.final_states and any(p[-1] == to for p in paths):
        paths = [p for p in paths if p[-1] == to]
    if not paths:
        return min(dead_ends, key=lambda p: (-len(p), [order[s] for s in p]))
    # Longest first; then the one ending in the final state declared first (declarations
    # list the success first: sent, received, done); then the earlier declared states.
    return min(paths, key=lambda p: (-len(p), order[p[-1]], [order[s] for s in p]))


def quiet_events(decl: Declaration[Any]) -> list[QuietEvent]:
    """Events that leave the state as it is, and events a state ignores."""
    rows: dict[tuple[str, str], list[str]] = defaultdict(list)
    options: dict[tuple[str, str], int] = defaultdict(int)
    for t in decl.transition_decls:
        options[(t.source, t.trigger)] += 1
    for t in decl.transition_decls:
        if not _quiet(t):
            continue
        guard = t.guard_label()
        if not guard and options[(t.source, t.trigger)] > 1:
            guard = " (otherwise)"
        if t.dest is None:
            outcome = "stays" + (f", runs `{t.after}`" if t.after else "")
        else:
            outcome = "re-enters (its timeout restarts)" + (
                f", runs `{t.after}`" if t.after else ""
            )
        rows[(t.trigger + guard, outcome)].append(t.source)
    for state, event in decl.ignored_pairs:
        rows[(event.trigger, "ignored")].append(state)
    order = {name: i for i, name in enumerate(decl.state_names)}
    return [
        QuietEvent(event, tuple(sorted(states, key=order.__getitem__)), outcome)
        for (event, outcome), states in sorted(rows.items())
    ]


def render_mermaid(
    decl: Declaration[Any],
    groups: Sequence[GroupDecl] | None = None,
    direction: str | None = None,
    main_to: str | None = None,
) -> str:
    """The `stateDiagram-v2` text of `decl`, deterministic for a given declaration."""
    groups = groups_of(decl) if groups is None else tuple(groups)
    order = {name: i for i, name in enumerate(decl.state_names)}
    path = main_path(decl, main_to)
    group_id = {g.label: f"g_{safe_id(g.states[0])}" for g in groups}
    edges: list[tuple[str, _Sig]] = []  # (source node, transition)
    finals_from: list[str] = []
    hoisted: set[tuple[str, _Sig]] = set()
    for group in groups:
        if len(group.states) < 2:
            continue
        gid, members = group_id[group.label], set(group.states)
        per_state = {
            s: sorted(
                {_sig(decl, t) for t in decl.transition_decls if t.source == s and not _quiet(t)},
                key=repr,
            )
            for s in group.states
        }
        shared = set(per_state[group.states[0]])
        for s in group.states[1:]:
            shared &= set(per_state[s])
        for trigger in sorted({sig.trigger for sig in shared}):
            # Hoist an event only when every member does exactly the same on it.
            first = [sig for sig in per_state[group.states[0]] if sig.trigger == trigger]
            same = all(
                [sig for sig in per_state[s] if sig.trigger == trigger] == first
                for s in group.states
            )
            if same and all(sig.dest not in members for sig in first):
                for sig in first:
                    edges.append((gid, sig))
                    hoisted.update((s, sig) for s in group.states)
        if members <= decl.final_states:
            finals_from.append(gid)
    grouped_finals = {s for g in groups if group_id[g.label] in finals_from for s in g.states}
    for t in decl.transition_decls:
        sig = _sig(decl, t)
        if not _quiet(t) and (t.source, sig) not in hoisted and (t.source, sig) not in edges:
            edges.append((t.source, sig))
    finals_from += [s for s in decl.state_names if s in decl.final_states - grouped_finals]
    edges, lines, junctions = _decision_points(decl, edges)
    merged, merge_junctions = _merge_points(edges)
    lines += merged
    junctions += merge_junctions
    labels: dict[tuple[str, str], list[str]] = {}
    for source, dest, label in lines:
        labels.setdefault((source, dest), [])
        if label and label not in labels[(source, dest)]:
            labels[(source, dest)].append(label)
    on_path = {(a, b) for a, b in itertools.pairwise(path)}

    def rank(item: tuple[tuple[str, str], list[str]]) -> tuple[int, int, int, str]:
        (source, dest), text = item
        return (
            0 if (source, dest) in on_path else 1,
            order.get(source, len(order)),
            order.get(dest, len(order)),
            " | ".join(text),
        )

    body = ["  classDef mainpath font-weight:bold,stroke-width:2px"]
    for group in groups:
        body.append(f'  state "{group.label}" as {group_id[group.label]} {{')
        body += [f"    {safe_id(s)}" for s in group.states]
        body.append("  }")
    body += [f"  state {j} <<choice>>" for j in junctions]
    grouped = {s for g in groups for s in g.states}
    body += [f'  state "{s}" as {safe_id(s)}' for s in decl.state_names if s not in grouped]
    body.append(f"  [*] --> {safe_id(decl.initial_state)}")
    for (source, dest), text in sorted(labels.items(), key=rank):
        suffix = f": {' | '.join(text)}" if text else ""
        body.append(f"  {safe_id(source)} --> {safe_id(dest)}{suffix}")
    body += [f"  {safe_id(s)} --> [*]" for s in finals_from]
    body.append(f"  class {','.join(safe_id(s) for s in path)} mainpath")
    chosen = direction or choose_direction(decl)
    header = ["---", f"title: {decl.name}", "---", "stateDiagram-v2", f"  direction {chosen}"]
    return "\n".join(header + body) + "\n"


def _decision_points(
    decl: Declaration[Any], edges: Sequence[tuple[str, _Sig]]
) -> tuple[list[tuple[str, _Sig]], list[tuple[str, str, str]], list[str]]:
    """The edges left, and the lines and junctions of the decision points: an event whose
    alternatives (two or more; every transition it takes in a state, a re-entry included,
    none of them internal or hoisted to a group) are the same in several states."""
    alternatives: dict[tuple[str, str], list[_Sig | None]] = defaultdict(list)
    for t in decl.transition_decls:
        alternatives[(t.source, t.trigger)].append(None if t.dest is None else _sig(decl, t))
    drawn = set(edges)
    sources: dict[tuple[str, tuple[_Sig, ...]], list[str]] = defaultdict(list)
    for (source, trigger), options in alternatives.items():
        sigs = tuple(sig for sig in options if sig is not None)
        if len(sigs) < 2 or len(sigs) < len(options):
            continue
        if all((source, sig) in drawn for sig in sigs if sig.dest != source):
            sources[(trigger, sigs)].append(source)
    taken: set[tuple[str, _Sig]] = set()
    lines: list[tuple[str, str, str]] = []
    junctions: list[str] = []
    for (trigger, sigs), places in sources.items():
        if len(places) < 2:
            continue
        junction = f"decide_{safe_id(trigger)}"
        while junction in junctions:
            junction += "_"
        junctions.append(junction)
        lines += [(place, junction, "") for place in places]
        lines += [(junction, sig.dest, _label(sig)) for sig in dict.fromkeys(sigs)]
        taken.update((place, sig) for place in places for sig in sigs)
    return [edge for edge in edges if edge not in taken], lines, junctions


def _merge_points(
    edges: Sequence[tuple[str, _Sig]],
) -> tuple[list[tuple[str, str, str]], list[str]]:
    """Edges as (source, dest, label); a transition leaving several places alike (a
    timeout from two, anything from three) goes through one merge point."""
    sources: dict[_Sig, list[str]] = defaultdict(list)
    for source, sig in edges:
        if source not in sources[sig]:
            sources[sig].append(source)
    lines: list[tuple[str, str, str]] = []
    junctions: list[str] = []
    for sig, places in sources.items():
        if len(places) >= 2 and (sig.timeout is not None or len(places) >= 3):
            junction = f"merge_{safe_id(sig.trigger)}_{safe_id(sig.dest)}"
            while junction in junctions:
                junction += "_"
            junctions.append(junction)
            lines += [(place, junction, "") for place in places]
            lines.append((junction, sig.dest, _label(sig)))
        else:
            lines += [(place, sig.dest, _label(sig)) for place in places]
    return lines, junctions


def choose_direction(decl: Declaration[Any]) -> str:
    """`LR` when the widest chain of states, drawn left to right, fits a page column."""
    return "LR" if estimated_lr_width(decl) <= PAGE_WIDTH_PX else "TB"


def estimated_lr_width(decl: Declaration[Any]) -> float:
    """The heaviest chain of states and edge labels along the drawn transitions (back
    edges left out, labels wrapped at 200 px as mermaid does), in pixels."""
    order = {name: i for i, name in enumerate(decl.state_names)}
    succ: dict[str, dict[str, float]] = defaultdict(dict)
    for t in decl.transition_decls:
        if _quiet(t):
            continue
        label = min(len(_label(_sig(decl, t))) * _CHAR_PX, _LABEL_WRAP_PX) + _RANK_GAP_PX
        dest = str(t.dest)
        succ[t.source][dest] = max(succ[t.source].get(dest, 0.0), label)
    # Drop back edges (a depth-first walk from the initial state, in declaration order).
    seen: set[str] = set()
    stack: set[str] = set()
    forward: dict[str, dict[str, float]] = defaultdict(dict)
    post: list[str] = []

    def visit(state: str) -> None:
        seen.add(state)
        stack.add(state)
        for nxt in sorted(succ[state], key=order.__getitem__):
            if nxt in stack:
                continue
            forward[state][nxt] = succ[state][nxt]
            if nxt not in seen:
                visit(nxt)
        stack.discard(state)
        post.append(state)

    visit(decl.initial_state)
    longest: dict[str, float] = {}
    for state in post:  # successors first
        own = len(state) * _CHAR_PX + _NODE_PAD_PX
        longest[state] = own + max(
            (w + longest[nxt] for nxt, w in forward[state].items()), default=0.0
        )
    return longest[decl.initial_state] + 2 * _RANK_GAP_PX
