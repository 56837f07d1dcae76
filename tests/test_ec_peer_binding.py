"""Every encoder-cache peer message is bound to its owner (issue 27; S-02, S-03, S-06, C-03).

Real peers over loopback: the producer is an `ECSide` (ZMQ ROUTER, NIXL agent, `/dev/shm`
region); consumers are raw ZMQ DEALERs sending the `XferReq`s a kvhandoff or a stock vLLM
0.33 consumer sends; bystanders are NIXL agents of their own that loaded the producer's
agent metadata (which any `XferAck` carries) and send READ notifs `<session_id>:<mm_hash>`
naming other consumers' grants. Waits poll the producer's step against a deadline.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import zmq

from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.adapters.nixl.agent import NixlAgent
from kvhandoff.adapters.nixl.ec_reader import ECNixlReader
from kvhandoff.adapters.zmq.control import MAX_REQUEST_BYTES, ControlClient
from kvhandoff.demo.ec_requests import BLOCK_BYTES, COMPAT, HIDDEN, encoding
from kvhandoff.machines.ec.consumer_read import IssueRead
from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.ec_status import EXTENSIONS, XferStatus
from kvhandoff.protocol.ec_wire import (
    XferAck,
    XferReq,
    decode_xfer_ack,
    encode_xfer_req,
    read_notif,
)
from kvhandoff.protocol.errors import RemoteProtocolError

pytestmark = pytest.mark.integration

NUM_BLOCKS = 64


def unique(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(4)}"


def until(step: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not step():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.0005)  # yield the CPU between steps; never a synchronisation


def producer_side(machine_config: dict[str, float] | None = None, **extra: Any) -> ECSide:
    config = ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role="ec_producer",
        ec_connector_extra_config={
            "ec_cpu_bytes": NUM_BLOCKS * BLOCK_BYTES,
            "ec_enable_nixl": True,
            **extra,
        },
        engine_id=unique("binding-producer"),
    )
    layout = ECLayout(HIDDEN, 2, NUM_BLOCKS * BLOCK_BYTES)
    return ECSide(
        config,
        layout,
        compat_hash=COMPAT,
        listen=("127.0.0.1", 0),
        machine_config=machine_config,
    )


def publish(side: ECSide, mm_hash: str, tokens: int = 2) -> None:
    """Encode, save and publish `mm_hash` on the producer: it is ready to be granted."""
    side.encoder_cache[mm_hash] = encoding(mm_hash, tokens)
    info = ECRequestInfo(
        f"r-{mm_hash}", (mm_hash,), mm_metadata={mm_hash: {"m": 1}}, mm_tokens=(tokens,)
    )
    side.scheduler.update_state_after_alloc(info, 0, side.clock())
    until(lambda: mm_hash in side.engine_step().saved, f"the save of {mm_hash}")
    side.scheduler.request_finished(info, side.clock())
    side.encoder_cache.pop(mm_hash)


def ask(side: ECSide, client: ControlClient, req: XferReq) -> XferAck:
    """Send `req` from `client`, step the producer until its answer arrives."""
    assert client.send(encode_xfer_req(req))
    got: list[XferAck] = []

    def answered() -> bool:
        side.poll()
        got.extend(decode_xfer_ack(r) for r in client.poll_replies())
        return bool(got)

    until(answered, f"the answer to {req.mm_hash}")
    return got[0]


def kvhandoff_request(mm_hash: str, session: str, agent: str, tokens: int = 2) -> XferReq:
    return XferReq(
        mm_hash,
        COMPAT,
        session_id=session,
        transfer_id=secrets.token_hex(16),
        consumer_engine_id=agent,
        consumer_agent_name=agent,
        num_blocks=tokens,
        size_bytes=tokens * BLOCK_BYTES,
        extensions=EXTENSIONS,
    )


@pytest.fixture(scope="module")
def producer() -> Iterator[ECSide]:
    with producer_side() as side:
        yield side


class Bystander:
    """A NIXL agent that loaded the producer's metadata and sends it notifs."""

    def __init__(self, name: str, ack: XferAck) -> None:
        self.agent = NixlAgent(name, progress_thread=False)
        self.remote = self.agent.add_remote(ack.producer_agent_metadata)
        assert self.remote == ack.producer_agent_name

    def notify(self, side: ECSide, message: bytes, seen: Callable[[], bool]) -> None:
        self.agent.send_notif(self.remote, message)

        def arrived() -> bool:
            self.agent.get_new_notifs()  # progresses our side of the connection
            side.poll()
            return seen()

        until(arrived, f"the producer to see notif {message!r}")

    def close(self) -> None:
        self.agent.close()


def leased(side: ECSide) -> int:
    producer = side.scheduler.producer
    assert producer is not None
    return sum(producer.pins().values())


