"""A declaration whose timeouts may run an action (a shim until the core offers it).

The core `Timeout(after, dest, trigger)` takes its transition without an action, so a
machine cannot say "when the ack wait expires, release the destination and fall back".
`ActionDeclaration` adds `on_timeout={state: callback}`: the timeout transition of that
state runs the named callback as its action, exactly as an `after` does on an ordinary
transition. Everything else (validation, compilation, diagrams, coverage) is the core's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvhandoff.machines.declaration import Declaration
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = ["ActionDeclaration"]


@dataclass(frozen=True)
class ActionDeclaration(Declaration):
    """`Declaration` plus `on_timeout`: state name -> callback run when its timeout fires."""

    on_timeout: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        for state, callback in self.on_timeout.items():
            if self.state(state).timeout is None:
                raise LocalProtocolError(
                    f"machine {self.name!r}: on_timeout names state {state!r}, "
                    "which declares no timeout"
                )
            if not callable(self.callbacks.get(callback)):
                raise LocalProtocolError(
                    f"machine {self.name!r}: on_timeout of {state!r} names missing "
                    f"callback {callback!r}"
                )
        rebuilt = tuple(
            dataclasses.replace(t, after=self.on_timeout[t.source])
            if t.from_timeout and t.source in self.on_timeout
            else t
            for t in self.transition_decls
        )
        object.__setattr__(self, "transition_decls", rebuilt)
