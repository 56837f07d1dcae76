"""Batched WRITEs of one worker rank (B-13), for any transport: the queue, the posts and
the `push.write_batch` instances on the writer's bus. One implementation for the real
NIXL transport (`nixl/push_batch.py`) and the simulator's (`sim/push/batch.py`), which
only say how a transfer is posted, polled, released and notified (`BatchIO`).

`write_blocks` queues a request's WRITE (its arguments were checked already). The writer
calls `flush` at the end of each pass: the WRITEs queued since the last flush leave as
ONE transfer per group (D rank and local descriptor list), with every descriptor of
every request in it and no notif attached. With `post_every` K, the K-th WRITE queued
for one group posts those K at once, so the transfer overlaps the rest of the pass.
Each posted transfer is a `push.write_batch` instance; the writer's `complete` polls the
ones in flight, and the machine sends the completion notifs of a transfer that landed,
then publishes each request's outcome on its handle.

Threads: `queue`, `flush` and `complete` run on the writer thread, which owns the bus
and every instance. The main thread calls `poll`, which reads the outcome the writer
published (one attribute), and `release`. A release of a request still in flight
releases its transfer at once, from the main thread, as the seed's main thread releases
xfer handles: so nothing of it lands after P gave up on it, even while the writer is
stalled. It then hands the handle to the writer, whose next `complete` settles the batch
as cancelled. No lock around machine state: a handle's `xfer_status` is written by the
writer only, its `released` flag by the main thread only. The one thing both threads
touch is the transport's handle of a transfer (the writer polls and frees it, the main
thread may cancel it): `BatchIO.state` and `BatchIO.release` must be safe against each
other and idempotent (the NIXL side guards its handle for that).

Failure: a transfer that fails to post fails its requests at once ("ERR", `post_failed`
set, B-14 counts them under "post"); one that ends in error, or whose notifs cannot be
sent, fails its requests; a request released in flight cancels its whole transfer (see
`push.write_batch`). A request released before the flush is never posted.

A transfer that cannot be stopped once posted (a CUDA IPC launch: `cancels_in_flight`
off) is left to end: a request released meanwhile only keeps its completion notif back
(its bytes land, D must not hear of them), and its batch mates complete as usual.

One rank's writer bus may carry several of these (the NIXL batcher and the CUDA IPC
launches wrapped around it): they share the bus's `push.write_batch` kind, its serial
keys and its effect handlers (`_BusBatches`), and each instance's effects go to the
`WriteBatches` that posted it.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections import deque
from collections.abc import Hashable
from typing import Any, ClassVar, Generic, Protocol, TypeVar, cast

from kvhandoff.adapters.push_transport import XferState
from kvhandoff.machines.push.write_batch import (
    WRITE_BATCH,
    BatchCancelled,
    CancelTransfer,
    NotifsFailed,
    NotifsSent,
    SendCompletionNotifs,
    SettleMembers,
    TransferFailed,
    TransferLanded,
    WriteBatchCtx,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.errors import KvHandoffError

log = logging.getLogger(__name__)


class BatchMember(Protocol):
    """A request's handle: what `write_blocks` returns."""

    notif: bytes
    xfer_status: XferState
    released: bool
    post_failed: bool
    error: str | None
    batch_key: int
    transfer: object
    """The transfer carrying it, once posted (None before)."""


M = TypeVar("M", bound=BatchMember)


class BatchIO(Protocol[M]):
    """How one transport posts, polls, releases and notifies a batched transfer."""

    def group(self, write: M) -> Hashable:
        """Writes that can share one transfer have equal groups."""
        ...

    def post(self, members: list[M]) -> object:
        """Post one transfer carrying every member's descriptors, no notif; raises
        `KvHandoffError` when it cannot."""
        ...

    def state(self, transfer: object) -> tuple[XferState, str]:
        """The transfer's state, and its error text once it failed."""
        ...

    def release(self, transfer: object) -> None:
        """Free the transfer (cancelling it while in flight). Idempotent, and safe against
        a `state` or `release` of the same transfer on the other thread."""
        ...

    def send_notifs(self, first: M, notifs: tuple[bytes, ...]) -> None:
        """Send the completion notifs to the members' D rank; raises `KvHandoffError`."""
        ...

    def engine_of(self, write: M) -> tuple[str, int]:
        """(D engine id, D rank) of a write."""
        ...