def test_S_02_read_notif_from_a_bystander_releases_nothing(
    producer: ECSide, caplog: pytest.LogCaptureFixture
) -> None:
    """A kvhandoff consumer releases its grant with `XferDone`: a NIXL notif naming its
    session and `mm_hash`, from anyone, releases nothing and is counted and logged."""
    mm_hash = unique("img-victim")
    publish(producer, mm_hash)
    victim = ControlClient("127.0.0.1", producer.publish_port)
    session = secrets.token_hex(16)
    ack = ask(producer, victim, kvhandoff_request(mm_hash, session, "victim-agent"))
    assert ack.status is XferStatus.OK and producer.scheduler.cache.state(mm_hash) == "pinned"
    pins = leased(producer)
    rogue = Bystander(unique("bystander"), ack)
    state = producer.scheduler.producer
    assert state is not None
    before = state.late_notifs + state.remote_errors
    try:
        with caplog.at_level(logging.WARNING, logger="kvhandoff.ec.side"):
            rogue.notify(
                producer,
                read_notif(session, mm_hash),
                lambda: state.late_notifs + state.remote_errors > before,
            )
        assert producer.scheduler.cache.state(mm_hash) == "pinned", "the victim's pin holds"
        assert leased(producer) == pins
        assert any("READ notif" in r.getMessage() for r in caplog.records), "logged"
    finally:
        rogue.close()
        victim.close()


def test_S_02_read_notif_counts_only_from_the_agent_the_consumer_announced(
    producer: ECSide,
) -> None:
    """A consumer that announced its NIXL agent and releases by notif: a bystander's notif
    is rejected and releases nothing; the announced agent's own notif releases it."""
    mm_hash = unique("img-bound")
    publish(producer, mm_hash)
    client = ControlClient("127.0.0.1", producer.publish_port)
    session, owner = secrets.token_hex(16), unique("owner-agent")
    req = kvhandoff_request(mm_hash, session, owner)
    no_xfer_done = XferReq(
        req.mm_hash,
        req.compat_hash,
        session_id=req.session_id,
        transfer_id=req.transfer_id,
        consumer_agent_name=owner,
        num_blocks=req.num_blocks,
        size_bytes=req.size_bytes,
    )
    ack = ask(producer, client, no_xfer_done)
    assert ack.status is XferStatus.OK
    state = producer.scheduler.producer
    assert state is not None
    rogue, real = Bystander(unique("bystander"), ack), Bystander(owner, ack)
    try:
        errors = state.remote_errors
        rogue.notify(producer, read_notif(session, mm_hash), lambda: state.remote_errors > errors)
        assert producer.scheduler.cache.state(mm_hash) == "pinned"
        assert producer.counters()["rejected"] >= 1
        real.notify(
            producer,
            read_notif(session, mm_hash),
            lambda: producer.scheduler.cache.state(mm_hash) == "ready",
        )
    finally:
        rogue.close()
        real.close()
        client.close()


def test_C_03_a_stock_consumers_read_notif_still_releases_its_own_grant(
    producer: ECSide,
) -> None:
    """vLLM 0.33's consumer names no agent and no extension: its notif releases its grant."""
    mm_hash = unique("img-stock")
    publish(producer, mm_hash)
    client = ControlClient("127.0.0.1", producer.publish_port)
    session = secrets.token_hex(16)
    ack = ask(producer, client, XferReq(mm_hash, COMPAT, session))
    assert ack.status is XferStatus.OK and ack.session_id == session
    stock = Bystander(unique("stock-consumer"), ack)
    try:
        stock.notify(
            producer,
            read_notif(session, mm_hash),
            lambda: producer.scheduler.cache.state(mm_hash) == "ready",
        )
    finally:
        stock.close()
        client.close()


# -- the consumer's data plane: agent names are self-declared (item 2) -----------------


class Region:
    """A producer's registered DRAM region under a NIXL agent named `name`."""

    def __init__(self, name: str, fill: int) -> None:
        self.buf = torch.full((8 * BLOCK_BYTES,), fill, dtype=torch.uint8)
        self.agent = NixlAgent(name, progress_thread=False)
        self.agent.register_dram(self.buf.data_ptr(), self.buf.numel())

    def grant(self, transfer_id: str, host: str, port: int, dst: int) -> IssueRead:
        return IssueRead(
            mm_hash=f"img-{transfer_id}",
            transfer_id=transfer_id,
            peer_host=host,
            peer_port=port,
            producer_agent_name=self.agent.name,
            producer_agent_metadata=self.agent.metadata(),
            remote_base_addr=self.buf.data_ptr(),
            src_blocks=(0,),
            dst_blocks=(dst,),
            block_size_bytes=BLOCK_BYTES,
            size_bytes=BLOCK_BYTES,
        )


