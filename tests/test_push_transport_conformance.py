"""One transport interface, two implementations: the same suite runs against both.

`PushTransport` is implemented by the real NIXL agent plus ZMQ side channel
(`NixlPushTransport`) and by the in-memory fabric of the simulator (`SimPushTransport`).
Every test here runs against each, through a small harness that knows how to let the
transport make progress (the simulator delivers what is in flight; the real one polls
against a deadline) and how to read and write block memory.

Both engines route by member: A lists its regions `k, v`, B lists them `v, k`, so a block
written from A's `k` region must land in B's `k` region, wherever B keeps it (R-P14).

The real pair is two NIXL agents in this one process over loopback, created once per
module (agent creation takes about two seconds each), with real ZMQ side channels.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from kvhandoff.adapters.push_transport import PushTransport
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    EngineHandshake,
    HandshakePayload,
    compatibility_hash,
    decode_engine_handshake,
    decode_handshake,
    encode_engine_handshake,
    encode_handshake,
)
from kvhandoff.protocol.member_routing import LocalRegion
from kvhandoff.sim.push.fabric import SimNetwork
from kvhandoff.sim.push.transport import SimPushTransport

BLOCK_LEN = 4096
BLOCKS = 8
MEMBERS_A = ("layers.0.k", "layers.0.v")
MEMBERS_B = ("layers.0.v", "layers.0.k")
HASH = compatibility_hash("kvhandoff-conformance", "model", "uint8", BLOCK_LEN)
DEADLINE_S = 20.0
T = TypeVar("T")
ROUTES = {0: (1, 1)}  # one rank on each side: rank 0, whole blocks (R-T03)


def one_rank_engine(transport: PushTransport) -> EngineHandshake:
    """What a one-rank engine's side channel serves."""
    payload = transport.handshake_payload()
    return EngineHandshake(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION,
        engine_id=payload.engine_id,
        ranks=(payload,),
    )


class Side(Protocol):
    transport: PushTransport
    host: str
    port: int

    def fill(self, block: int, seed: int) -> None: ...

    def member_block(self, member: str, block: int) -> bytes: ...


