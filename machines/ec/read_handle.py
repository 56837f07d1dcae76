"""Read handle: one posted NIXL READ's handle, held by the consumer's reader (R-E12, B-08).

Keyed by the READ's transfer id, on the NIXL reader's own bus. The handle is a resource
the reader owns from the post until it releases it; the consumer read that asked for
the READ may end first (a quarantine), so the handle lives here, not in its context.

- `completed(ok)`: the reader polled the READ to its end and released the handle:
  `posted -> completed` (final); the reader reports `(mm_hash, transfer_id, ok)`.
- `released`: the handle was released before the READ ended (a quarantine ended,
  nobody awaits it any more, or the reader closed): `posted -> released` (final).
- `agent_replaced`: the producer's agent was replaced (`FailReads`): the handle is
  released and the READ is `failed_unreported` until the next poll reports it failed
  (`reported`).
- `post_failed`: NIXL (or an injected fault) refused the post: there is no handle, and
  the READ is `failed_unreported` the same way.

No timeout: the consumer read's own timeouts decide when a READ is given up, and the
reader then releases its handle. Tags: `in_flight` (the handle is held), `unreported`
(failed, not polled yet).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.events import Event

__all__ = [
    "EC_READ_HANDLE",
    "AgentReplaced",
    "Completed",
    "PostFailed",
    "ReadHandleCtx",
    "Released",
    "Reported",
]


@dataclass(slots=True)
class ReadHandleCtx:
    key: str
    """The READ's transfer id."""
    mm_hash: str = ""
    agent: str = ""
    """The producer agent the READ goes through."""
    handle: object = None
    """The NIXL adapter's handle of the posted READ (opaque here)."""


@dataclass(frozen=True, slots=True)
class Completed(Event):
    """The READ ended (`ok` False when NIXL said it failed); its handle is released."""

    ok: bool = True


@dataclass(frozen=True, slots=True)
class Released(Event):
    """The handle was released before the READ ended (NIXL cancels the DMA)."""


@dataclass(frozen=True, slots=True)
class AgentReplaced(Event):
    """The READ's agent was replaced: the handle is released, the READ failed."""


@dataclass(frozen=True, slots=True)
class PostFailed(Event):
    """The READ could not be posted: no handle was made."""


@dataclass(frozen=True, slots=True)
class Reported(Event):
    """A poll reported the failed READ."""


EC_READ_HANDLE: Declaration[ReadHandleCtx] = Declaration(
    name="ec.read_handle",
    context=ReadHandleCtx,
    description=(
        "A posted NIXL READ's handle (R-E12, B-08): held until the READ completes or is "
        "released; a READ whose post failed or whose agent was replaced is reported "
        "failed at the next poll."
    ),
    states=[
        {"name": "posted", "tags": ("in_flight",)},
        {"name": "failed_unreported", "tags": ("unreported",)},
        {"name": "completed", "final": True},
        {"name": "released", "final": True},
        {"name": "reported", "final": True},
    ],
    initial="posted",
    transitions=[
        {"trigger": Completed, "source": "posted", "dest": "completed"},
        {"trigger": Released, "source": "posted", "dest": "released"},
        {"trigger": AgentReplaced, "source": "posted", "dest": "failed_unreported"},
        {"trigger": PostFailed, "source": "posted", "dest": "failed_unreported"},
        {"trigger": Reported, "source": "failed_unreported", "dest": "reported"},
    ],
)
