"""The push side channel against hostile clients (S-01, C-01, issue 16 item 3).

Real ZMQ sockets on loopback. The server speaks vLLM 0.33's request and reply; any other
input (a wrong frame count, garbage, kvhandoff's old one-frame dialect, deeply nested or
oversized msgpack, a rank the engine lacks) is dropped and counted, and the next valid
request is served. Every wait is bounded polling against a deadline.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from push_wire_strategies import hostile_side_channel_requests
from zmq.utils.monitor import recv_monitor_message

from kvhandoff.adapters.zmq.side_channel import (
    SideChannelServer,
    encode_request,
    fetch_handshake,
)

DEADLINE_MS = 10_000
PAYLOAD = b"rank-0-payload"


@pytest.fixture(scope="module")
def server() -> Iterator[SideChannelServer]:
    with SideChannelServer(
        "127.0.0.1", 0, lambda pp, tp: PAYLOAD if (pp, tp) == (0, 0) else None
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def dealer(server: SideChannelServer) -> Iterator[zmq.Socket[bytes]]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    yield sock
    sock.close()


def _valid_reply(sock: zmq.Socket[bytes]) -> list[bytes]:
    sock.send_multipart([b"", encode_request(0, 0)])
    assert sock.poll(DEADLINE_MS), "the next valid request was not served"
    return sock.recv_multipart()


@settings(
    deadline=None,
    max_examples=120,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(frames=hostile_side_channel_requests)
def test_S_01_side_channel_drops_hostile_requests_and_serves_the_next(
    server: SideChannelServer, dealer: zmq.Socket[bytes], frames: list[bytes]
) -> None:
    dropped, served = server.requests_dropped, server.requests_served
    dealer.send_multipart(frames)
    # One connection keeps order: the valid request's reply comes after the hostile one
    # was handled, and it is the first reply, so the hostile one got none.
    reply = _valid_reply(dealer)
    assert reply[:2] == [b"", PAYLOAD]
    assert isinstance(msgspec.msgpack.decode(reply[2]), float)  # the sender's clock
    assert server.requests_dropped == dropped + 1
    assert server.requests_served == served + 1
    assert server.running


def test_S_01_side_channel_survives_an_oversized_request(server: SideChannelServer) -> None:
    big: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    big.setsockopt(zmq.LINGER, 0)
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    big.connect(server.endpoint)
    try:
        big.send_multipart([b"", b"\xc4\xff" + b"x" * 100_000])  # over the request cap
        assert monitor.poll(DEADLINE_MS)
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        big.disable_monitor()
        monitor.close()
        big.close()
    assert server.running
    assert fetch_handshake("127.0.0.1", server.port, DEADLINE_MS / 1000) == PAYLOAD


def test_S_01_side_channel_rejections_are_counted_per_peer(server: SideChannelServer) -> None:
    before = server.rejections.total
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    try:
        sock.send(b"GET_META")  # kvhandoff's old dialect
        assert _valid_reply(sock)[1] == PAYLOAD
    finally:
        sock.close()
    assert server.rejections.total == before + 1


def test_C_01_req_client_gets_two_frames_like_vllm(server: SideChannelServer) -> None:
    """vLLM 0.33's client: a REQ socket, a msgpack (verb, pp_rank, tp_rank), a reply of
    the payload and the sender's clock."""
    req: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(server.endpoint)
    try:
        req.send(msgspec.msgpack.encode((b"get_meta_msg", 0, 0)))
        assert req.poll(DEADLINE_MS)
        payload, clock = req.recv_multipart()
    finally:
        req.close()
    assert payload == PAYLOAD
    assert isinstance(msgspec.msgpack.decode(clock), float)


