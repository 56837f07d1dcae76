"""Byte transport of the encoder-cache control plane (R-E09).

The producer binds one `ControlServer` (a ROUTER, default `localhost:5601`); each consumer
keeps one `ControlClient` (a DEALER) per producer peer. Only bytes move here: the msgspec
codec of `XferReq`/`XferAck` lives in the protocol package.

Framing is vLLM 0.33.0's (C-03): the DEALER sends `[b"", message]` and receives the
same; the ROUTER receives `[identity, b"", message]` and answers with it. Any other
frame shape (a missing or non-empty delimiter, too few or too many frames) is dropped,
counted in `dropped` and handed to `on_reject(peer, reason)`; the socket goes on serving
the next message (item 3 of issue 16, S-01, S-06).

Both ends are single-threaded: the caller's thread owns the sockets and drives them with
the non-blocking `poll_*` methods. Sockets use linger 0 and a message size cap (ZMQ drops
a peer that sends a bigger message), and ZMQ heartbeats (2 s interval, 4 s timeout, 8 s TTL
by default) so a dead peer's connection is closed. The client watches its socket monitor;
a closed connection surfaces as a `DISCONNECTED` event from `poll_events()` and bumps
`disconnects`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvhandoff.adapters.zmq.side_channel import tcp_endpoint
from kvhandoff.protocol.ec_wire import MAX_XFER_DONE_BYTES, MAX_XFER_REQ_BYTES

__all__ = [
    "DEFAULT_CONTROL_HOST",
    "DEFAULT_CONTROL_PORT",
    "ControlClient",
    "ControlEvent",
    "ControlRequest",
    "ControlServer",
    "Heartbeat",
    "read_heartbeat",
]

log = logging.getLogger(__name__)

DEFAULT_CONTROL_HOST = "localhost"
DEFAULT_CONTROL_PORT = 5601
#: Largest control message a consumer's DEALER accepts: an XferAck carries agent metadata
#: and, from a stock vLLM producer, its per-block descriptor list.
MAX_CONTROL_BYTES = 16 * 1024 * 1024
#: Largest message the producer's ROUTER serves: the largest valid XferReq / XferDone
#: (`ec_wire`), a few KiB. A bigger one is dropped, counted and logged by `poll_requests`.
MAX_REQUEST_BYTES = max(MAX_XFER_REQ_BYTES, MAX_XFER_DONE_BYTES)
#: The ROUTER's ZMQ_MAXMSGSIZE: ZMQ closes the connection of a peer that sends a frame
#: over it before the frame is buffered (RSS stays flat under a flood of big messages);
#: between `MAX_REQUEST_BYTES` and this, the frame check drops it.
MAX_REQUEST_FRAME_BYTES = 2 * MAX_REQUEST_BYTES
#: Frames a request may have: (identity, b"", message).
_REQUEST_FRAMES = 3
#: Most messages one poll call returns, so one busy peer cannot starve a scheduler step.
MAX_BATCH = 1024

_EVENT_NAMES: dict[int, str] = {
    zmq.EVENT_CONNECTED: "CONNECTED",
    zmq.EVENT_CONNECT_DELAYED: "CONNECT_DELAYED",
    zmq.EVENT_CONNECT_RETRIED: "CONNECT_RETRIED",
    zmq.EVENT_CLOSED: "CLOSED",
    zmq.EVENT_DISCONNECTED: "DISCONNECTED",
    zmq.EVENT_HANDSHAKE_SUCCEEDED: "HANDSHAKE_SUCCEEDED",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "HANDSHAKE_FAILED",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "HANDSHAKE_FAILED",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "HANDSHAKE_FAILED",
}
_WATCHED = sum(_EVENT_NAMES)

RejectHook = Callable[[str, str], None]
"""`on_reject(peer, reason)`: a message the socket dropped, for the caller's rejection log."""


def _quiet(peer: str, reason: str) -> None:
    log.debug("control message from %s dropped: %s", peer, reason)


def _peer_address(frame: zmq.Frame) -> str:
    """The TCP peer's address of a received message ('' when ZMQ does not say)."""
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, KeyError, AttributeError):
        return ""


def _frames_problem(frames: list[bytes], expected: int) -> str | None:
    """Why `frames` is not vLLM's envelope of `expected` frames (the message last, an
    empty delimiter before it), or None."""
    if len(frames) != expected:
        shape = "(identity, b'', message)" if expected == 3 else "(b'', message)"
        return f"{len(frames)} frames, expected {expected} {shape}"
    if frames[-2] != b"":
        return f"frame {expected - 2} is not the empty delimiter"
    return None


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """ZMQ heartbeat options in milliseconds (R-E09 defaults)."""

    interval_ms: int = 2000
    timeout_ms: int = 4000
    ttl_ms: int = 8000

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        """Set ZMQ_HEARTBEAT_IVL / _TIMEOUT / _TTL on `sock` (before connect or bind)."""
        sock.setsockopt(zmq.HEARTBEAT_IVL, self.interval_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, self.timeout_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, self.ttl_ms)