def pattern(member: str, block: int, seed: int) -> bytes:
    digest = hashlib.blake2b(f"{member}/{block}/{seed}".encode(), digest_size=64).digest()
    return digest * (BLOCK_LEN // len(digest))


# -- the simulated pair --------------------------------------------------------------------


class SimSide:
    def __init__(self, network: SimNetwork, engine_id: str, members: tuple[str, ...]) -> None:
        self.transport = SimPushTransport(
            network,
            engine_id,
            [(m,) for m in members],
            num_blocks=BLOCKS,
            block_len=BLOCK_LEN,
            compatibility_hash=HASH,
        )
        self.members = members
        self.host, self.port = f"sim-{engine_id}", 5600
        network.serve(
            engine_id,
            self.host,
            self.port,
            lambda: encode_engine_handshake(one_rank_engine(self.transport)),
        )

    def fill(self, block: int, seed: int) -> None:
        for i, member in enumerate(self.members):
            self.transport.write_block(i, block, pattern(member, block, seed))

    def member_block(self, member: str, block: int) -> bytes:
        return bytes(self.transport.block(self.members.index(member), block))


class SimHarness:
    kind = "sim"

    def __init__(self) -> None:
        self.network = SimNetwork(0, VirtualClock())
        self.a = SimSide(self.network, "engine-a", MEMBERS_A)
        self.b = SimSide(self.network, "engine-b", MEMBERS_B)

    def pump(self) -> None:
        """Everything in flight arrives (and whatever that posts, in turn); each side's
        writer settles its batched WRITEs (B-13), as its writer pass does."""
        while True:
            while self.network.in_flight:
                self.network.deliver(0)
            for side in (self.a, self.b):
                side.transport.complete_writes(self.network.clock.now)
            if not self.network.in_flight:
                return

    def close(self) -> None:
        pass


# -- the real pair -------------------------------------------------------------------------


class NixlSide:
    def __init__(self, engine_id: str, members: tuple[str, ...]) -> None:
        from kvhandoff.adapters.nixl.agent import NixlAgent
        from kvhandoff.adapters.nixl.push_transport import NixlPushTransport

        self.members = members
        self.memory: list[npt.NDArray[np.uint8]] = [
            np.zeros(BLOCKS * BLOCK_LEN, dtype=np.uint8) for _ in members
        ]
        regions = [
            LocalRegion(int(array.ctypes.data), (member,), BLOCK_LEN, BLOCKS)
            for array, member in zip(self.memory, members, strict=True)
        ]
        self.agent = NixlAgent(f"{engine_id}-{secrets.token_hex(4)}")
        self.transport = NixlPushTransport(engine_id, self.agent, regions, compatibility_hash=HASH)
        from kvhandoff.adapters.zmq.side_channel import SideChannelServer

        transport = self.transport
        self.server = SideChannelServer(
            "127.0.0.1", 0, lambda: encode_engine_handshake(one_rank_engine(transport))
        )
        self.host, self.port = "127.0.0.1", self.server.port

    def fill(self, block: int, seed: int) -> None:
        for array, member in zip(self.memory, self.members, strict=True):
            start = block * BLOCK_LEN
            array[start : start + BLOCK_LEN] = np.frombuffer(
                pattern(member, block, seed), dtype=np.uint8
            )

    def member_block(self, member: str, block: int) -> bytes:
        start = block * BLOCK_LEN
        return self.memory[self.members.index(member)][start : start + BLOCK_LEN].tobytes()

    def close(self) -> None:
        self.server.close()
        self.agent.close()


class NixlHarness:
    kind = "nixl"

    def __init__(self) -> None:
        self.a = NixlSide("engine-a", MEMBERS_A)
        self.b = NixlSide("engine-b", MEMBERS_B)

    def pump(self) -> None:
        time.sleep(0.001)  # UCX progresses on its own thread; the caller's deadline bounds
        for side in (self.a, self.b):  # each writer settles its batched WRITEs (B-13)
            side.transport.complete_writes(time.monotonic())

    def close(self) -> None:
        self.a.close()
        self.b.close()


Harness = SimHarness | NixlHarness


def _nixl_available() -> bool:
    try:
        from kvhandoff.adapters.nixl.loader import load_nixl

        load_nixl()
    except Exception:
        return False
    return True


@pytest.fixture(scope="module", params=["sim", "nixl"])
def harness(request: pytest.FixtureRequest) -> Iterator[Harness]:
    if request.param == "nixl" and not _nixl_available():
        pytest.skip("no importable nixl build")
    made: Harness = SimHarness() if request.param == "sim" else NixlHarness()
    yield made
    made.close()


@pytest.fixture
def pair(harness: Harness) -> Harness:
    """Both sides connected to each other, nothing left in their notif queues."""
    for here, there in ((harness.a, harness.b), (harness.b, harness.a)):
        raw = here.transport.fetch_handshake(there.host, there.port, DEADLINE_S, [(0, 0)])
        here.transport.connect(decode_engine_handshake(raw), ROUTES)
    harness.pump()
    for side in (harness.a, harness.b):
        side.transport.get_new_notifs()
    return harness


def wait_for(harness: Harness, probe: Callable[[], T | None], what: str) -> T:
    """Pump until `probe` returns something, within the deadline (never a fixed sleep)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        value = probe()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{harness.kind}: no {what} within {DEADLINE_S} s")
        harness.pump()


def notifs_until(harness: Harness, side: Side, count: int) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []

    def probe() -> list[tuple[str, bytes]] | None:
        got.extend(side.transport.get_new_notifs())
        return got if len(got) >= count else None

    return wait_for(harness, probe, f"{count} notifs")


def done(harness: Harness, side: Side, handle: Any) -> str:
    def probe() -> str | None:
        state = side.transport.poll(handle)
        return None if state == "PROC" else state

    return wait_for(harness, probe, "transfer completion")


# -- the suite -------------------------------------------------------------------------------


def test_R_P15_handshake_payload_round_trips_and_connects(pair: Harness) -> None:
    a, b = pair.a, pair.b
    payload = a.transport.handshake_payload()
    assert decode_handshake(encode_handshake(payload)) == payload
    engine = decode_engine_handshake(
        b.transport.fetch_handshake(a.host, a.port, DEADLINE_S, [(0, 0)])
    )
    (served,) = engine.ranks
    assert engine.engine_id == payload.engine_id
    assert (served.engine_id, served.agent_name) == (payload.engine_id, payload.agent_name)
    assert served.region_members == tuple((m,) for m in MEMBERS_A)
    info = b.transport.connect(engine, ROUTES)
    assert info.engine_id == a.transport.engine_id
    assert info.agent(0) == payload.agent_name
    rank = info.ranks[0]
    assert (info.tp_size, rank.physical_blocks_per_logical, rank.capacity) == (1, 1, BLOCKS)
    assert b.transport.engine(a.transport.engine_id) == info
    assert b.transport.identify(payload.agent_name) == (payload.engine_id, 0)


def _engine_of(payload: HandshakePayload) -> EngineHandshake:
    return EngineHandshake(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION, engine_id=payload.engine_id, ranks=(payload,)
    )


def test_R_P15_an_incompatible_peer_is_refused(pair: Harness) -> None:
    payload = pair.a.transport.handshake_payload()
    other = msgspec.structs.replace(payload, compatibility_hash="0" * 64)
    with pytest.raises(RemoteProtocolError, match="compatibility_hash"):
        pair.b.transport.connect(_engine_of(other), ROUTES)


def test_R_P14_a_peer_missing_a_member_is_refused(pair: Harness) -> None:
    payload: HandshakePayload = pair.a.transport.handshake_payload()
    renamed = tuple((f"{m[0]}.other",) for m in payload.region_members)
    with pytest.raises(RemoteProtocolError, match="not advertised"):
        renamed_payload = msgspec.structs.replace(payload, region_members=renamed)
        pair.b.transport.connect(_engine_of(renamed_payload), ROUTES)


def test_R_P08_send_notif_reaches_the_peer_tagged_with_the_sender(pair: Harness) -> None:
    a, b = pair.a, pair.b
    a.transport.send_notif(b.transport.engine_id, 0, b"HB:cmpl-1-0-aaaaaaaa")
    b.transport.send_notif(a.transport.engine_id, 0, b"PUSH_REG:x")
    got_b = notifs_until(pair, b, 1)
    got_a = notifs_until(pair, a, 1)
    assert got_b == [(a.transport.handshake_payload().agent_name, b"HB:cmpl-1-0-aaaaaaaa")]
    assert got_a == [(b.transport.handshake_payload().agent_name, b"PUSH_REG:x")]
    assert b.transport.get_new_notifs() == []  # drained


def test_R_P06_write_blocks_lands_bytes_by_member_then_the_completion_notif(
    pair: Harness,
) -> None:
    a, b = pair.a, pair.b
    for block in (1, 2):
        a.fill(block, seed=7)
    handle = a.transport.write_blocks(b.transport.engine_id, 0, [1, 2], [5, 6], b"req-7-0:1")
    assert a.transport.flush_writes() == []  # B-13: WRITEs leave at the flush
    assert done(pair, a, handle) == "DONE"
    got = notifs_until(pair, b, 1)
    assert got == [(a.transport.handshake_payload().agent_name, b"req-7-0:1")]
    for member in MEMBERS_A:
        assert b.member_block(member, 5) == a.member_block(member, 1)
        assert b.member_block(member, 6) == a.member_block(member, 2)
    a.transport.release(handle)
    a.transport.release(handle)  # idempotent


def test_B09_read_blocks_fetches_bytes_and_notifies_the_peer(pair: Harness) -> None:
    a, b = pair.a, pair.b
    b.fill(3, seed=11)
    handle = a.transport.read_blocks(b.transport.engine_id, 0, [4], [3], b"req-8-0:1")
    assert done(pair, a, handle) == "DONE"
    for member in MEMBERS_A:
        assert a.member_block(member, 4) == b.member_block(member, 3)
    assert notifs_until(pair, b, 1) == [(a.transport.handshake_payload().agent_name, b"req-8-0:1")]
    a.transport.release(handle)


def test_B08_forget_then_reconnect_restores_the_peer(pair: Harness) -> None:
    a, b = pair.a, pair.b
    engine_b = b.transport.engine_id
    a.transport.forget(engine_b)
    assert a.transport.engine(engine_b) is None
    with pytest.raises(LocalProtocolError, match="not connected"):
        a.transport.send_notif(engine_b, 0, b"HB:x")
    a.transport.forget(engine_b)  # forgetting twice is fine
    raw = a.transport.fetch_handshake(b.host, b.port, DEADLINE_S, [(0, 0)])
    a.transport.connect(decode_engine_handshake(raw), ROUTES)
    a.transport.send_notif(engine_b, 0, b"HB:again")
    assert notifs_until(pair, b, 1)[0][1] == b"HB:again"


def test_R_P15_an_unconnected_peer_is_a_local_error(pair: Harness) -> None:
    transport = pair.a.transport
    assert transport.engine("nobody") is None
    assert transport.identify("nobody-agent") is None
    with pytest.raises(LocalProtocolError):
        transport.send_notif("nobody", 0, b"HB:x")
    with pytest.raises(LocalProtocolError):
        transport.write_blocks("nobody", 0, [0], [0], b"x:1")


def test_R_P06_block_ids_out_of_range_are_local_errors(pair: Harness) -> None:
    a, engine_b = pair.a, pair.b.transport.engine_id
    with pytest.raises(LocalProtocolError):
        a.transport.write_blocks(engine_b, 0, [0], [BLOCKS], b"x:1")
    with pytest.raises(LocalProtocolError):
        a.transport.write_blocks(engine_b, 0, [BLOCKS], [0], b"x:1")


# -- B-13: batched WRITEs ----------------------------------------------------------------------


def test_B_13_the_writes_of_one_flush_land_then_one_notif_per_request(pair: Harness) -> None:
    """N requests queued for one D rank, one flush: every request's bytes land and D gets
    one completion notif per request, in the same form, from P's agent (D unchanged). The
    real transport posts them as ONE NIXL transfer."""
    a, b = pair.a, pair.b
    batcher = getattr(a.transport, "batcher", None)
    before = (0, 0) if batcher is None else (batcher.batches_posted, batcher.writes_batched)
    notifs = [f"req-b13-{i}:1".encode() for i in range(3)]
    for block in (0, 1, 2, 3):
        a.fill(block, seed=13)
    handles = [
        a.transport.write_blocks(b.transport.engine_id, 0, local, remote, notif)
        for local, remote, notif in zip(([0], [1, 2], [3]), ([7], [5, 6], [4]), notifs, strict=True)
    ]
    if batcher is not None:
        assert [a.transport.poll(h) for h in handles] == ["PROC"] * 3, "queued until the flush"
    assert a.transport.flush_writes() == []
    assert [done(pair, a, h) for h in handles] == ["DONE"] * 3
    got = notifs_until(pair, b, 3)
    sender = a.transport.handshake_payload().agent_name
    assert sorted(got) == sorted((sender, n) for n in notifs)
    for member in MEMBERS_A:
        for src, dst in ((0, 7), (1, 5), (2, 6), (3, 4)):
            assert b.member_block(member, dst) == a.member_block(member, src)
    if batcher is not None:
        after = (batcher.batches_posted, batcher.writes_batched)
        assert (after[0] - before[0], after[1] - before[1]) == (1, 3), "one transfer for three"
    for handle in handles:
        a.transport.release(handle)
    assert b.transport.get_new_notifs() == [], "no notif of the batch itself"


def _transfer_of(transport: Any, handle: Any) -> Any:
    """The NIXL transfer of a posted request's `push.write_batch` instance."""
    from kvhandoff.machines.push.write_batch import WRITE_BATCH

    inst = transport.batcher.bus.get(WRITE_BATCH, handle.batch_key)
    assert inst is not None, "posted and not settled"
    return inst.ctx.transfer


def _nixl_only(pair: Harness) -> Any:
    if pair.kind != "nixl":
        pytest.skip(
            "drives the NIXL agent's calls; the simulator's batches: test_push_batched_writes.py"
        )
    return pair.a.transport


def test_B_13_completion_notifs_leave_only_after_the_batch_completed(
    pair: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = _nixl_only(pair)
    agent = transport.agent
    posted: list[Any] = []
    sent: list[tuple[bytes, str]] = []
    real_write, real_send = agent.write, agent.send_notif

    def write(*args: Any) -> Any:
        posted.append(real_write(*args))
        return posted[-1]

    def send_notif(name: str, msg: bytes) -> None:
        sent.append((msg, posted[-1].xfer_status))
        real_send(name, msg)

    monkeypatch.setattr(agent, "write", write)
    monkeypatch.setattr(agent, "send_notif", send_notif)
    engine_b = pair.b.transport.engine_id
    handles = [
        transport.write_blocks(engine_b, 0, [i], [i], f"req-n{i}:1".encode()) for i in (1, 2)
    ]
    assert transport.flush_writes() == []
    assert len(posted) == 1 and posted[0].notif == b"", "one transfer, no notif attached"
    assert [done(pair, pair.a, h) for h in handles] == ["DONE", "DONE"]
    assert sent == [(b"req-n1:1", "DONE"), (b"req-n2:1", "DONE")], "sent after completion"
    assert len(notifs_until(pair, pair.b, 2)) == 2
    for handle in handles:
        transport.release(handle)


def test_B_13_a_batch_that_fails_to_post_fails_every_request_in_it(
    pair: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvhandoff.adapters.nixl.errors import NixlTransferError

    transport = _nixl_only(pair)

    def refuse(*_args: Any) -> Any:
        raise NixlTransferError("write", "injected post failure")

    monkeypatch.setattr(transport.agent, "write", refuse)
    engine_b = pair.b.transport.engine_id
    handles = [
        transport.write_blocks(engine_b, 0, [i], [i], f"req-f{i}:1".encode()) for i in (1, 2, 3)
    ]
    ((engine, error),) = transport.flush_writes()
    assert engine == engine_b and "injected post failure" in str(error)
    assert [transport.poll(h) for h in handles] == ["ERR"] * 3
    for handle in handles:
        transport.release(handle)


def test_B_13_a_batch_completing_in_error_fails_every_request_and_sends_no_notif(
    pair: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    transport = _nixl_only(pair)
    agent = transport.agent
    sent: list[bytes] = []
    monkeypatch.setattr(agent, "send_notif", lambda _name, msg: sent.append(msg))
    engine_b = pair.b.transport.engine_id
    handles = [
        transport.write_blocks(engine_b, 0, [i], [i], f"req-e{i}:1".encode()) for i in (1, 2)
    ]
    assert transport.flush_writes() == []
    transfer = _transfer_of(transport, handles[0])
    assert transfer is _transfer_of(transport, handles[1])
    assert [transport.poll(h) for h in handles] == ["PROC", "PROC"], "until the writer settles"
    # Not `wait_for`: its pump runs the writer's `complete_writes`, which would settle the
    # batch DONE before it is made to fail. Polled, not slept on; the test's timeout bounds it.
    while agent.poll(transfer) == "PROC":
        time.sleep(0.001)
    transfer.xfer_status = "ERR"  # as a failed transfer leaves it
    transport.complete_writes(time.monotonic())
    assert [transport.poll(h) for h in handles] == ["ERR", "ERR"]
    assert sent == []
    assert transfer.released, "a settled batch frees its transfer"
    for handle in handles:
        transport.release(handle)


def test_B_13_releasing_a_request_before_the_flush_never_posts_it(pair: Harness) -> None:
    transport = _nixl_only(pair)
    engine_b = pair.b.transport.engine_id
    dropped = transport.write_blocks(engine_b, 0, [1], [1], b"req-r1:1")
    kept = transport.write_blocks(engine_b, 0, [2], [2], b"req-r2:1")
    transport.release(dropped)
    before = transport.batcher.writes_batched
    assert transport.flush_writes() == []
    assert transport.batcher.writes_batched - before == 1
    assert done(pair, pair.a, kept) == "DONE"
    assert [m for _s, m in notifs_until(pair, pair.b, 1)] == [b"req-r2:1"]
    transport.release(kept)


def test_B_13_releasing_a_request_in_flight_cancels_its_whole_batch(
    pair: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A timed-out request's release cancels the shared transfer (nothing lands after P
    gave up on it); the batch's other requests fail, as their WRITE would have."""
    transport = _nixl_only(pair)
    agent = transport.agent
    engine_b = pair.b.transport.engine_id
    handles = [
        transport.write_blocks(engine_b, 0, [i], [i], f"req-c{i}:1".encode()) for i in (1, 2)
    ]
    assert transport.flush_writes() == []
    transfer = _transfer_of(transport, handles[0])
    monkeypatch.setattr(agent, "poll", lambda _handle: "PROC")  # still in flight
    transport.release(handles[0])
    assert transfer.released, "the batch's NIXL transfer was released (cancelled) at once"
    assert transport.complete_writes(time.monotonic()) == 0, "the writer settled it"
    assert transport.poll(handles[1]) == "ERR"
    transport.release(handles[1])


def test_B_13_post_every_posts_a_full_group_before_the_pass_ends(pair: Harness) -> None:
    """With `post_every` K, the K-th WRITE queued for one D rank posts those K at once
    (overlapping the rest of the pass); the flush posts the remainder; all land, each with
    its notif."""
    transport = _nixl_only(pair)
    batcher = transport.batcher
    engine_b = pair.b.transport.engine_id
    notifs = [f"req-pe{i}:1".encode() for i in (1, 2, 3)]
    batcher.post_every = 2
    try:
        before = batcher.batches_posted
        handles = [
            transport.write_blocks(engine_b, 0, [i], [i], n)
            for i, n in zip((1, 2, 3), notifs, strict=True)
        ]
        assert batcher.batches_posted - before == 1, "the first two left before the flush"
        assert transport.flush_writes() == []
        assert batcher.batches_posted - before == 2
        assert [done(pair, pair.a, h) for h in handles] == ["DONE"] * 3
        assert sorted(m for _s, m in notifs_until(pair, pair.b, 3)) == sorted(notifs)
    finally:
        batcher.post_every = 0
    for handle in handles:
        transport.release(handle)
