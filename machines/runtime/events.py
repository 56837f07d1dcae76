"""Typed events: the vocabulary of every declared machine.

A trigger is a class. Its instances carry the payload, so an action's signature states
what crosses the transition and mypy checks it:

    @dataclass(frozen=True, slots=True)
    class Completion(PeerEvent):
        sender: str

    def count_completion(ctx: DRegistrationCtx, event: Completion) -> list[Effect]: ...

`Event.trigger` is the name the diagrams, recordings and the `transitions` reference
executor use: the class name in snake_case unless the class sets it. Events a peer can
provoke derive from `PeerEvent`: when one is not declared in the current state, or names
no live instance, the runtime raises `RemoteProtocolError` and changes nothing, so a
hostile or confused peer can never crash the engine with a local error.
"""

from __future__ import annotations

import re
from typing import ClassVar

_CAMEL_HUMP = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def snake_case(name: str) -> str:
    """`WatchdogExpired` -> `watchdog_expired`, `HBNotif` -> `hb_notif`."""
    return _CAMEL_HUMP.sub("_", name).lower()


class Event:
    """Base class of every trigger (subclasses are frozen slotted dataclasses)."""

    __slots__ = ()
    trigger: ClassVar[str] = "event"
    from_peer: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "trigger" not in cls.__dict__:
            cls.trigger = snake_case(cls.__name__)


class PeerEvent(Event):
    """An event provoked by bytes from a peer: undeclared means rejected, never a crash."""

    __slots__ = ()
    from_peer: ClassVar[bool] = True