class WriteBatches(Generic[M]):
    """The queue of one rank's WRITEs and the `push.write_batch` instances posted from it."""

    def __init__(
        self, io: BatchIO[M], post_every: int = 0, *, cancels_in_flight: bool = True
    ) -> None:
        self.io = io
        self.post_every = post_every
        """Queued WRITEs of one group that are posted at once, before the pass ends (0:
        never)."""
        self.cancels_in_flight = cancels_in_flight
        """Whether a release cancels a transfer in flight (NIXL: yes; a CUDA launch: no,
        the released request only keeps its notif back)."""
        self._queued: list[M] = []
        self._errors: list[tuple[str, KvHandoffError]] = []  # early posts', for `flush`
        self._releases: deque[M] = deque()  # main -> writer
        self.batches_posted = 0
        """Transfers posted (one per flush per group)."""
        self.writes_batched = 0
        """Request WRITEs those transfers carried."""
        self.batches_settled = 0
        """Transfers whose requests' outcomes were published (done, failed, cancelled)."""
        self.bus = EventBus()
        """Its own until `bind` gives it the writer's."""
        self._on_bus = _BusBatches.of(self.bus)

    def bind(self, bus: EventBus) -> None:
        """Run the batches on `bus` (the writer's) from now on; none may be in flight."""
        if self._mine():
            raise KvHandoffError("cannot move batched WRITEs to another bus while in flight")
        self.bus = bus
        self._on_bus = _BusBatches.of(bus)

    def _mine(self) -> list[Instance[WriteBatchCtx]]:
        """This batcher's transfers in flight, oldest first (the bus may carry another's)."""
        return [i for i in self.bus.instances(WRITE_BATCH) if i.ctx.owner is self]

    # -- the writer thread ---------------------------------------------------------------

    def queue(self, write: M) -> M:
        self._queued.append(write)
        if self.post_every:
            group = self.io.group
            key = group(write)
            members = [w for w in self._queued if not w.released and group(w) == key]
            if len(members) >= self.post_every:
                posted = {id(w) for w in members}
                self._queued = [w for w in self._queued if id(w) not in posted]
                error = self._post(members)
                if error is not None:
                    self._errors.append((self.io.engine_of(write)[0], error))
        return write

    def flush(self) -> list[tuple[str, KvHandoffError]]:
        """Post what is queued, one transfer per group; returns the (engine id, error) of
        each transfer that failed to post since the last flush (its requests are "ERR")."""
        queued, self._queued = self._queued, []
        groups: dict[Hashable, list[M]] = {}
        group = self.io.group
        for write in queued:
            if not write.released:
                groups.setdefault(group(write), []).append(write)
        errors, self._errors = self._errors, []
        for members in groups.values():
            error = self._post(members)
            if error is not None:
                errors.append((self.io.engine_of(members[0])[0], error))
        return errors

    def _post(self, members: list[M]) -> KvHandoffError | None:
        try:
            transfer = self.io.post(members)
        except KvHandoffError as exc:
            for member in members:
                member.post_failed = True
                _publish(member, "ERR", str(exc))
            return exc
        key = next(self._on_bus.serials)
        engine_id, rank = self.io.engine_of(members[0])
        for member in members:
            member.transfer = transfer
            member.batch_key = key
        ctx = WriteBatchCtx(
            key,
            engine_id,
            rank,
            tuple(m.notif for m in members if m.notif),
            transfer,
            tuple(members),
            owner=self,
        )
        self.bus.create(WRITE_BATCH, ctx, self.bus.now)
        self.batches_posted += 1
        self.writes_batched += len(members)
        return None

    def complete(self, now: float) -> int:
        """Settle the transfers of requests the main thread released (cancelled, unless
        the bytes had landed or the transfer cannot be cancelled), then poll the ones in
        flight: a landed one sends its notifs and settles, one that failed settles.
        Returns how many are still in flight (the writer keeps polling while any is)."""
        bus = self.bus
        state = self.io.state
        releases = self._releases
        while releases:
            write = releases.popleft()
            key = write.batch_key
            if not self.cancels_in_flight or not key or write.xfer_status != "PROC":
                continue
            if bus.get(WRITE_BATCH, key) is None:
                continue
            if state(write.transfer)[0] != "DONE":
                bus.dispatch(WRITE_BATCH, key, BatchCancelled(), now)
        mine = self._mine()
        for inst in mine:
            status, error = state(inst.ctx.transfer)
            if status == "DONE":
                bus.dispatch(WRITE_BATCH, inst.ctx.key, TransferLanded(), now)
            elif status == "ERR":
                bus.dispatch(WRITE_BATCH, inst.ctx.key, TransferFailed(error), now)
        return len(self._mine()) if mine else 0

    def in_flight(self) -> list[object]:
        """The transfers this queue posted that have not settled yet, oldest first."""
        return [inst.ctx.transfer for inst in self._mine()]

    def fail_group(self, group: Hashable, error: str, now: float) -> None:
        """Writer thread: the peer behind `group` is gone (B-08): its queued WRITEs fail
        unposted and its transfers in flight fail (each waits for its end in the
        transport's `release`), before the transport lets go of the peer's memory."""
        key_of = self.io.group
        gone = [w for w in self._queued if key_of(w) == group]
        if gone:
            self._queued = [w for w in self._queued if key_of(w) != group]
            for write in gone:
                _publish(write, "ERR", error)
        for inst in self._mine():
            members = inst.ctx.members
            if members and key_of(cast(M, members[0])) == group:
                self.bus.dispatch(WRITE_BATCH, inst.ctx.key, TransferFailed(error), now)

    def any_ended(self) -> bool:
        """Whether a transfer in flight has ended or a release waits for the writer: its
        next `complete` would change something (the simulator schedules that pass)."""
        if self._releases:
            return True
        state = self.io.state
        return any(state(i.ctx.transfer)[0] != "PROC" for i in self._mine())

    # -- the machine's effects (writer thread) ---------------------------------------------

    def _send_notifs(self, inst: Instance[Any] | None, effect: SendCompletionNotifs) -> None:
        ctx = _ctx(inst)
        notifs = effect.notifs
        if not self.cancels_in_flight:  # a request released under the launch: no notif
            notifs = tuple(m.notif for m in _members(ctx) if m.notif and not m.released)
        try:
            if notifs:
                self.io.send_notifs(cast(M, ctx.members[0]), notifs)
        except KvHandoffError as exc:
            self.bus.dispatch(WRITE_BATCH, ctx.key, NotifsFailed(str(exc)), self.bus.now)
        else:
            self.bus.dispatch(WRITE_BATCH, ctx.key, NotifsSent(), self.bus.now)

    def _cancel(self, inst: Instance[Any] | None, _effect: CancelTransfer) -> None:
        self._release(_ctx(inst).transfer)

    def _settle(self, inst: Instance[Any] | None, effect: SettleMembers) -> None:
        ctx = _ctx(inst)
        for member in ctx.members:
            write = cast(M, member)
            if write.xfer_status == "PROC":
                _publish(write, effect.state, effect.error)
        self.batches_settled += 1
        self._release(ctx.transfer)

    def _release(self, transfer: object) -> None:
        try:
            self.io.release(transfer)
        except KvHandoffError as exc:  # its requests' outcomes are published either way
            log.warning("releasing a batched WRITE's transfer failed: %s", exc)

    # -- the main thread -----------------------------------------------------------------

    def poll(self, write: M) -> XferState:
        """What the writer published: "PROC" until its transfer settled."""
        return write.xfer_status

    def release(self, write: M) -> None:
        """Idempotent. A request still in flight has its whole transfer released (NIXL
        cancels it) here and now, and the writer's next `complete` settles the batch as
        cancelled; one never posted is never posted. Without `cancels_in_flight` the
        flag alone is set: the writer keeps the request's notif back."""
        if write.released:
            return
        write.released = True
        transfer = write.transfer
        if (
            self.cancels_in_flight
            and transfer is not None
            and write.xfer_status == "PROC"
            and self.io.state(transfer)[0] == "PROC"
        ):
            self._release(transfer)
        self._releases.append(write)


