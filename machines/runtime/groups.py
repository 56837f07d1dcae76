"""Groups of states with a reader's label: what the diagrams draw as composite states.

A declaration may name them beside its states (`Declaration(..., groups=[...])`), each
by a tag its states carry, by the config key of the timeout they share, or by listing
them:

    groups=[
        {"label": "lease suspended: WRITE in flight", "tag": "pollable"},
        {"label": "lease running", "timeout": "kv_lease_duration"},
        {"label": "handshaking", "states": ["queued", "awaiting_handshake"]},
    ]

A group is a reading aid: dispatch never looks at it. Groups are one level deep (no
state in two groups), which is also what the mermaid renderer draws reliably.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvhandoff.machines.runtime.signatures import fail as _fail

if TYPE_CHECKING:
    from kvhandoff.machines.runtime.declaration import StateDecl


@dataclass(frozen=True, slots=True)
class GroupDecl:
    """A labelled set of states (in declaration order)."""

    label: str
    states: tuple[str, ...]


SELECTORS = ("states", "tag", "timeout")


def normalise_groups(
    machine: str,
    raw: Sequence[Mapping[str, Any]],
    states: Sequence[StateDecl],
    *,
    lenient: bool = False,
    where: str = "",
) -> tuple[GroupDecl, ...]:
    """Validated groups of `raw` over `states`; `where` names the source in messages.

    `lenient` (groups kept outside the declaration, which may change under them): a
    group takes only the states no earlier group took, and one left empty is dropped,
    instead of raising.
    """
    order = [s.name for s in states]
    taken: dict[str, str] = {}
    out: list[GroupDecl] = []
    origin = f" ({where})" if where else ""
    for spec in raw:
        if not isinstance(spec, Mapping):
            raise _fail(machine, f"group {spec!r}{origin} must be a mapping")
        label = spec.get("label")
        unknown = set(spec) - {"label", *SELECTORS}
        if unknown:
            raise _fail(machine, f"group {label!r}{origin} has unknown keys {sorted(unknown)}")
        if not isinstance(label, str) or not label.strip():
            raise _fail(machine, f"group {spec!r}{origin} needs a non-empty label")
        if sum(key in spec for key in SELECTORS) != 1:
            raise _fail(machine, f"group {label!r}{origin} needs one of {', '.join(SELECTORS)}")
        members = _members(machine, spec, states, label, origin, lenient)
        if lenient:
            members -= set(taken)
            if not members:
                continue
        for name in sorted(members):
            if name in taken:
                raise _fail(
                    machine,
                    f"state {name!r} is in groups {taken[name]!r} and {label!r}{origin} "
                    "(groups are one level deep)",
                )
            taken[name] = label
        out.append(GroupDecl(label.strip(), tuple(n for n in order if n in members)))
    return tuple(out)


def _members(
    machine: str,
    spec: Mapping[str, Any],
    states: Sequence[StateDecl],
    label: str,
    origin: str,
    lenient: bool,
) -> set[str]:
    if "tag" in spec:
        members = {s.name for s in states if spec["tag"] in s.tags}
        what = f"no state carries tag {spec['tag']!r}"
    elif "timeout" in spec:
        members = {
            s.name for s in states if s.timeout is not None and s.timeout.after == spec["timeout"]
        }
        what = f"no state's timeout reads {spec['timeout']!r}"
    else:
        listed = spec["states"]
        if isinstance(listed, str) or not listed:
            raise _fail(machine, f"group {label!r}{origin}: states must be a non-empty list")
        known = {s.name for s in states}
        missing = sorted(set(listed) - known)
        if missing and not lenient:
            raise _fail(machine, f"group {label!r}{origin} names unknown states {missing}")
        members, what = set(listed) & known, "none of its states exists"
    if not members and not lenient:
        raise _fail(machine, f"group {label!r}{origin}: {what}")
    return members
