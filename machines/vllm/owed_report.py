"""What kvhandoff still owes vLLM's scheduler about one request (C-05, R-T02).

One instance per request vLLM waits to hear about exactly once, keyed by vLLM's request
id, on the scheduler-role connector's own bus:

- D (`direction="recv"`): a decode leg vLLM keeps in `WAITING_FOR_REMOTE_KVS` until its id
  is in `finished_recving`; created when its blocks are registered for P's push.
- P (`direction="send"`): a prefill leg whose blocks vLLM keeps until its id is in
  `finished_sending`; created when `request_finished` leases them.

vLLM 0.33 asserts that every id it is told about is a request it still holds, so an id
passes to vLLM only through this machine's `Reported` (into `told`, final, the instance
leaves the bus): a second report, a report after vLLM forgot the request, or a report of
the other direction names no instance in a state that takes it and is refused
(`RemoteProtocolError`, counted as a dropped report), never passed.

When vLLM ends a D request that still waits (abort, error), kvhandoff's ranks drop it
(`ending`); once none holds it (`due`, effect `TellEngine`) the connector tells vLLM at the
next output, which frees the blocks (`Told`). A request no rank holds any more (its
watchdog ended it) is `due` at once.

Tags: `owed` (vLLM still waits for this id once), `engine_waiting` (vLLM holds it waiting
and has not ended it), `ending` (the ranks are dropping it), `due` (tell vLLM now).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect
from kvhandoff.machines.runtime.events import Event, PeerEvent

__all__ = [
    "VLLM_OWED_REPORT",
    "Direction",
    "EngineEndedDropping",
    "EngineEndedUnheld",
    "OwedReportCtx",
    "RanksDropped",
    "Reported",
    "TellEngine",
    "Told",
]

Direction = Literal["recv", "send"]


@dataclass(slots=True)
class OwedReportCtx:
    key: str
    """vLLM's request id."""
    direction: Direction = "recv"


@dataclass(frozen=True, slots=True)
class Reported(PeerEvent):
    """The ranks reported the request finished (`finished_recving` when `direction` is
    "recv", `finished_sending` when "send"); vLLM hears of it now."""

    direction: Direction = "recv"


@dataclass(frozen=True, slots=True)
class EngineEndedDropping(Event):
    """vLLM ended the request while it waits; kvhandoff's ranks are dropping it."""


@dataclass(frozen=True, slots=True)
class EngineEndedUnheld(Event):
    """vLLM ended the request while it waits; no rank holds it any more."""


@dataclass(frozen=True, slots=True)
class RanksDropped(Event):
    """Every rank dropped the request vLLM ended."""


@dataclass(frozen=True, slots=True)
class Told(Event):
    """The connector passed the ended request to vLLM as finished."""


@dataclass(frozen=True, slots=True)
class TellEngine(Effect):
    """Pass `request_id` to vLLM as finished at the next output (the connector takes it
    from the bus's outbox and answers `Told`)."""

    request_id: str


def same_direction(ctx: OwedReportCtx, event: Reported) -> bool:
    return ctx.direction == event.direction


def tell(ctx: OwedReportCtx, event: EngineEndedUnheld | RanksDropped) -> list[Effect]:
    return [TellEngine(ctx.key)]


_OWED = ("owed", "ending", "due")

VLLM_OWED_REPORT: Declaration[OwedReportCtx] = Declaration(
    name="vllm.owed_report",
    context=OwedReportCtx,
    description=(
        "What kvhandoff still owes vLLM's scheduler about one request: a finished receive "
        "(D) or send (P), passed to vLLM exactly once and never after vLLM forgot it "
        "(vLLM 0.33 asserts on both); a D request vLLM ended while waiting is passed once "
        "every rank dropped it."
    ),
    states=[
        {"name": "owed", "tags": ("owed", "engine_waiting")},
        {"name": "ending", "tags": ("owed", "ending")},
        {"name": "due", "tags": ("owed", "due")},
        {"name": "told", "final": True},
    ],
    initial="owed",
    transitions=[
        {
            "trigger": Reported,
            "source": list(_OWED),
            "dest": "told",
            "conditions": "same_direction",
        },
        {"trigger": EngineEndedDropping, "source": "owed", "dest": "ending"},
        {"trigger": EngineEndedUnheld, "source": "owed", "dest": "due", "after": "tell"},
        {"trigger": RanksDropped, "source": "ending", "dest": "due", "after": "tell"},
        {"trigger": Told, "source": "due", "dest": "told"},
    ],
    callbacks={"same_direction": same_direction, "tell": tell},
)
