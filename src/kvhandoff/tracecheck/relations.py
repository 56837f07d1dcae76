"""What the two sides of a protocol must agree on, as data checked against the traces.

A `Requires` rule says: when one side took a step (the `effect`), the other side must
have taken a step that causes it (the `cause`), for the same correlation id, somewhere
in the traces. A `Once` rule says a lifecycle ends at most once per correlation id
across every process (a lease freed twice, a grant released twice).

Steps name machines, triggers and state tags, never code: a rule whose machine, trigger
or tag the current declarations no longer have is skipped (and said so), so the
protocols can change under the checker. A rule is checked only when the traces hold the
cause's machine at all (a trace of D alone cannot say what P sent).

Correlation ids (`corr`): `base` is the request id without the engine's random suffix
(`protocol.request_ids`: P's and D's ids of one request share it; of a tuple key, its
first id); `key` the whole key; `key[N]` one element of a tuple key; `fields.a.b` a
path into the event's fields; `effect:Name.a.b` a path into the first effect of that
class the transition returned.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.protocol.request_ids import get_base_request_id


@dataclass(frozen=True, slots=True)
class Step:
    """A pattern over trace records of one machine.

    `event` (a trigger name) and `to_tag` (a tag of the destination state) narrow it to
    transitions; with neither, any record of the machine (its creation included) matches.
    """

    kind: str
    event: str | None = None
    to_tag: str | None = None
    corr: str = "base"

    def describe(self) -> str:
        what = self.event or "any line"
        if self.to_tag:
            what += f" into a state tagged {self.to_tag}"
        return f"{self.kind} {what}"


@dataclass(frozen=True, slots=True)
class Requires:
    name: str
    effect: Step
    cause: Step


@dataclass(frozen=True, slots=True)
class Once:
    name: str
    kind: str
    corr: str = "key"


Rule = Requires | Once

RULES: tuple[Rule, ...] = (
    # push: D's registration and P's lease of one request
    Requires(
        "D received what P never sent",
        effect=Step("push.d_registration", "completion"),
        cause=Step("push.p_lease", "write_posted"),
    ),
    Requires(
        "P matched a registration D never sent",
        effect=Step("push.p_lease", "matched"),
        cause=Step("push.d_registration", "reg_sent"),
    ),
    Requires(
        "D was told of a failure by a P that never held the request",
        effect=Step("push.d_registration", "write_failed"),
        cause=Step("push.p_lease"),
    ),
    Requires(
        "P's lease was extended by heartbeats for a request D never registered",
        effect=Step("push.p_lease", "heartbeat"),
        cause=Step("push.d_registration"),
    ),
    Once("a lease freed twice", "push.p_lease"),
    Once("a registration ended twice", "push.d_registration"),
    Once("a request ended twice on D", "push.d_request"),
    Once("a request ended twice on P", "push.p_request"),
    # pull: D reads P's blocks
    Requires(
        "P freed its lease for a READ D never posted",
        effect=Step("pull.p_lease", "completion"),
        cause=Step("pull.d_read", "read_posted"),
    ),
    Requires(
        "D read blocks P never leased",
        effect=Step("pull.d_read", "read_done"),
        cause=Step("pull.p_lease"),
    ),
    Once("a lease freed twice", "pull.p_lease"),
    Once("a read ended twice", "pull.d_read"),
    # encoder cache: the consumer's read and the producer's grant of one transfer
    Requires(
        "the consumer READ under a grant the producer never gave",
        effect=Step("ec.consumer_read", "ack", "read_posted", corr="fields.ack.transfer_id"),
        cause=Step("ec.producer_grant", "check", "leased", corr="key[1]"),
    ),
    Requires(
        "the producer answered a request the consumer never sent",
        effect=Step("ec.producer_grant", "check", corr="key[1]"),
        cause=Step("ec.consumer_read", "send", corr="effect:SendXferReq.req.transfer_id"),
    ),
    # No `Once` for grants: a duplicated XferReq that arrives after its grant ended is
    # answered again (and refused or leased again), which the protocol allows.
)


def inactive(rule: Rule, declarations: Mapping[str, Declaration[Any]]) -> str | None:
    """Why `rule` cannot be checked against these declarations (None when it can)."""
    steps = [rule.effect, rule.cause] if isinstance(rule, Requires) else [Step(rule.kind)]
    for step in steps:
        decl = declarations.get(step.kind)
        if decl is None:
            return f"no machine {step.kind!r}"
        if step.event is not None and step.event not in decl.triggers:
            return f"{step.kind} has no trigger {step.event!r}"
        if step.to_tag is not None and step.to_tag not in decl.tags:
            return f"{step.kind} has no state tag {step.to_tag!r}"
    return None


def matches(step: Step, data: Mapping[str, Any], decl: Declaration[Any]) -> bool:
    if data.get("kind") != step.kind:
        return False
    if step.event is None and step.to_tag is None:
        return True
    if data.get("type") != "transition":
        return False
    if step.event is not None and data.get("event") != step.event:
        return False
    return step.to_tag is None or data.get("to") in decl.states_tagged(step.to_tag)


def correlate(expr: str, data: Mapping[str, Any]) -> str | None:
    """The correlation id of a record under `expr` (None when it has none)."""
    key = data.get("key")
    if expr == "base":  # a tuple key (request id, rank...) correlates by its first id
        ids = [key] if isinstance(key, str) else key if isinstance(key, list) else []
        first = next((k for k in ids if isinstance(k, str)), None)
        return None if first is None else get_base_request_id(first)
    if expr == "key":
        return json.dumps(key, sort_keys=True)
    if expr.startswith("key[") and expr.endswith("]"):
        index = int(expr[4:-1])
        return _atom(key[index]) if isinstance(key, list) and len(key) > index else None
    if expr.startswith("fields."):
        return _atom(_path(data.get("fields"), expr[len("fields.") :]))
    if expr.startswith("effect:"):
        name, _, path = expr[len("effect:") :].partition(".")
        for effect in data.get("effects") or ():
            if isinstance(effect, dict) and effect.get("effect") == name:
                return _atom(_path(effect, path))
        return None
    raise ValueError(f"unknown correlation {expr!r}")


def _path(value: Any, path: str) -> Any:
    for part in path.split(".") if path else ():
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _atom(value: Any) -> str | None:
    if value is None or isinstance(value, dict | list):
        return None
    return str(value)