def test_S_02_a_producer_claiming_anothers_agent_name_fails_none_of_its_reads() -> None:
    """Producer B sends a grant naming producer A's NIXL agent with B's own metadata
    while a READ from A is in flight: refused (the READ of B's grant fails), and A's
    READ completes with A's bytes."""
    name = unique("producer-a")
    dst = torch.zeros(8 * BLOCK_BYTES, dtype=torch.uint8)
    consumer = NixlAgent(unique("consumer"), progress_thread=False)
    a, b = Region(name, 7), Region(name, 9)  # B takes A's name
    try:
        consumer.register_dram(dst.data_ptr(), dst.numel())
        reader = ECNixlReader(consumer, dst.data_ptr(), BLOCK_BYTES, 8)
        reader.read(a.grant("t-a", "10.0.0.1", 5601, dst=0))
        assert reader.in_flight() == 1  # until the reader polls it
        with pytest.raises(RemoteProtocolError, match="READs in flight"):
            reader.read(b.grant("t-b", "10.0.0.2", 5601, dst=1))
        assert reader.loaded_agents() == {name: a.agent.metadata()}
        done: list[tuple[str, str, bool]] = []

        def ended() -> bool:
            a.agent.get_new_notifs()
            done.extend(reader.poll(lambda mm_hash, transfer_id: True))
            return any(t == "t-a" for _, t, _ in done)

        until(ended, "A's READ")
        assert ("img-t-a", "t-a", True) in done, "A's READ was not failed"
        assert ("img-t-b", "t-b", False) in done, "B's grant was refused"
        assert torch.all(dst[:BLOCK_BYTES] == 7) and torch.all(dst[BLOCK_BYTES:] == 0)
        assert reader.foreign_agents == 1
        reader.close()
    finally:
        for agent in (consumer, a.agent, b.agent):
            agent.close()


# -- the producer's ROUTER: sizes and hosts (items 3 and 5) -----------------------------


def dealer(port: int, source: str = "") -> zmq.Socket[bytes]:
    """A raw DEALER to the producer, from `source` (a loopback address) when given."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{source}:0;127.0.0.1:{port}" if source else f"tcp://127.0.0.1:{port}")
    return sock


def ask_raw(side: ECSide, sock: zmq.Socket[bytes], req: XferReq) -> XferAck:
    sock.send_multipart([b"", encode_xfer_req(req)])
    got: list[XferAck] = []

    def answered() -> bool:
        side.poll()
        while sock.poll(0, zmq.POLLIN):
            got.append(decode_xfer_ack(sock.recv_multipart()[-1]))
        return bool(got)

    until(answered, f"the answer to {req.mm_hash}")
    return got[0]


def test_S_01_the_producer_router_drops_messages_over_the_request_cap(producer: ECSide) -> None:
    """The ROUTER serves requests of a few KiB: one over the request cap is dropped by the
    frame check (counted, logged); one over twice the cap never reaches the producer (ZMQ
    closes that connection, which is counted and logged); the next request is served."""
    server = producer.server
    assert server is not None and server.max_message_bytes == MAX_REQUEST_BYTES
    rude = dealer(producer.publish_port)
    try:
        before = (server.oversized, server.disconnects, producer.rejected)
        rude.send_multipart([b"", b"\xc1" * (MAX_REQUEST_BYTES + 100)])
        until(lambda: producer.poll() >= 0 and server.oversized > before[0], "the frame check")
        rude.send_multipart([b"", b"\xc1" * (1 << 20)])
        until(lambda: producer.poll() >= 0 and server.disconnects > before[1], "ZMQ's drop")
        assert producer.rejected >= before[2] + 2, "both counted"
        reasons = producer.counters()["rejected_by_reason"]
        assert not any(r.startswith("EC message of") for r in reasons), "none was decoded"
    finally:
        rude.close(linger=0)
    polite = dealer(producer.publish_port)
    try:
        mm_hash = unique("img-after-big")
        publish(producer, mm_hash)
        ack = ask_raw(producer, polite, kvhandoff_request(mm_hash, "s", "agent-polite"))
        assert ack.status is XferStatus.OK
    finally:
        polite.close(linger=0)


def test_S_03_grant_caps_count_a_host_not_its_identities() -> None:
    """ZMQ identities are free: three DEALERs of one host share its per-host cap (2 here),
    and a consumer of another host is still granted."""
    caps = {"producer_max_grants_per_host": 2.0, "producer_max_grants_per_peer": 256.0}
    with producer_side(caps) as side:
        hashes = [unique(f"img-cap{i}") for i in range(4)]
        for mm_hash in hashes:
            publish(side, mm_hash)
        socks = [dealer(side.publish_port) for _ in range(3)]
        other = dealer(side.publish_port, source="127.0.0.2")
        try:
            statuses = [
                ask_raw(side, sock, kvhandoff_request(h, f"s{i}", f"agent-{i}")).status
                for i, (sock, h) in enumerate(zip(socks, hashes, strict=False))
            ]
            assert statuses == [XferStatus.OK, XferStatus.OK, XferStatus.NACK_INTERNAL]
            elsewhere = ask_raw(side, other, kvhandoff_request(hashes[3], "s9", "agent-9"))
            assert elsewhere.status is XferStatus.OK, "another host is not starved"
            assert side.scheduler.bus.metrics.get("ec.producer.over_cap", 0) == 1
        finally:
            for sock in [*socks, other]:
                sock.close(linger=0)
