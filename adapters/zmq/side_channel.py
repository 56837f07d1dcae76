"""The ZMQ side channel that hands out NIXL agent metadata (R-P15, C-01, S-01).

The wire is vLLM 0.33.0's, so a stock vLLM peer and kvhandoff fetch each other's
metadata. A `SideChannelServer` binds a ROUTER at `tcp://host:port`; a client (a REQ
socket) sends one msgpack array ``[b"get_meta_msg", pp_rank, tp_rank]`` per remote rank
and gets two frames back: that rank's handshake payload and the server's
``perf_counter`` as a msgpack float (the peer estimates the clock offset from it). The
payload is what `payload_provider(pp_rank, tp_rank)` returns at that moment (so metadata
registered later is included); None means no such rank.

The server runs on one daemon thread that owns the ROUTER; `close()` wakes that thread
through an inproc PAIR socket and joins it, so shutdown is deterministic. A request of
the wrong frame count, an oversized one (ZMQ drops a peer whose message exceeds
`MAX_REQUEST_BYTES`), garbage, msgpack nested or sized past tiny limits, kvhandoff's old
one-frame ``GET_META``, an unknown rank: each is dropped without an answer, counted
(`requests_dropped`) and logged rate-limited (`rejections`, S-06); no input, and no
error while answering one, stops the thread, and the next valid request is served (S-01).

Connections are bounded (S-03, B-11): a peer's handshake is one short REQ exchange (vLLM's
and kvhandoff's clients close the socket after it), so the server holds at most
`max_connections_per_host` connections of one host (the TCP peer address) and
`max_connections` in all, and closes any connection open longer than `connection_ttl_s`.
Past a cap the server sheds the oldest connection of that host (per-host cap) or of the
host that holds the most (total cap), so a flood from one host never locks out another
host's new handshake. ZMQ heartbeats close connections whose peer stopped answering, and a
TCP connection that never completes ZMQ's greeting is closed after `handshake_ivl_ms`.
Each shed connection is counted by cause (`connections_shed`) and logged rate-limited.
The server learns of connections from its ROUTER's socket monitor (the accepted file
descriptor) and sheds one by shutting that TCP socket down once it has checked, through
a duplicate descriptor, that it is still the same connection; ZMQ then closes it.

`fetch_rank_handshakes(host, port, timeout_s, ranks)` is the client: one REQ socket, one
request per rank, each reply checked to be two frames, or `HandshakeTimeout`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, cast

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvhandoff.adapters.clock import real_clock
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.errors import KvHandoffError, RemoteProtocolError
from kvhandoff.protocol.handshake import decode_handshake, engine_bundle_parts
from kvhandoff.protocol.nixl_wire import GET_META_MSG, decode_meta_request, encode_meta_request
from kvhandoff.protocol.push_wire import MSGPACK_DECODE_ERRORS

__all__ = [
    "GET_META_MSG",
    "HandshakeTimeout",
    "RankProvider",
    "SideChannelServer",
    "encode_request",
    "fetch_handshake",
    "fetch_rank_handshakes",
    "tcp_endpoint",
]

log = logging.getLogger(__name__)

#: Largest request message the server accepts; ZMQ drops a peer that sends more.
MAX_REQUEST_BYTES = 1024
#: Connections one host may hold open on a side channel (S-03).
DEFAULT_MAX_CONNECTIONS_PER_HOST = 64
#: Connections all hosts together may hold open on a side channel (S-03).
DEFAULT_MAX_CONNECTIONS = 512
#: Seconds a connection may stay open: a handshake takes milliseconds (B-11).
DEFAULT_CONNECTION_TTL_S = 30.0
#: ZMQ heartbeats of the ROUTER (ms): a peer that stops answering is closed.
HEARTBEAT_IVL_MS, HEARTBEAT_TIMEOUT_MS = 5000, 10_000
#: Time a TCP connection has to complete ZMQ's greeting (ms).
HANDSHAKE_IVL_MS = 5000


@dataclass(slots=True)
class _Connection:
    """One accepted TCP connection, as the ROUTER's monitor told it."""

    fd: int
    host: str
    peer: tuple[object, ...]
    since: float


RankProvider = Callable[[int, int], bytes | None]
"""(pp_rank, tp_rank) -> that rank's encoded payload, or None when there is no such rank."""