@pytest.mark.parametrize(
    "reply",
    [[b"only-one-frame"], [b"payload", b"not-msgpack-\xc1"], [b"a", b"b", b"c"]],
    ids=["one-frame", "bad-clock", "three-frames"],
)
def test_C_01_S_01_client_refuses_a_malformed_reply(reply: list[bytes]) -> None:
    """kvhandoff's client: a reply that is not (payload, msgpack clock) is a remote error."""
    import threading

    from kvhandoff.adapters.zmq.side_channel import fetch_rank_handshakes
    from kvhandoff.protocol.errors import RemoteProtocolError

    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer_once() -> None:
        if router.poll(DEADLINE_MS):
            identity, empty, _request = router.recv_multipart()
            router.send_multipart([identity, empty, *reply])

    thread = threading.Thread(target=answer_once, daemon=True)
    thread.start()
    try:
        with pytest.raises(RemoteProtocolError):
            fetch_rank_handshakes("127.0.0.1", port, DEADLINE_MS / 1000, [(0, 0)])
    finally:
        thread.join(DEADLINE_MS / 1000)
        router.close()


# -- connection caps, TTL (issue 27 item 4; S-03, B-11, S-06) ----------------------------


def _until(step: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not step():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)  # yield to the server's thread; never a synchronisation


def _idle_connections(port: int, count: int) -> list[socket.socket]:
    """`count` TCP connections that never say a word (the flood that took P's fds)."""
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]


def _closed_by_server(sock: socket.socket) -> bool:
    """Read (ZMQ's greeting) until the server closes the connection: EOF or a reset."""
    sock.settimeout(DEADLINE_MS / 1000)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
    return True


def _fetch_from(source: str, port: int) -> list[bytes]:
    """One vLLM-style request over a REQ socket bound to the loopback address `source`."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{source}:0;127.0.0.1:{port}")
        sock.send(encode_request(0, 0))
        assert sock.poll(DEADLINE_MS), f"no reply to a handshake from {source}"
        return sock.recv_multipart()
    finally:
        sock.close(linger=0)


def test_S_03_the_side_channel_caps_connections_per_host_and_in_all() -> None:
    """40 idle connections from one host: it keeps at most its 5, the flood is shed and
    counted, and a handshake from that host and from another is served."""
    provider = lambda pp, tp: PAYLOAD if (pp, tp) == (0, 0) else None  # noqa: E731
    with SideChannelServer(
        "127.0.0.1", 0, provider, max_connections_per_host=5, max_connections=8
    ) as srv:
        flood = _idle_connections(srv.port, 40)
        more: list[socket.socket] = []
        try:
            _until(
                lambda: srv.connections_accepted >= 40 and srv.connections_open <= 5,
                "the flood to be shed",
            )
            assert srv.connections_shed["host_cap"] >= 35
            assert srv.rejections.total >= 35, "each shed connection counted"
            assert _fetch_from("127.0.0.1", srv.port)[0] == PAYLOAD, "its own host served"
            assert _fetch_from("127.0.0.2", srv.port)[0] == PAYLOAD, "another host served"
            hosts = [f"127.0.0.{i}" for i in range(3, 7)]
            for host in hosts:  # 4 more hosts x 2: over the total cap of 8
                for _ in range(2):
                    s = socket.socket()
                    s.bind((host, 0))
                    s.connect(("127.0.0.1", srv.port))
                    more.append(s)
            _until(
                lambda: srv.connections_accepted >= 48 and srv.connections_open <= 8,
                "the total cap",
            )
            assert srv.connections_shed["total_cap"] >= 1
            assert srv.running
        finally:
            for s in flood + more:
                s.close()


def test_B_11_the_side_channel_closes_connections_past_their_ttl() -> None:
    provider = lambda pp, tp: PAYLOAD if (pp, tp) == (0, 0) else None  # noqa: E731
    with SideChannelServer("127.0.0.1", 0, provider, connection_ttl_s=0.2) as srv:
        idle = _idle_connections(srv.port, 3)
        try:
            _until(lambda: srv.connections_shed["ttl"] >= 3, "the TTL")
            for s in idle:
                assert _closed_by_server(s), "the idle connection was closed"
            assert srv.connections_open == 0
            assert _fetch_from("127.0.0.1", srv.port)[0] == PAYLOAD
        finally:
            for s in idle:
                s.close()