class _BusBatches:
    """The `push.write_batch` kind on one bus, shared by every `WriteBatches` bound to it:
    one serial sequence for the keys, and handlers that hand each instance's effects to
    the `WriteBatches` that posted it (`WriteBatchCtx.owner`)."""

    _of: ClassVar[weakref.WeakKeyDictionary[EventBus, _BusBatches]] = weakref.WeakKeyDictionary()

    def __init__(self, bus: EventBus) -> None:
        self.serials = itertools.count(1)
        if WRITE_BATCH.name not in bus.kinds():
            bus.register(WRITE_BATCH)
        bus.handle(SendCompletionNotifs, lambda i, e: _owner(i)._send_notifs(i, e))
        bus.handle(CancelTransfer, lambda i, e: _owner(i)._cancel(i, e))
        bus.handle(SettleMembers, lambda i, e: _owner(i)._settle(i, e))

    @classmethod
    def of(cls, bus: EventBus) -> _BusBatches:
        found = cls._of.get(bus)
        if found is None:
            found = cls._of[bus] = cls(bus)
        return found


def _owner(inst: Instance[Any] | None) -> WriteBatches[Any]:
    return cast(WriteBatches[Any], _ctx(inst).owner)


def _members(ctx: WriteBatchCtx) -> tuple[BatchMember, ...]:
    return cast(tuple[BatchMember, ...], ctx.members)


def _publish(write: BatchMember, state: XferState, error: str) -> None:
    """The outcome last: the main thread reads `xfer_status` and then the rest."""
    if error:
        write.error = error
    write.xfer_status = state


def _ctx(inst: Instance[Any] | None) -> WriteBatchCtx:
    assert inst is not None, "a write_batch effect always comes from its instance"
    return cast(WriteBatchCtx, inst.ctx)
