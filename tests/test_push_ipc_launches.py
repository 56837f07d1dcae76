"""CUDA IPC launches as declared batched WRITEs, without a GPU (issue 26 items 1 and 2,
B-13, R-P08, B-08).

`IpcPushTransport` runs over the NIXL stand-in (`ipc_stub.py`) with a stand-in for the
opened D rank whose launches end when a test says so. What is checked: the writer's
`flush_writes` launches one kernel per D rank for a pass's WRITEs, each launch is a
`push.write_batch` instance on the writer's bus, the completion notifs leave from the
writer's `complete_writes` only after the launch ended, the main thread's `poll` reads
what the writer published and its `release` keeps back only the released request's notif;
a D rank that is forgotten has its launches failed and waited for before it is unmapped.
The kernel itself runs in tests/test_push_ipc_gpu.py.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

from ipc_stub import StubNixl

from kvhandoff.adapters.cuda import ipc_transport as ipc_module
from kvhandoff.adapters.cuda.ipc_export import IPC_EXPORT_VERSION, IpcExport, encode_export
from kvhandoff.adapters.cuda.ipc_handles import IpcHandle
from kvhandoff.adapters.cuda.ipc_transport import IpcPushTransport
from kvhandoff.adapters.push_rank import PushRank
from kvhandoff.machines.push.ipc_peer import IPC_PEER
from kvhandoff.machines.push.write_batch import WRITE_BATCH
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.protocol.errors import KvHandoffError
from kvhandoff.protocol.member_routing import MemberSlot

SLOTS = (MemberSlot("layer.0.k", 0, 1 << 20, 4096, 64),)


@dataclass
class Launch:
    local: list[int]
    remote: list[int]
    ended: bool = False
    broken: bool = False
    waited: bool = False

    def query(self) -> bool:
        if self.broken:
            raise RuntimeError("an illegal address was encountered")
        return self.ended

    def synchronize(self) -> None:
        self.waited = True
        self.ended = True


@dataclass
class FakePeer:
    """An opened D rank: records launches, refuses one when told to."""

    launches: list[Launch] = field(default_factory=list)
    retired: list[Launch] = field(default_factory=list)
    refuse_launch: bool = False
    closed_after: list[bool] = field(default_factory=list)
    kernel: str = "fake"
    route: str = "same_device"

    def check_ids(self, local: Sequence[int], remote: Sequence[int]) -> None:
        if len(local) != len(remote):
            raise KvHandoffError("unequal block lists")

    def launch(self, local: list[int], remote: list[int]) -> Launch:
        if self.refuse_launch:
            raise RuntimeError("launch refused")
        self.launches.append(Launch(local, remote))
        return self.launches[-1]

    def retire(self, copy: Launch) -> None:
        self.retired.append(copy)

    def close(self) -> None:
        self.closed_after.append(all(launch.ended for launch in self.launches))


def _export() -> bytes:
    return encode_export(IpcExport(IPC_EXPORT_VERSION, "h/b", "0000:01:00.0", (), (), ()))


def _transport(
    launch_every: int = 0, wait: bool = False
) -> tuple[StubNixl, IpcPushTransport, FakePeer, EventBus]:
    """Polling the launches (`wait_launches` off) unless `wait`: a test ends them."""
    stub = StubNixl(slots=SLOTS)
    peer = FakePeer()
    ipc = IpcPushTransport(
        stub,  # type: ignore[arg-type]
        launch_every=launch_every,
        wait_launches=wait,
        open_peer=lambda *_args: peer,  # type: ignore[arg-type,return-value]
    )
    writer_bus = EventBus()
    ipc.bind_bus(writer_bus)
    stub.inbox = [("d-agent", _export())]
    assert ipc.get_new_notifs() == []
    return stub, ipc, peer, writer_bus


def _write(ipc: IpcPushTransport, i: int) -> IpcHandle:
    handle = ipc.write_blocks("D", 0, [i, i + 1], [10 + i, 11 + i], f"req-{i}".encode())
    assert isinstance(handle, IpcHandle)
    return handle


def _notifs(stub: StubNixl) -> list[bytes]:
    return [m for _e, _r, m in stub.sent]


def test_B_13_R_P08_a_pass_is_one_launch_per_rank_and_notifs_leave_after_it_ended() -> None:
    stub, ipc, peer, bus = _transport()
    handles = [_write(ipc, i) for i in (0, 4, 8)]
    assert peer.launches == [], "queued until the writer's pass ends"
    assert ipc.flush_writes() == []
    (launch,) = peer.launches
    assert launch.local == [0, 1, 4, 5, 8, 9] and launch.remote == [10, 11, 14, 15, 18, 19]
    assert bus.live(WRITE_BATCH) == 1, "the launch is a declared lifecycle on the writer's bus"
    assert ipc.complete_writes(1.0) == 1
    assert [ipc.poll(h) for h in handles] == ["PROC"] * 3 and _notifs(stub) == []
    launch.ended = True
    assert ipc.complete_writes(2.0) == 0
    assert _notifs(stub) == [b"req-0", b"req-4", b"req-8"]
    assert [ipc.poll(h) for h in handles] == ["DONE"] * 3
    assert peer.retired == [launch], "the event goes back to its peer once done"
    assert bus.live(WRITE_BATCH) == 0 and ipc.stats.launches == 1


def test_B_13_waiting_for_the_launches_sends_their_notifs_in_the_same_pass() -> None:
    """`wait_launches` (the default): the writer's `complete_writes` waits for the copies
    it launched, then their notifs leave at once; nothing is left in flight."""
    stub, ipc, peer, bus = _transport(wait=True)
    handles = [_write(ipc, i) for i in (0, 4)]
    ipc.flush_writes()
    assert _notifs(stub) == []
    assert ipc.complete_writes(1.0) == 0
    assert peer.launches[0].waited and _notifs(stub) == [b"req-0", b"req-4"]
    assert [ipc.poll(h) for h in handles] == ["DONE", "DONE"] and bus.live(WRITE_BATCH) == 0


def test_B_13_launch_every_launches_while_the_pass_goes_on() -> None:
    _stub, ipc, peer, _bus = _transport(launch_every=2)
    _write(ipc, 0)
    assert peer.launches == []
    _write(ipc, 4)
    assert len(peer.launches) == 1, "the second queued WRITE launched both"
    _write(ipc, 8)
    ipc.flush_writes()
    assert [len(launch.local) for launch in peer.launches] == [4, 2]


def test_B_13_a_release_keeps_back_only_that_request() -> None:
    """Queued: never launched. Under a running kernel (which cannot be stopped): its own
    notif is kept back, its batch mates complete."""
    stub, ipc, peer, _bus = _transport()
    early = _write(ipc, 0)
    ipc.release(early)
    ipc.flush_writes()
    assert peer.launches == [], "released before its launch: never launched"
    mates = [_write(ipc, i) for i in (4, 8)]
    ipc.flush_writes()
    ipc.release(mates[0])
    assert ipc.complete_writes(1.0) == 1, "the kernel runs on"
    peer.launches[0].ended = True
    ipc.complete_writes(2.0)
    assert _notifs(stub) == [b"req-8"]
    assert ipc.poll(mates[1]) == "DONE"


def test_B_13_B_14_a_launch_that_fails_fails_its_requests_with_no_notif() -> None:
    stub, ipc, peer, _bus = _transport()
    peer.refuse_launch = True
    refused = _write(ipc, 0)
    errors = ipc.flush_writes()
    assert [engine for engine, _exc in errors] == ["D"]
    assert ipc.poll(refused) == "ERR" and refused.post_failed
    peer.refuse_launch = False
    broken = _write(ipc, 4)
    ipc.flush_writes()
    peer.launches[0].broken = True
    assert ipc.complete_writes(1.0) == 0
    assert ipc.poll(broken) == "ERR" and "illegal address" in (broken.error or "")
    assert _notifs(stub) == []


def test_B_08_a_forgotten_rank_fails_and_waits_for_its_launches_before_unmapping() -> None:
    stub, ipc, peer, bus = _transport()
    running = _write(ipc, 0)
    ipc.flush_writes()
    queued = _write(ipc, 4)
    ipc.forget("D")
    assert peer.closed_after == [True], "unmapped only after its kernel ended"
    assert peer.launches[0].waited
    assert (ipc.poll(running), ipc.poll(queued)) == ("ERR", "ERR")
    assert _notifs(stub) == [] and stub.forgotten == ["D"]
    assert bus.live(WRITE_BATCH) == 0
    assert not bus.has_tag(IPC_PEER, "D/0", "ipc_ready")
    ipc.flush_writes()
    assert len(peer.launches) == 1, "nothing queued before the forget is launched after it"


def test_R_P08_the_ipc_transport_takes_no_lock_and_starts_no_thread() -> None:
    """Issue 26 item 2: the writer thread owns the transport's state; nothing here
    synchronises around it."""
    tree = ast.parse(inspect.getsource(ipc_module))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "threading" not in imported


def test_R_P07_the_writer_polls_a_running_launch_at_the_transports_interval() -> None:
    """A launch ends within microseconds to a millisecond: while one runs, the writer
    wakes at the IPC transport's interval, not its own millisecond; idle, it sleeps."""
    stub = StubNixl(slots=SLOTS)
    peer = FakePeer()
    ipc = IpcPushTransport(stub, wait_launches=False, open_peer=lambda *_a: peer)  # type: ignore[arg-type,return-value]
    rank = PushRank("prefill", "P", ipc, lambda _job: None)
    assert stub.bound is rank.writer_bus and ipc.bus is rank.writer_bus
    stub.inbox = [("d-agent", _export())]
    rank.writer_pass()
    assert rank.writer_poll_interval_s is None, "idle: until woken"
    _write(ipc, 0)
    rank.writer_pass()
    assert len(peer.launches) == 1
    interval = rank.writer_poll_interval_s
    assert interval == ipc.write_poll_interval_s and interval < rank.writer.poll_interval_s
    peer.launches[0].ended = True
    rank.writer_pass()
    assert _notifs(stub) == [b"req-0"] and rank.writer_poll_interval_s is None
