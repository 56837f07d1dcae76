"""Typed callbacks: a declaration's guards and actions are checked when it is defined.

An action is `(ctx: Context, event: Event) -> list[Effect] | None`, a guard
`(ctx: Context, event: Event) -> bool`: the context is the machine's (or a base of it),
the event annotation admits every trigger that runs the callback, and `Any` appears
nowhere in the signature, so mypy checks everything that crosses a transition.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event
from kvhandoff.protocol.errors import LocalProtocolError

if TYPE_CHECKING:
    from kvhandoff.machines.runtime.declaration import Declaration


def fail(machine: str, message: str) -> LocalProtocolError:
    return LocalProtocolError(f"machine {machine!r}: {message}")


def hints_of(machine: str, obj: object, what: str) -> dict[str, Any]:
    try:
        return typing.get_type_hints(obj)
    except Exception as exc:  # a name the annotations use is not importable at runtime
        raise fail(machine, f"cannot resolve the annotations of {what}: {exc}") from exc


def _members(hint: object) -> tuple[object, ...]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return typing.get_args(hint)
    return (hint,)


def _mentions_any(hint: object) -> bool:
    return hint is Any or any(_mentions_any(arg) for arg in typing.get_args(hint))


def check_signature(
    decl: Declaration[Any],
    name: str,
    fn: Callable[..., object],
    role: str,
    events: set[type[Event]],
) -> None:
    """`(ctx: Context, event: Event) -> list[Effect] | None` for actions, `-> bool` for
    guards; the event annotation admits every trigger that runs the callback; no Any."""
    where = f"{role} {name!r}"
    params = list(inspect.signature(fn).parameters.values())
    if len(params) != 2:
        raise fail(decl.name, f"{where} must take (ctx, event), takes {len(params)} parameters")
    hints = hints_of(decl.name, fn, where)
    missing = [p.name for p in params if p.name not in hints] + (
        [] if "return" in hints else ["return"]
    )
    if missing:
        raise fail(decl.name, f"{where} is not fully annotated (missing {missing})")
    if any(_mentions_any(hint) for hint in hints.values()):
        raise fail(decl.name, f"{where} uses Any in its signature")
    ctx_hint = hints[params[0].name]
    if not (isinstance(ctx_hint, type) and issubclass(decl.context, ctx_hint)):
        raise fail(
            decl.name, f"{where}: ctx is annotated {ctx_hint!r}, not {decl.context.__name__}"
        )
    admitted = [m for m in _members(hints[params[1].name]) if isinstance(m, type)]
    for event in sorted(events, key=lambda e: e.__name__):
        if not any(issubclass(event, m) for m in admitted):
            raise fail(
                decl.name,
                f"{where}: event is annotated {hints[params[1].name]!r}, "
                f"which does not admit {event.__name__}",
            )
    returns = hints["return"]
    if role == "guard":
        ok = returns is bool
    else:
        ok = returns is type(None) or (
            typing.get_origin(returns) is list
            and all(isinstance(a, type) and issubclass(a, Effect) for a in typing.get_args(returns))
        )
    if not ok:
        want = "bool" if role == "guard" else "list[Effect] or None"
        raise fail(decl.name, f"{where} returns {returns!r}, not {want}")
