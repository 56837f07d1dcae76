"""Batched WRITE lifecycle (B-13): one transfer that carries the WRITEs of several
requests to one D rank, from its post to the completion notifs of its requests.

One instance per posted transfer, on the bus of the writer thread that posted it, keyed
by a serial number. The writer thread alone drives it (R-P08: it is the only caller of
WRITE and of the completion `send_notif`); the main thread only reads what `settle`
published on each request's handle, and hands its releases to the writer. A transfer is
one NIXL WRITE carrying the descriptors of several requests (`adapters/nixl/push_batch.py`)
or one CUDA IPC gather-scatter launch (`adapters/cuda/ipc_launches.py`); a launch cannot
be cancelled, so a request released under it only keeps its notif back.

- `in_flight`: the transfer is posted, with no notif attached (a NIXL transfer carries
  at most one). The writer polls it each pass while any is in flight.
- `notifying`: the bytes landed; the completion notifs of its requests leave toward
  D as one bundle (or one each, toward a D without B-13), so D hears of a request only
  after its bytes landed, in the same form as an unbatched WRITE's.
- `done`: the notifs left; every request still waiting reads "DONE".
- `failed`: the transfer ended in error, or the notifs could not be sent; every request
  still waiting reads "ERR", as a failed single WRITE would (B-10).
- `cancelled`: a request was released while the transfer was in flight (its lease or
  transfer timed out): the whole transfer is released, so nothing lands after P gave up
  on it, and the batch's other requests read "ERR".

Every final state frees the transfer's handle. A batch that fails to post never becomes
an instance: its requests read "ERR" at once (B-14 counts them under "post").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvhandoff.machines.runtime.declaration import Declaration
from kvhandoff.machines.runtime.effects import Effect, Metric
from kvhandoff.machines.runtime.events import Event


@dataclass(slots=True)
class WriteBatchCtx:
    key: int
    engine_id: str
    rank: int
    notifs: tuple[bytes, ...]
    """The completion notifs of its requests, in order (an empty notif is none)."""
    transfer: object = None
    """The transport's handle of the posted transfer (opaque here)."""
    members: tuple[object, ...] = ()
    """The transport's per-request handles it carries (opaque here)."""
    owner: object = None
    """The queue that posted it, which executes its effects (opaque here: a rank's NIXL
    batcher and its CUDA IPC launches share one bus)."""


@dataclass(frozen=True, slots=True)
class TransferLanded(Event):
    """The writer's poll found the transfer done: every byte of it landed."""


@dataclass(frozen=True, slots=True)
class TransferFailed(Event):
    """The writer's poll found the transfer ended in error."""

    error: str = "transfer failed"


@dataclass(frozen=True, slots=True)
class BatchCancelled(Event):
    """A request it carries was released while it was in flight."""


@dataclass(frozen=True, slots=True)
class NotifsSent(Event):
    """The completion notifs of its requests left toward D."""


@dataclass(frozen=True, slots=True)
class NotifsFailed(Event):
    """Sending the completion notifs failed."""

    error: str = "send_notif failed"


@dataclass(frozen=True, slots=True)
class SendCompletionNotifs(Effect):
    """Send `notifs` to (engine, rank), then report `NotifsSent` or `NotifsFailed`."""

    engine_id: str
    rank: int
    notifs: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class CancelTransfer(Effect):
    """Release the transfer while it is in flight (NIXL cancels it)."""


@dataclass(frozen=True, slots=True)
class SettleMembers(Effect):
    """Publish `state` on every request handle still waiting, then free the transfer."""

    state: Literal["DONE", "ERR"]
    error: str = ""


def send_notifs(ctx: WriteBatchCtx, event: TransferLanded) -> list[Effect]:
    return [SendCompletionNotifs(ctx.engine_id, ctx.rank, ctx.notifs)]


def settle_done(ctx: WriteBatchCtx, event: NotifsSent) -> list[Effect]:
    return [SettleMembers("DONE"), Metric("push.write_batch.done")]


def settle_failed(ctx: WriteBatchCtx, event: TransferFailed | NotifsFailed) -> list[Effect]:
    return [SettleMembers("ERR", event.error), Metric("push.write_batch.failed")]


def cancel(ctx: WriteBatchCtx, event: BatchCancelled) -> list[Effect]:
    return [
        CancelTransfer(),
        SettleMembers("ERR", "batch cancelled"),
        Metric("push.write_batch.cancelled"),
    ]


WRITE_BATCH: Declaration[WriteBatchCtx] = Declaration(
    name="push.write_batch",
    description=__doc__ or "",
    states=[
        {"name": "in_flight", "tags": ("in_flight",)},
        {"name": "notifying"},
        {"name": "done", "final": True},
        {"name": "failed", "final": True},
        {"name": "cancelled", "final": True},
    ],
    initial="in_flight",
    transitions=[
        {"trigger": TransferLanded, "source": "in_flight", "dest": "notifying", "after": "send"},
        {"trigger": TransferFailed, "source": "in_flight", "dest": "failed", "after": "fail"},
        {"trigger": BatchCancelled, "source": "in_flight", "dest": "cancelled", "after": "cancel"},
        {"trigger": NotifsSent, "source": "notifying", "dest": "done", "after": "done"},
        {"trigger": NotifsFailed, "source": "notifying", "dest": "failed", "after": "fail"},
    ],
    # The notifs are on their way: a release now changes nothing D will see.
    ignore=[("notifying", BatchCancelled)],
    callbacks={"send": send_notifs, "done": settle_done, "fail": settle_failed, "cancel": cancel},
    context=WriteBatchCtx,
)
