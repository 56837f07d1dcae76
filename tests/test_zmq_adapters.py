"""The ZMQ edges: the side-channel handshake (R-P15) and the control-plane transport (R-E09).

Real sockets on loopback; every wait is bounded polling against a deadline.
"""

from __future__ import annotations

import importlib.util
import random
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvhandoff.adapters.zmq.control import (
    ControlClient,
    ControlEvent,
    ControlServer,
    Heartbeat,
)
from kvhandoff.adapters.zmq.side_channel import (
    HandshakeTimeout,
    SideChannelServer,
    encode_request,
    fetch_handshake,
)
from kvhandoff.protocol.errors import KvHandoffError

HELPERS = Path(__file__).resolve().parent / "helpers"
DEADLINE_S = 10.0


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvh_helpers_{name}", HELPERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A port nobody listens on (bound once by the kernel's choice, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    calls = iter(range(1_000_000))
    srv = SideChannelServer("127.0.0.1", 0, lambda pp, tp: b"META-%d" % next(calls))
    yield srv
    srv.close()


def dealer(endpoint: str) -> zmq.Socket[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def client_events_until(
    client: ControlClient, done: Callable[[list[ControlEvent]], bool]
) -> list[ControlEvent]:
    """Bounded polling of the client's monitor until `done(events)` holds."""
    events: list[ControlEvent] = []
    deadline = time.monotonic() + DEADLINE_S
    while not done(events) and time.monotonic() < deadline:
        client.wait_readable(50)
        events += client.poll_events()
    return events


def disconnected(events: list[ControlEvent]) -> bool:
    return any(e.kind == "DISCONNECTED" for e in events)


# -- side channel (R-P15) -------------------------------------------------------------------


def test_R_P15_handshake_fetch_returns_fresh_payload(server: SideChannelServer) -> None:
    assert server.port > 0
    assert fetch_handshake("127.0.0.1", server.port, DEADLINE_S) == b"META-0"
    # The provider runs per request, so metadata registered later is served.
    assert fetch_handshake("127.0.0.1", server.port, DEADLINE_S) == b"META-1"
    assert server.requests_served == 2


def test_R_P15_handshake_answers_req_clients(server: SideChannelServer) -> None:
    req: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(server.endpoint)
    try:
        req.send(encode_request(0, 0))
        assert req.poll(int(DEADLINE_S * 1000))
        payload, clock = req.recv_multipart()  # vLLM 0.33: payload, then the sender's clock
        assert payload == b"META-0"
        assert isinstance(msgspec.msgpack.decode(clock), float)
    finally:
        req.close()


def test_R_P15_handshake_timeout_when_nobody_listens() -> None:
    port = free_port()
    with pytest.raises(HandshakeTimeout) as info:
        fetch_handshake("127.0.0.1", port, 0.2)
    assert isinstance(info.value, KvHandoffError)
    assert str(port) in str(info.value)


def test_R_P15_server_ignores_garbage_and_oversized(server: SideChannelServer) -> None:
    sock = dealer(server.endpoint)
    try:
        sock.send(b"GET_SOMETHING_ELSE")
        sock.send_multipart([b"not-empty", encode_request(0, 0)])
        sock.send(b"GET_META")  # kvhandoff's old one-frame dialect
        sock.send_multipart([b"", encode_request(0, 0)])
        # One connection keeps order: this reply proves the garbage before it was read.
        assert sock.poll(int(DEADLINE_S * 1000))
        assert sock.recv_multipart()[:2] == [b"", b"META-0"]
    finally:
        sock.close()
    assert server.requests_dropped == 3

    big = dealer(server.endpoint)
    monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        big.send(b"x" * 100_000)  # over the request cap: ZMQ drops this connection
        assert monitor.poll(int(DEADLINE_S * 1000))
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        big.disable_monitor()
        monitor.close()
        big.close()
    assert server.running
    assert fetch_handshake("127.0.0.1", server.port, DEADLINE_S) == b"META-1"
    assert server.requests_served == 2


def test_R_P15_provider_failure_does_not_stop_server() -> None:
    answers: Iterator[RuntimeError | bytes] = iter([RuntimeError("not ready"), b"META"])

    def provider(pp_rank: int, tp_rank: int) -> bytes:
        item = next(answers)
        if isinstance(item, RuntimeError):
            raise item
        return item

    with SideChannelServer("127.0.0.1", 0, provider) as srv:
        with pytest.raises(HandshakeTimeout):
            fetch_handshake("127.0.0.1", srv.port, 0.3)
        assert fetch_handshake("127.0.0.1", srv.port, DEADLINE_S) == b"META"
        assert srv.requests_dropped == 1


def _unassigned_ports() -> list[int]:
    """Ports below the kernel's ephemeral range, from a random start: no other process's
    bind to port 0 (tests run beside other work) can take one between a close and a
    rebind here."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    ports = list(range(10_000, low))
    start = random.Random().randrange(len(ports))
    return ports[start:] + ports[:start]


def test_R_P15_close_is_deterministic_and_frees_the_port() -> None:
    server = None
    for candidate in _unassigned_ports():
        try:
            server = SideChannelServer("127.0.0.1", candidate, lambda pp, tp: b"META")
        except zmq.ZMQError:
            continue  # in use by someone else: try the next
        break
    assert server is not None, "no free port below the ephemeral range"
    port = server.port
    server.close()
    assert not server.running  # joined, not merely signalled
    server.close()  # idempotent
    with SideChannelServer("127.0.0.1", port, lambda pp, tp: b"again") as again:
        assert again.port == port
        assert fetch_handshake("127.0.0.1", port, DEADLINE_S) == b"again"


def test_R_P15_fetch_rejects_bad_port() -> None:
    with pytest.raises(ValueError):
        fetch_handshake("127.0.0.1", 0, 1.0)


# -- control plane (R-E09) ------------------------------------------------------------------


def test_R_E09_heartbeat_options() -> None:
    with ControlServer("127.0.0.1", 0) as srv, ControlClient("127.0.0.1", srv.port) as client:
        assert client.socket_heartbeat() == Heartbeat(2000, 4000, 8000)
        assert srv.socket_heartbeat() == Heartbeat(2000, 4000, 8000)
    custom = Heartbeat(interval_ms=500, timeout_ms=1500, ttl_ms=3000)
    with ControlClient("127.0.0.1", free_port(), heartbeat=custom) as client:
        assert client.socket_heartbeat() == custom


def test_R_E09_default_endpoint_is_localhost_5601() -> None:
    with ControlClient() as client:
        assert client.endpoint == "tcp://localhost:5601"


def test_R_E09_control_round_trip() -> None:
    with (
        ControlServer("127.0.0.1", 0) as srv,
        ControlClient("127.0.0.1", srv.port) as one,
        ControlClient("127.0.0.1", srv.port) as two,
    ):
        assert one.send(b"req-one")
        assert two.send(b"req-two")
        requests: list[tuple[bytes, bytes]] = []
        deadline = time.monotonic() + DEADLINE_S
        while len(requests) < 2 and time.monotonic() < deadline:
            srv.wait_readable(50)
            requests += srv.poll_requests()
        assert sorted(payload for _, payload in requests) == [b"req-one", b"req-two"]
        assert len({peer for peer, _ in requests}) == 2
        for peer, payload in requests:
            assert srv.reply(peer, b"ack:" + payload)
        assert not srv.reply(b"no-such-peer", b"x")
        for client, expected in ((one, b"ack:req-one"), (two, b"ack:req-two")):
            replies: list[bytes] = []
            deadline = time.monotonic() + DEADLINE_S
            while not replies and time.monotonic() < deadline:
                client.wait_readable(50)
                replies = client.poll_replies()
            assert replies == [expected]
        assert srv.poll_requests() == []


def test_R_E09_disconnect_event_when_server_closes() -> None:
    srv = ControlServer("127.0.0.1", 0)
    with ControlClient("127.0.0.1", srv.port) as client:
        events = client_events_until(client, lambda ev: client.connected)
        assert client.connected and not client.peer_disconnected, events
        srv.close()
        events = client_events_until(client, disconnected)
        assert disconnected(events)
        assert client.peer_disconnected and not client.connected
        assert client.disconnects == 1


def test_R_E09_oversized_request_drops_the_sender() -> None:
    with (
        ControlServer("127.0.0.1", 0, max_message_bytes=1024) as srv,
        ControlClient("127.0.0.1", srv.port) as client,
    ):
        client_events_until(client, lambda ev: client.connected)
        assert client.send(b"x" * 4096)
        assert disconnected(client_events_until(client, disconnected))
        assert srv.poll_requests() == []


def test_R_E09_malformed_frames_are_dropped() -> None:
    with ControlServer("127.0.0.1", 0) as srv:
        sock = dealer(srv.endpoint)
        try:
            sock.send_multipart([b"two", b"frames"])
            sock.send_multipart([b"", b"fine"])  # vLLM 0.33 framing (C-03)
            got: list[tuple[bytes, bytes]] = []
            deadline = time.monotonic() + DEADLINE_S
            while not got and time.monotonic() < deadline:
                srv.wait_readable(50)
                got = srv.poll_requests()
        finally:
            sock.close()
        assert [payload for _, payload in got] == [b"fine"]
        assert srv.dropped == 1


@pytest.mark.integration
def test_R_E09_heartbeat_detects_silent_peer(tmp_path: Path) -> None:
    """A producer that is stopped (TCP up, ZMQ silent) is seen as disconnected."""
    child_mod = _load("child")
    fast = Heartbeat(interval_ms=100, timeout_ms=300, ttl_ms=1000)
    child = child_mod.Child(
        "control_server.py", "100", "300", "1000", stderr_path=tmp_path / "srv.stderr"
    )
    try:
        port = int(child.expect().split()[1])
        with ControlClient("127.0.0.1", port, heartbeat=fast) as client:
            assert client.send(b"ping")
            replies: list[bytes] = []
            deadline = time.monotonic() + DEADLINE_S
            while not replies and time.monotonic() < deadline:
                client.wait_readable(50)
                replies = client.poll_replies()
            assert replies == [b"re:ping"]
            child.proc.send_signal(signal.SIGSTOP)
            try:
                events = client_events_until(client, disconnected)
            finally:
                child.proc.send_signal(signal.SIGCONT)
            assert disconnected(events)
            assert client.peer_disconnected
    finally:
        child.close()
