"""B-13 and R-P08: the batched WRITE's lifecycle (`push.write_batch`) and who drives it.

The writer thread alone polls a batch, sends its completion notifs and cancels it; the
main thread's `poll` reads what the writer published and its `release` only hands the
handle over. A stand-in `BatchIO` records every transport call, so a test fails if the
main thread's calls reach the transport. The real NIXL and simulated transports run the
same class (`test_push_transport_conformance.py`, `test_push_batched_writes.py`), and
the whole path over the simulated fabric checks that no WRITE reads P's blocks after
they were freed (`kvhandoff simulate push`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.adapters.push_transport import XferState
from kvhandoff.adapters.write_batches import WriteBatches
from kvhandoff.machines.push.write_batch import WRITE_BATCH
from kvhandoff.protocol.errors import KvHandoffError


@dataclass(eq=False)
class Write:
    rank: int
    notif: bytes
    xfer_status: XferState = "PROC"
    released: bool = False
    post_failed: bool = False
    error: str | None = None
    batch_key: int = 0
    transfer: object = None


@dataclass(eq=False)
class Transfer:
    members: tuple[Write, ...]
    state: XferState = "PROC"
    released: bool = False


@dataclass
class RecordingIO:
    """Every transport call, in order; what the next post or notif send does."""

    calls: list[tuple[str, object]] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    refuse_post: bool = False
    refuse_notifs: bool = False

    def group(self, write: Write) -> Hashable:
        return write.rank

    def engine_of(self, write: Write) -> tuple[str, int]:
        return ("engine-d", write.rank)

    def post(self, members: list[Write]) -> Transfer:
        self.calls.append(("post", len(members)))
        if self.refuse_post:
            raise KvHandoffError("post refused")
        self.transfers.append(Transfer(tuple(members)))
        return self.transfers[-1]

    def state(self, transfer: object) -> tuple[XferState, str]:
        assert isinstance(transfer, Transfer)
        self.calls.append(("state", transfer))
        return transfer.state, "transfer failed"

    def release(self, transfer: object) -> None:
        assert isinstance(transfer, Transfer)
        self.calls.append(("release", transfer))
        transfer.released = True

    def send_notifs(self, first: Write, notifs: tuple[bytes, ...]) -> None:
        self.calls.append(("send_notifs", notifs))
        if self.refuse_notifs:
            raise KvHandoffError("send_notif refused")


OPS = st.lists(
    st.tuples(
        st.sampled_from(["queue", "flush", "land", "fail", "release", "complete"]),
        st.integers(0, 5),  # which transfer or write
        st.integers(0, 1),  # which D rank a queued write goes to
    ),
    max_size=40,
)
"""Interleavings of the writer's and the main thread's calls and the transfers' outcomes."""


def _record_outcomes(writes: list[Write], seen: dict[int, XferState]) -> None:
    """A published outcome never changes: record new ones, check the old ones."""
    for i, write in enumerate(writes):
        if i in seen:
            assert write.xfer_status == seen[i], "a published outcome never changes"
        elif write.xfer_status != "PROC":
            seen[i] = write.xfer_status


def _step(
    batches: WriteBatches[Write],
    io: RecordingIO,
    writes: list[Write],
    op: str,
    index: int,
    rank: int,
    now: float,
) -> None:
    """Apply one of `OPS` other than "release" (each property releases in its own way)."""
    if op == "queue":
        writes.append(batches.queue(Write(rank, f"req-{len(writes)}:1".encode())))
    elif op == "flush":
        batches.flush()
    elif op in ("land", "fail") and io.transfers:
        transfer = io.transfers[index % len(io.transfers)]
        if transfer.state == "PROC" and not transfer.released:
            transfer.state = "DONE" if op == "land" else "ERR"
    elif op == "complete":
        batches.complete(now)


def _posted(count: int = 3) -> tuple[RecordingIO, WriteBatches[Write], list[Write]]:
    io = RecordingIO()
    batches: WriteBatches[Write] = WriteBatches(io)
    writes = [batches.queue(Write(0, f"req-{i}:1".encode())) for i in range(count)]
    assert batches.flush() == []
    return io, batches, writes


def test_B_13_R_P08_main_thread_poll_reads_what_the_writer_published() -> None:
    io, batches, writes = _posted()
    (transfer,) = io.transfers
    transfer.state = "DONE"
    io.calls.clear()
    assert [batches.poll(w) for w in writes] == ["PROC"] * 3, "until the writer settles it"
    assert io.calls == [], "the main thread's poll made no transport call"
    assert batches.complete(1.0) == 0
    assert [name for name, _arg in io.calls].count("send_notifs") == 1, "the writer sent them"
    assert [batches.poll(w) for w in writes] == ["DONE"] * 3