_CLOCK: Final = msgspec.msgpack.Decoder(float)


encode_request = encode_meta_request
"""The request for one rank's payload."""


def _rank_of_bundle(bundle: bytes, pp_rank: int, tp_rank: int) -> bytes | None:
    """The element of an `encode_engine_handshake` bundle serving (pp_rank, tp_rank)."""
    for part in engine_bundle_parts(bundle):
        payload = decode_handshake(part)
        if (payload.pp_rank, payload.tp_rank) == (pp_rank, tp_rank):
            return part
    return None


#: Largest reply the client accepts by default (agent metadata grows with registrations).
MAX_REPLY_BYTES = 64 * 1024 * 1024

_STOP = b"STOP"
_stop_ids = itertools.count()


class HandshakeTimeout(KvHandoffError):
    """No side-channel reply arrived in time (nobody listening, or a dead peer)."""

    def __init__(self, endpoint: str, timeout_s: float) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        super().__init__(f"no handshake reply from {endpoint} within {timeout_s:g} s")


def tcp_endpoint(host: str, port: int) -> str:
    """`tcp://host:port`, with brackets for an IPv6 literal; port 0 means any free port."""
    if not 0 <= port <= 65535:
        raise ValueError(f"port out of range: {port}")
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{shown}:{port if port else '*'}"


