"""Notices: what a half owes its engine once, until the engine takes it (R-E05, B-05).

Two small machines, each `posted -> taken` (final), so nothing the engine has yet to hear
lives in a list or set beside the machines:

- `ec.landed_copy`, on a worker's bus, keyed by the copy batch id: a batch's end event was
  seen (`ok` False when the copy failed). `ECWorker.take_landed` gathers every `untaken`
  notice into an `ECFinished` for the model runner and takes them.
- `ec.request_failure`, on the scheduler's bus, keyed by a serial the scheduler numbers
  (a request id may fail again after it finished): a request failed cleanly with a reason
  (`FailRequest`). `take_failed_requests` returns every `untaken` one, oldest first, and
  takes them.

No timeout: the engine takes them at its next step. Tag: `untaken`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from kvhandoff.machines.ec.meta import CopyDirection
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event

__all__ = [
    "EC_LANDED_COPY",
    "EC_REQUEST_FAILURE",
    "FailureCtx",
    "LandedCtx",
    "Taken",
    "take_notices",
]

C = TypeVar("C")


@dataclass(slots=True)
class LandedCtx:
    key: int
    """The copy batch id."""
    direction: CopyDirection = "save"
    mm_hashes: tuple[str, ...] = ()
    ok: bool = True


@dataclass(slots=True)
class FailureCtx:
    key: int
    """A serial the scheduler numbers, in the order requests failed."""
    request_id: str = ""
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Taken(Event):
    """The engine took the notice."""


EC_LANDED_COPY: Declaration[LandedCtx] = Declaration(
    name="ec.landed_copy",
    context=LandedCtx,
    description=(
        "A copy batch whose end event was seen (R-E05), until `take_landed` tells the "
        "model runner which encodings landed or failed."
    ),
    states=[
        {"name": "posted", "tags": ("untaken",)},
        {"name": "taken", "final": True},
    ],
    initial="posted",
    transitions=[{"trigger": Taken, "source": "posted", "dest": "taken"}],
)

EC_REQUEST_FAILURE: Declaration[FailureCtx] = Declaration(
    name="ec.request_failure",
    context=FailureCtx,
    description=(
        "A request failed cleanly with a reason (B-05), until `take_failed_requests` "
        "hands it to the engine."
    ),
    states=[
        {"name": "posted", "tags": ("untaken",)},
        {"name": "taken", "final": True},
    ],
    initial="posted",
    transitions=[{"trigger": Taken, "source": "posted", "dest": "taken"}],
)


def take_notices(bus: EventBus, kind: Declaration[C]) -> list[Instance[C]]:
    """Every `untaken` notice of `kind` on `bus`, oldest first, now taken."""
    notices = bus.tagged(kind, "untaken")
    for notice in notices:
        bus.dispatch(kind, notice.key, Taken(), bus.now)
    return notices
