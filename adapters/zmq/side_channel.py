"""The ZMQ side channel that hands out NIXL agent metadata (R-P15).

A `SideChannelServer` binds a ROUTER at `tcp://host:port` and answers every request frame
`b"GET_META"` with the bytes its `payload_provider` returns at that moment (so metadata
registered later is included): for push mode, the engine's `EngineHandshake`, every
rank's payload, served by the engine's scheduler side. It runs on one daemon thread that
owns the ROUTER; `close()` wakes that thread through an inproc PAIR socket and joins it,
so shutdown is deterministic. Oversized, malformed or unknown requests are dropped without
an answer, counted and logged rate-limited (`rejections`, S-06); no input, and no error
while answering one, stops the thread (S-01).

`fetch_handshake(host, port, timeout_s)` is the client: one DEALER, one request, one reply
or `HandshakeTimeout`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Callable

import zmq

from kvhandoff.adapters.clock import real_clock
from kvhandoff.machines.runtime.rejections import RejectionLog
from kvhandoff.protocol.errors import KvHandoffError, RemoteProtocolError

__all__ = [
    "GET_META",
    "HandshakeTimeout",
    "SideChannelServer",
    "fetch_handshake",
    "tcp_endpoint",
]

log = logging.getLogger(__name__)

#: The only request the server answers.
GET_META = b"GET_META"
#: Largest request message the server accepts; ZMQ drops a peer that sends more.
MAX_REQUEST_BYTES = 1024
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
    """ROUTER on a daemon thread answering `GET_META` with `payload_provider()`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        payload_provider: Callable[[], bytes] | None = None,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
        poll_ms: int = 1000,
    ) -> None:
        if payload_provider is None:
            raise ValueError("SideChannelServer needs a payload_provider")
        self._provider = payload_provider
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
        if ":" in host:
            router.setsockopt(zmq.IPV6, 1)
        try:
            router.bind(tcp_endpoint(host, port))
        except zmq.ZMQError:
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
            target=self._serve, args=(router, wake), name=f"side-channel:{self.port}", daemon=True
        )
        self._thread.start()

    def _serve(self, router: zmq.Socket[bytes], wake: zmq.Socket[bytes]) -> None:
        """Thread body: answer requests until the stop socket speaks."""
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                try:
                    ready = dict(poller.poll(self._poll_ms))
                    if wake in ready:
                        return
                    if router in ready:
                        self._drain(router)
                except zmq.ContextTerminated:
                    return
                except Exception:  # no request, and no bug answering one, stops the thread
                    self.errors += 1
                    log.exception("side channel on port %d: error while serving", self.port)
        finally:
            router.close(linger=0)
            wake.close(linger=0)

    def _drain(self, router: zmq.Socket[bytes]) -> None:
        """Answer every queued request without blocking."""
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply = self._answer(frames)
            if reply is None:
                self.requests_dropped += 1
                peer = frames[0].hex()[:32] if frames else None
                self.rejections.reject(peer, "malformed or unknown request", real_clock())
                continue
            # Counted before the send: a peer that got its reply may read the counter.
            self.requests_served += 1
            try:
                router.send_multipart(reply, zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # peer gone or its queue full: it will time out
                self.requests_served -= 1
                self.requests_dropped += 1
                log.debug("side channel reply dropped: %s", exc)

    def _answer(self, frames: list[bytes]) -> list[bytes] | None:
        """Reply frames for one request, or None to ignore it.

        Accepted shapes: `[identity, GET_META]` (DEALER) and `[identity, b"", GET_META]`
        (REQ); the reply keeps the envelope so both clients read it.
        """
        if len(frames) not in (2, 3) or frames[-1] != GET_META:
            return None
        envelope = frames[1:-1]
        if envelope and envelope != [b""]:
            return None
        try:
            payload = self._provider()
        except Exception:
            log.exception("side channel payload provider failed")
            return None
        return [frames[0], *envelope, bytes(payload)]

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


def fetch_handshake(
    host: str,
    port: int,
    timeout_s: float,
    *,
    max_reply_bytes: int = MAX_REPLY_BYTES,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
) -> bytes:
    """Ask the side channel at `host:port` for its payload.

    Raises `HandshakeTimeout` when no reply arrives within `timeout_s` (connection refused
    counts: ZMQ keeps retrying until the deadline), `RemoteProtocolError` for a reply that
    is not one frame.
    """
    if port <= 0:
        raise ValueError(f"cannot fetch from port {port}")
    endpoint = tcp_endpoint(host, port)
    ctx = context if context is not None else zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_reply_bytes)
        if ":" in host:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        sock.send(GET_META)
        if not sock.poll(max(0, int(timeout_s * 1000)), zmq.POLLIN):
            raise HandshakeTimeout(endpoint, timeout_s)
        frames = sock.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 1:
            raise RemoteProtocolError(
                f"side-channel reply has {len(frames)} frames, expected 1", peer=endpoint
            )
        return frames[0]
    finally:
        sock.close(linger=0)