def read_heartbeat(sock: zmq.Socket[bytes]) -> Heartbeat:
    """The heartbeat options a socket actually has (for diagnostics and tests)."""
    return Heartbeat(
        interval_ms=int(sock.getsockopt(zmq.HEARTBEAT_IVL)),
        timeout_ms=int(sock.getsockopt(zmq.HEARTBEAT_TIMEOUT)),
        ttl_ms=int(sock.getsockopt(zmq.HEARTBEAT_TTL)),
    )


class ControlRequest(NamedTuple):
    """One request from a consumer: its ZMQ identity, the message, the peer's address."""

    identity: bytes
    payload: bytes
    host: str
    """The consumer's IP address as the TCP connection says (ZMQ's `Peer-Address`): what
    per-host caps count (S-03), since identities are the peer's free choice."""


class ControlEvent(NamedTuple):
    """One socket monitor event: `kind` is a name such as "CONNECTED" or "DISCONNECTED"."""

    kind: str
    endpoint: str


def _socket(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: int, max_bytes: int, heartbeat: Heartbeat, host: str
) -> zmq.Socket[bytes]:
    """A socket with the options both ends share."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    heartbeat.apply(sock)
    return sock


class ControlServer:
    """The producer's ROUTER: `poll_requests()` and `reply()`, no thread of its own."""

    def __init__(
        self,
        host: str = DEFAULT_CONTROL_HOST,
        port: int = DEFAULT_CONTROL_PORT,
        *,
        heartbeat: Heartbeat | None = None,
        max_message_bytes: int = MAX_REQUEST_BYTES,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        on_reject: RejectHook | None = None,
    ) -> None:
        ctx = context if context is not None else zmq.Context.instance()
        self.heartbeat = heartbeat or Heartbeat()
        self.on_reject = on_reject or _quiet
        self.max_message_bytes = max_message_bytes
        sock = _socket(ctx, zmq.ROUTER, 2 * max_message_bytes, self.heartbeat, host)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            sock.bind(tcp_endpoint(host, port))
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._sock: zmq.Socket[bytes] | None = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        # Connections ZMQ closed: a peer gone, or one ZMQ dropped for a frame over
        # ZMQ_MAXMSGSIZE (ZMQ tells the two apart to nobody): counted, logged (S-06).
        self._monitor: zmq.Socket[bytes] | None = sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
        )
        self.dropped = 0
        self.oversized = 0
        self.accepted = 0
        self.disconnects = 0

    def socket_heartbeat(self) -> Heartbeat:
        """Heartbeat options as the ROUTER reports them."""
        return read_heartbeat(self._live())

    def _live(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            raise RuntimeError("control server is closed")
        return self._sock

    def poll_requests(self, max_batch: int = MAX_BATCH) -> list[tuple[bytes, bytes]]:
        """Queued requests as `(peer_identity, payload)`, without blocking (see
        `poll_messages`, which also says each peer's address)."""
        return [(m.identity, m.payload) for m in self.poll_messages(max_batch)]

    def poll_messages(self, max_batch: int = MAX_BATCH) -> list[ControlRequest]:
        """Queued requests, without blocking.

        A message that is not exactly `[identity, b"", payload]`, or whose payload is over
        `max_message_bytes`, is dropped, counted and reported to `on_reject`; the ones
        after it are still read. Frames are read one at a time and those past the third
        are discarded as they come, so no message holds more than three in memory.
        Connections ZMQ closed since the last call are counted and reported too.
        """
        sock = self._live()
        self._poll_monitor()
        out: list[ControlRequest] = []
        seen = 0
        while seen < max_batch:
            try:
                first = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            seen += 1
            frames, extra = [first.bytes], 0
            more = first.more
            while more:
                frame = sock.recv(copy=False)  # the rest of a message is already queued
                more = frame.more
                if len(frames) < _REQUEST_FRAMES:
                    frames.append(frame.bytes)
                else:
                    extra += 1
            problem = _frames_problem(frames, _REQUEST_FRAMES) if not extra else None
            if extra:
                problem = f"{len(frames) + extra} frames, expected {_REQUEST_FRAMES}"
            elif problem is None and len(frames[2]) > self.max_message_bytes:
                self.oversized += 1
                problem = (
                    f"message of {len(frames[2])} bytes over the {self.max_message_bytes}-byte "
                    "cap of a request"
                )
            if problem is not None:
                self.dropped += 1
                self.on_reject(frames[0].hex()[:64], problem)
                continue
            host = _peer_address(first)
            out.append(ControlRequest(frames[0], frames[2], host))
        return out

    def _poll_monitor(self) -> None:
        monitor = self._monitor
        while monitor is not None:
            try:
                msg = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if int(msg["event"]) == zmq.EVENT_ACCEPTED:
                self.accepted += 1
                continue
            self.disconnects += 1
            self.on_reject(
                self.endpoint,
                "a connection was closed (its peer left, or ZMQ dropped a frame over the "
                f"{2 * self.max_message_bytes}-byte socket cap)",
            )

    def wait_readable(self, timeout_ms: int) -> bool:
        """Block up to `timeout_ms` for a request (for callers with no loop of their own)."""
        return bool(self._live().poll(timeout_ms, zmq.POLLIN))

    def reply(self, peer_identity: bytes, payload: bytes) -> bool:
        """Queue `payload` for one peer; False when that peer is gone or its queue is full."""
        sock = self._live()
        try:
            sock.send_multipart([peer_identity, b"", payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH (unknown peer) or EAGAIN (queue full)
            log.debug("control reply to %r not queued: %s", peer_identity, exc)
            return False
        return True

    def close(self) -> None:
        """Close the socket and its monitor. Idempotent."""
        sock, monitor = self._sock, self._monitor
        self._sock = self._monitor = None
        if sock is not None:
            if monitor is not None:
                sock.disable_monitor()
            sock.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)

    def __enter__(self) -> ControlServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ControlClient:
    """A consumer's DEALER to one producer, with heartbeats and a disconnect monitor."""

    def __init__(
        self,
        host: str = DEFAULT_CONTROL_HOST,
        port: int = DEFAULT_CONTROL_PORT,
        *,
        heartbeat: Heartbeat | None = None,
        max_message_bytes: int = MAX_CONTROL_BYTES,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        on_reject: RejectHook | None = None,
    ) -> None:
        if port <= 0:
            raise ValueError(f"cannot connect to port {port}")
        ctx = context if context is not None else zmq.Context.instance()
        self.heartbeat = heartbeat or Heartbeat()
        self.on_reject = on_reject or _quiet
        self.dropped = 0
        self.endpoint = tcp_endpoint(host, port)
        sock = _socket(ctx, zmq.DEALER, max_message_bytes, self.heartbeat, host)
        self._monitor: zmq.Socket[bytes] | None = sock.get_monitor_socket(_WATCHED)
        sock.connect(self.endpoint)
        self._sock: zmq.Socket[bytes] | None = sock
        self.connected = False
        self.disconnects = 0

    def socket_heartbeat(self) -> Heartbeat:
        """Heartbeat options as the DEALER reports them."""
        return read_heartbeat(self._live())

    def _live(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            raise RuntimeError("control client is closed")
        return self._sock

    def send(self, payload: bytes) -> bool:
        """Queue one request; False when the send queue is full (nothing is sent)."""
        try:
            self._live().send_multipart([b"", payload], zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def poll_replies(self, max_batch: int = MAX_BATCH) -> list[bytes]:
        """Replies that have arrived, without blocking. A message that is not exactly
        `[b"", payload]` is dropped, counted and reported to `on_reject`."""
        sock = self._live()
        out: list[bytes] = []
        seen = 0
        while seen < max_batch:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            seen += 1
            problem = _frames_problem(frames, 2)
            if problem is not None:
                self.dropped += 1
                self.on_reject(self.endpoint, problem)
                continue
            out.append(frames[1])
        return out

    def wait_readable(self, timeout_ms: int) -> bool:
        """Block up to `timeout_ms` for a reply or a monitor event (for callers with no loop)."""
        poller = zmq.Poller()
        poller.register(self._live(), zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        return bool(poller.poll(timeout_ms))

    def poll_events(self) -> list[ControlEvent]:
        """Monitor events since the last call; updates `connected` and `disconnects`."""
        self._live()
        events: list[ControlEvent] = []
        monitor = self._monitor
        while monitor is not None:
            try:
                msg = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind = _EVENT_NAMES.get(int(msg["event"]))
            if kind is None:
                continue
            endpoint = msg["endpoint"]
            text = endpoint.decode() if isinstance(endpoint, bytes) else str(endpoint)
            events.append(ControlEvent(kind, text))
            if kind == "HANDSHAKE_SUCCEEDED":
                self.connected = True
            elif kind in ("DISCONNECTED", "CLOSED"):
                if self.connected:
                    self.disconnects += 1
                self.connected = False
        return events

    @property
    def peer_disconnected(self) -> bool:
        """True once a connection to the peer has been lost (as of the last `poll_events`)."""
        return self.disconnects > 0

    def close(self) -> None:
        """Stop the monitor and close both sockets. Idempotent."""
        sock, monitor = self._sock, self._monitor
        self._sock = self._monitor = None
        if sock is not None:
            if monitor is not None:
                sock.disable_monitor()
            sock.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