def test_B_13_a_release_in_flight_cancels_the_transfer_at_once_even_with_the_writer_stalled() -> (
    None
):
    """A timed-out request's release cancels its whole transfer from the main thread,
    at once: nothing lands after P gave up on it even if the writer does not pass for a
    long time (the 10,000-seed simulation found a stalled writer otherwise). The writer
    then settles the batch as cancelled, with no notif."""
    io, batches, writes = _posted()
    (transfer,) = io.transfers
    io.calls.clear()
    batches.release(writes[0])
    assert [name for name, _arg in io.calls] == ["state", "release"] and transfer.released
    assert batches.complete(1.0) == 0
    assert "send_notifs" not in [name for name, _arg in io.calls]
    assert [batches.poll(w) for w in writes[1:]] == ["ERR", "ERR"]
    assert all(w.error == "batch cancelled" for w in writes[1:])


def test_B_13_a_release_after_the_bytes_landed_cancels_nothing() -> None:
    """The writer polls before it cancels: a transfer that landed is notified and settled,
    so the batch's other requests are not failed for a release that came too late."""
    io, batches, writes = _posted()
    io.transfers[0].state = "DONE"
    batches.release(writes[0])
    assert batches.complete(1.0) == 0
    assert [batches.poll(w) for w in writes] == ["DONE"] * 3


def test_B_13_R_P08_the_writer_sends_the_notifs_after_the_bytes_landed_then_publishes() -> None:
    io, batches, writes = _posted()
    (transfer,) = io.transfers
    assert batches.complete(1.0) == 1, "still in flight: the writer keeps polling"
    assert [name for name, _ in io.calls if name == "send_notifs"] == []
    transfer.state = "DONE"
    assert batches.complete(2.0) == 0
    sends = [arg for name, arg in io.calls if name == "send_notifs"]
    assert sends == [tuple(w.notif for w in writes)], "one bundle, in order"
    assert [batches.poll(w) for w in writes] == ["DONE"] * 3
    assert transfer.released, "a settled batch frees its transfer"
    assert batches.bus.live(WRITE_BATCH) == 0


@pytest.mark.parametrize("failure", ["transfer", "notifs", "post"])
def test_B_13_a_failed_batch_fails_every_request_in_it(failure: str) -> None:
    io = RecordingIO(refuse_post=failure == "post", refuse_notifs=failure == "notifs")
    batches: WriteBatches[Write] = WriteBatches(io)
    writes = [batches.queue(Write(0, f"req-{i}:1".encode())) for i in range(2)]
    errors = batches.flush()
    if failure == "post":
        assert [engine for engine, _exc in errors] == ["engine-d"]
        assert all(w.post_failed for w in writes)
    else:
        io.transfers[0].state = "ERR" if failure == "transfer" else "DONE"
        assert batches.complete(1.0) == 0
    assert [batches.poll(w) for w in writes] == ["ERR", "ERR"]
    assert all(w.error for w in writes)
    sent = [arg for name, arg in io.calls if name == "send_notifs"]
    assert sent == ([(b"req-0:1", b"req-1:1")] if failure == "notifs" else [])


def test_B_13_a_request_released_before_the_flush_is_never_posted() -> None:
    io = RecordingIO()
    batches: WriteBatches[Write] = WriteBatches(io)
    dropped, kept = batches.queue(Write(0, b"a:1")), batches.queue(Write(0, b"b:1"))
    batches.release(dropped)
    assert batches.flush() == []
    assert io.calls == [("post", 1)] and io.transfers[0].members == (kept,)


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_B_13_every_request_ends_once_and_nothing_lands_after_its_release(
    ops: list[tuple[str, int, int]],
) -> None:
    """Any interleaving of queue, flush, transfer outcomes, releases and writer passes:
    a request's outcome, once published, never changes; a request released while in
    flight has its transfer released (cancelled) at once and no notif of that transfer
    is ever sent; after a final pass every posted transfer is settled and freed."""
    io = RecordingIO()
    batches: WriteBatches[Write] = WriteBatches(io)
    writes: list[Write] = []
    seen: dict[int, XferState] = {}
    cancelled: set[int] = set()
    now = 0.0
    for op, index, rank in ops:
        now += 1.0
        if op == "release" and writes:
            write = writes[index % len(writes)]
            in_flight = write.xfer_status == "PROC" and not write.released
            batches.release(write)
            transfer = next((t for t in io.transfers if write in t.members), None)
            if in_flight and transfer is not None and transfer.state == "PROC":
                assert transfer.released, "cancelled at once, whatever the writer does"
                cancelled.add(id(transfer))
        else:
            _step(batches, io, writes, op, index, rank, now)
        _record_outcomes(writes, seen)
    batches.flush()
    for transfer in io.transfers:
        if transfer.state == "PROC" and not transfer.released:
            transfer.state = "DONE"
    assert batches.complete(now + 1.0) == 0
    assert all(t.released for t in io.transfers), "every transfer freed"
    notified = {n for name, arg in io.calls if name == "send_notifs" for n in arg}  # type: ignore[attr-defined]
    for transfer in io.transfers:
        if id(transfer) in cancelled:
            assert not notified & {m.notif for m in transfer.members}, "no notif once cancelled"
    posted = [w for t in io.transfers for w in t.members]
    assert all(w.xfer_status != "PROC" for w in posted), "every posted request settled"


