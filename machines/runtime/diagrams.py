"""Mermaid state diagrams rendered from declarations through `transitions`' GraphMachine.

GraphMachine's mermaid output carries runtime styling (which state is active); the
renderer keeps only the states and edges, labels guards and timeouts, marks the initial
and final states, and sorts every line so the text depends on the declaration alone.
"""

from __future__ import annotations

import re
from typing import Any

from transitions.extensions import GraphMachine

from kvhandoff.machines.runtime.declaration import Declaration

_SAFE = re.compile(r"[^A-Za-z0-9_]")


def safe_id(name: str) -> str:
    return _SAFE.sub("_", name)


class _DiagramModel:
    """A blank model: GraphMachine attaches its trigger methods here, not to our instances."""


def render_mermaid(decl: Declaration[Any]) -> str:
    """The `stateDiagram-v2` text of `decl`, deterministic for a given declaration."""
    timeouts = {s.name: s.timeout for s in decl.state_decls if s.timeout is not None}
    transitions: list[dict[str, Any]] = []
    for t in decl.transition_decls:
        label = t.trigger
        if t.from_timeout:
            timeout = timeouts[t.source]
            label = f"{t.trigger} ({timeout.label()})"
        label += t.guard_label()
        dest = t.dest if t.dest is not None else t.source
        transitions.append({"trigger": label, "source": t.source, "dest": dest})
    machine = GraphMachine(
        model=_DiagramModel(),
        states=[{"name": s.name, "final": s.final} for s in decl.state_decls],
        transitions=transitions,
        initial=decl.initial_state,
        graph_engine="mermaid",
        auto_transitions=False,
        show_conditions=False,
        show_state_attributes=False,
    )
    graph_text = str(machine.models[0].get_graph().draw(None))
    return _normalise(decl, graph_text)


def _normalise(decl: Declaration[Any], text: str) -> str:
    states: list[str] = []
    edges: list[str] = []
    for line in (raw.strip() for raw in text.splitlines()):
        if line.startswith("state "):
            states.append(line)
        elif "-->" in line and not line.startswith("[*]"):
            source, _, rest = line.partition(" --> ")
            dest, _, label = rest.partition(": ")
            edges.append(f"{safe_id(source)} --> {safe_id(dest)}: {label}")
    finals = sorted(f"{safe_id(name)} --> [*]" for name in decl.final_states)
    ignored = sorted(
        f"note right of {safe_id(state)}: ignores "
        + ", ".join(sorted(e.trigger for e in decl.ignored_events(state)))
        for state in decl.state_names
        if decl.ignored_events(state)
    )
    header = ["---", f"title: {decl.name}", "---", "stateDiagram-v2", "  direction LR"]
    body = [
        *(f"  {line}" for line in sorted(set(states))),
        f"  [*] --> {safe_id(decl.initial_state)}",
        *(f"  {line}" for line in sorted(set(edges))),
        *(f"  {line}" for line in finals),
        *(f"  {line}" for line in ignored),
    ]
    return "\n".join(header + body) + "\n"