class SideChannelServer:
    """ROUTER on a daemon thread answering each rank's request with its payload.

    `payload_provider` takes (pp_rank, tp_rank). A provider of no arguments returns an
    `encode_engine_handshake` bundle of every rank, and the server picks the rank asked
    for (for callers that hold a whole engine's payloads at once)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        payload_provider: RankProvider | Callable[[], bytes] | None = None,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        poll_ms: int = 1000,
        max_connections_per_host: int = DEFAULT_MAX_CONNECTIONS_PER_HOST,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        connection_ttl_s: float = DEFAULT_CONNECTION_TTL_S,
        handshake_ivl_ms: int = HANDSHAKE_IVL_MS,
    ) -> None:
        self._provider = _rank_provider(payload_provider)
        self.max_connections_per_host = max_connections_per_host
        self.max_connections = max_connections
        self.connection_ttl_s = connection_ttl_s
        # The accepted TCP connections by descriptor, oldest first, and how many each host
        # holds: the ROUTER's file descriptors, owned by the serving thread.
        self._conns: OrderedDict[int, _Connection] = OrderedDict()
        self._per_host: Counter[str] = Counter()
        self.connections_accepted = 0
        self.connections_shed: Counter[str] = Counter()
        """Connections the server closed, by cause: `host_cap`, `total_cap`, `ttl`."""
        # ZMQ closes sockets on its I/O thread, after `close` returns: only terminating the
        # context waits for the listening socket to be gone. A server that owns its context
        # therefore frees its port by the time `close` returns.
        self._owns_ctx = context is None
        self._ctx = context if context is not None else zmq.Context()
        self._poll_ms = poll_ms
        self.requests_served = 0
        self.requests_dropped = 0
        self.errors = 0
        self.rejections = RejectionLog(log, what="side-channel request")

        router = self._ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        router.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        router.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        router.setsockopt(zmq.HANDSHAKE_IVL, handshake_ivl_ms)
        if ":" in host:
            router.setsockopt(zmq.IPV6, 1)
        monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        try:
            router.bind(tcp_endpoint(host, port))
        except zmq.ZMQError:
            router.disable_monitor()
            monitor.close(linger=0)
            router.close(linger=0)
            if self._owns_ctx:
                self._ctx.term()
            raise
        self.endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.host = host
        self.port = int(self.endpoint.rsplit(":", 1)[1])

        stop_addr = f"inproc://kvhandoff-side-channel-stop-{os.getpid()}-{next(_stop_ids)}"
        wake = self._ctx.socket(zmq.PAIR)
        wake.bind(stop_addr)
        self._stopper = self._ctx.socket(zmq.PAIR)
        self._stopper.setsockopt(zmq.LINGER, 0)
        self._stopper.connect(stop_addr)
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._serve,
            args=(router, wake, monitor),
            name=f"side-channel:{self.port}",
            daemon=True,
        )
        self._thread.start()

    def _serve(
        self, router: zmq.Socket[bytes], wake: zmq.Socket[bytes], monitor: zmq.Socket[bytes]
    ) -> None:
        """Thread body: answer requests until the stop socket speaks."""
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        poll_ms = min(self._poll_ms, max(int(self.connection_ttl_s * 500), 10))
        try:
            while True:
                try:
                    ready = dict(poller.poll(poll_ms))
                    if wake in ready:
                        return
                    self._watch(monitor)
                    if router in ready:
                        self._drain(router)
                except zmq.ContextTerminated:
                    return
                except Exception:  # no request, and no bug answering one, stops the thread
                    self.errors += 1
                    log.exception("side channel on port %d: error while serving", self.port)
        finally:
            router.disable_monitor()
            monitor.close(linger=0)
            router.close(linger=0)
            wake.close(linger=0)

    # -- connections (S-03, B-11) ----------------------------------------------------------

    @property
    def connections_open(self) -> int:
        """TCP connections the server holds now (as its monitor last told)."""
        return len(self._conns)

    def _watch(self, monitor: zmq.Socket[bytes]) -> None:
        """Apply the monitor's events, then the caps and the TTL."""
        now = real_clock()
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            fd = int(event["value"])
            if int(event["event"]) == zmq.EVENT_DISCONNECTED:
                self._forget(fd)
                continue
            self._forget(fd)  # a descriptor is reused only after its close was told
            conn = _accepted(fd, now)
            if conn is None:
                continue  # gone already
            self.connections_accepted += 1
            self._conns[fd] = conn
            self._per_host[conn.host] += 1
            if self._per_host[conn.host] > self.max_connections_per_host:
                self._shed(self._oldest_of(conn.host), "host_cap", now)
            elif len(self._conns) > self.max_connections:
                busiest = self._per_host.most_common(1)[0][0]
                self._shed(self._oldest_of(busiest), "total_cap", now)
        while self._conns:
            oldest = next(iter(self._conns.values()))
            if now - oldest.since < self.connection_ttl_s:
                break
            self._shed(oldest, "ttl", now)

    def _oldest_of(self, host: str) -> _Connection:
        return next(c for c in self._conns.values() if c.host == host)

    def _forget(self, fd: int) -> _Connection | None:
        conn = self._conns.pop(fd, None)
        if conn is not None:
            self._per_host[conn.host] -= 1
            if self._per_host[conn.host] <= 0:
                del self._per_host[conn.host]
        return conn

    def _shed(self, conn: _Connection, cause: str, now: float) -> None:
        """Close `conn` (ZMQ sees its end and drops it), counted and logged (S-06)."""
        self._forget(conn.fd)
        self.connections_shed[cause] += 1
        _shutdown(conn, self.port)
        self.rejections.reject(
            conn.host,
            f"connection shed: {cause} (limits {self.max_connections_per_host} "
            f"per host, {self.max_connections} in all, {self.connection_ttl_s:g} s)",
            now,
        )

    def _drain(self, router: zmq.Socket[bytes]) -> None:
        """Answer every queued request without blocking."""
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            peer = frames[0].hex()[:32] if frames else None
            try:
                reply = self._answer(frames)
            except RemoteProtocolError as exc:
                self.requests_dropped += 1
                self.rejections.reject(peer, exc, real_clock())
                continue
            # Counted before the send: a peer that got its reply may read the counter.
            self.requests_served += 1
            try:
                router.send_multipart(reply, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone or its queue full: it will time out
                self.requests_served -= 1
                self.requests_dropped += 1
                log.debug("side channel reply dropped: %s", exc)

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        """Reply frames for one request; `RemoteProtocolError` for one to drop.

        Accepted shape: `[identity, b"", request]` (a REQ client, or a DEALER that sends
        the empty delimiter itself); the reply keeps the envelope."""
        if len(frames) != 3 or frames[1] != b"":
            raise RemoteProtocolError(f"request of {len(frames) - 1} frames, expected 2")
        pp_rank, tp_rank = decode_meta_request(frames[2])
        try:
            payload = self._provider(pp_rank, tp_rank)
        except Exception as exc:
            log.exception("side channel payload provider failed")
            raise RemoteProtocolError(f"no payload for pp {pp_rank} / tp {tp_rank}") from exc
        if payload is None:
            raise RemoteProtocolError(f"no rank pp {pp_rank} / tp {tp_rank} here")
        clock = msgspec.msgpack.encode(time.perf_counter())
        return [frames[0], b"", bytes(payload), clock]

    def close(self) -> None:
        """Stop the thread and close its sockets; returns once it has. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            with contextlib.suppress(zmq.Again):  # Again: the thread already ended
                self._stopper.send(_STOP, zmq.NOBLOCK)
            self._thread.join()
            self._stopper.close(linger=0)
            if self._owns_ctx:
                self._ctx.term()  # returns once every socket, the listener too, is closed

    @property
    def running(self) -> bool:
        """True while the serving thread is alive."""
        return self._thread.is_alive()

    def __enter__(self) -> SideChannelServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _dup(fd: int) -> socket.socket | None:
    """A duplicate of descriptor `fd` as a socket object, or None if it is closed."""
    try:
        return socket.socket(fileno=os.dup(fd))
    except OSError:
        return None


def _accepted(fd: int, now: float) -> _Connection | None:
    """What the monitor's accepted descriptor `fd` is connected to (None: gone)."""
    sock = _dup(fd)
    if sock is None:
        return None
    with sock:
        try:
            peer = sock.getpeername()
        except OSError:
            return None
    peer = tuple(peer) if isinstance(peer, tuple) else (peer,)
    return _Connection(fd, str(peer[0]), peer, now)


def _shutdown(conn: _Connection, port: int) -> None:
    """Shut the TCP connection of `conn` down, if its descriptor still names it (the same
    local port and peer): a descriptor reused by another socket is left alone."""
    sock = _dup(conn.fd)
    if sock is None:
        return
    with sock:
        try:
            peer = sock.getpeername()
            same = sock.getsockname()[1] == port and tuple(peer) == conn.peer
            if same:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return


def _rank_provider(provider: RankProvider | Callable[[], bytes] | None) -> RankProvider:
    if provider is None:
        raise ValueError("SideChannelServer needs a payload_provider")
    required = [
        p
        for p in inspect.signature(provider).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if not required:
        bundle_of = cast(Callable[[], bytes], provider)

        def from_bundle(pp_rank: int, tp_rank: int) -> bytes | None:
            return _rank_of_bundle(bundle_of(), pp_rank, tp_rank)

        return from_bundle
    return cast(RankProvider, provider)


def fetch_rank_handshakes(
    host: str,
    port: int,
    timeout_s: float,
    ranks: Sequence[tuple[int, int]],
    *,
    max_reply_bytes: int = MAX_REPLY_BYTES,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> list[bytes]:
    """Ask the side channel at `host:port` for the payload of each (pp_rank, tp_rank).

    Raises `HandshakeTimeout` when a reply does not arrive within `timeout_s` (connection
    refused counts: ZMQ keeps retrying until the deadline), `RemoteProtocolError` for a
    reply that is not two frames or whose clock frame is not a msgpack number.
    """
    if port <= 0:
        raise ValueError(f"cannot fetch from port {port}")
    endpoint = tcp_endpoint(host, port)
    ctx = context if context is not None else zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        payloads = []
        for pp_rank, tp_rank in ranks:
            sock.send(encode_request(pp_rank, tp_rank))
            if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
                raise HandshakeTimeout(endpoint, timeout_s)
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 2:
                raise RemoteProtocolError(
                    f"side-channel reply has {len(frames)} frames, expected 2", peer=endpoint
                )
            try:
                _CLOCK.decode(frames[1])
            except MSGPACK_DECODE_ERRORS as exc:
                raise RemoteProtocolError(
                    f"side-channel reply's clock frame is malformed: {exc}", peer=endpoint
                ) from exc
            payloads.append(frames[0])
        return payloads
    finally:
        sock.close(linger=0)


def fetch_handshake(
    host: str,
    port: int,
    timeout_s: float,
    *,
    pp_rank: int = 0,
    tp_rank: int = 0,
    max_reply_bytes: int = MAX_REPLY_BYTES,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> bytes:
    """One rank's payload (rank (0, 0) by default); see `fetch_rank_handshakes`."""
    return fetch_rank_handshakes(
        host,
        port,
        timeout_s,
        [(pp_rank, tp_rank)],
        max_reply_bytes=max_reply_bytes,
        context=context,
    )[0]