def test_B_13_two_queues_on_one_bus_each_settle_their_own() -> None:
    """A rank's NIXL batcher and its CUDA IPC launches share the writer's bus: keys never
    collide, and each instance's effects reach the queue that posted it."""
    from kvhandoff.machines.runtime.bus import EventBus

    bus = EventBus()
    ios = (RecordingIO(), RecordingIO())
    queues: list[WriteBatches[Write]] = [WriteBatches(io) for io in ios]
    for queue in queues:
        queue.bind(bus)
    writes = [queue.queue(Write(0, f"q{i}:1".encode())) for i, queue in enumerate(queues)]
    for queue in queues:
        queue.flush()
    assert writes[0].batch_key != writes[1].batch_key and bus.live(WRITE_BATCH) == 2
    ios[1].transfers[0].state = "DONE"
    assert queues[0].complete(1.0) == 1, "the other queue's landed transfer is not ours"
    assert [a for n, a in ios[0].calls if n == "send_notifs"] == []
    assert queues[1].complete(1.0) == 0
    assert [a for n, a in ios[1].calls if n == "send_notifs"] == [(b"q1:1",)]
    assert [w.xfer_status for w in writes] == ["PROC", "DONE"]


@settings(max_examples=200, deadline=None)
@given(ops=OPS)
def test_B_13_a_transfer_that_cannot_be_cancelled_runs_to_its_end(
    ops: list[tuple[str, int, int]],
) -> None:
    """`cancels_in_flight` off (a CUDA IPC launch), any interleaving: the main thread's
    release reaches no transport call; a transfer is freed only once it ended; a request
    released before its transfer's notifs left never has its notif sent, and every
    other request of a landed transfer does; a published outcome never changes."""
    io = RecordingIO()
    batches: WriteBatches[Write] = WriteBatches(io, cancels_in_flight=False)
    writes: list[Write] = []
    seen: dict[int, XferState] = {}
    released_before_notifs: set[bytes] = set()
    now = 0.0
    for op, index, rank in ops:
        now += 1.0
        if op == "release" and writes:
            write = writes[index % len(writes)]
            calls = len(io.calls)
            if write.xfer_status == "PROC":
                released_before_notifs.add(write.notif)
            batches.release(write)
            assert len(io.calls) == calls, "the main thread's release calls no transport"
        else:
            _step(batches, io, writes, op, index, rank, now)
        for transfer in io.transfers:
            if transfer.released:
                assert transfer.state != "PROC", "freed only once it ended"
        _record_outcomes(writes, seen)
    batches.flush()
    for transfer in io.transfers:
        if transfer.state == "PROC":
            transfer.state = "DONE"
    assert batches.complete(now + 1.0) == 0
    assert all(t.released for t in io.transfers), "every transfer freed"
    notified = [n for name, arg in io.calls if name == "send_notifs" for n in arg]  # type: ignore[attr-defined]
    assert not released_before_notifs & set(notified), "a released request's notif stays"
    for transfer in io.transfers:
        if transfer.state == "DONE":
            expected = {m.notif for m in transfer.members} - released_before_notifs
            assert expected <= set(notified), "its batch mates are notified"


def test_B_08_fail_group_fails_queued_and_running_transfers_of_that_peer_only() -> None:
    io = RecordingIO()
    batches: WriteBatches[Write] = WriteBatches(io, cancels_in_flight=False)
    running = [batches.queue(Write(rank, f"r{rank}:1".encode())) for rank in (0, 1)]
    batches.flush()
    queued = batches.queue(Write(0, b"q0:1"))
    batches.fail_group(0, "peer gone", 1.0)
    assert (running[0].xfer_status, queued.xfer_status) == ("ERR", "ERR")
    assert running[0].error == queued.error == "peer gone"
    assert running[1].xfer_status == "PROC", "the other peer's transfer runs on"
    assert io.transfers[0].released and not io.transfers[1].released
    assert batches.flush() == [] and len(io.transfers) == 2, "the failed write never posts"
    assert [a for n, a in io.calls if n == "send_notifs"] == []
