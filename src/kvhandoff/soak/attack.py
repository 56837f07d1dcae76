"""The attackers of `kvhandoff soak --hostile`: one process, one thread per listener.

Started by the soak as `python -m kvhandoff.soak.attack`, it floods the real roles'
listeners from another loopback address (`--source`, 127.0.0.2 by default: another
host) while the legitimate traffic flows from 127.0.0.1:

- `side_channel`: waves of idle TCP connections to P's push side channel, more per wave
  than its per-host cap, each held until the next wave and then reset;
- `ec_router`: oversized frames to the producer's ROUTER (over the request cap, and over
  the socket's cap, which makes ZMQ drop the connection), and waves of fresh DEALER
  identities, each asking once: for an encoding nobody published, with garbage, or for
  a published one (a grant: the per-host grant cap refuses most of them);
- `nixl`: a NIXL agent of its own that loaded P's agent metadata (any side-channel
  handshake carries it) and the producer's (any OK XferAck carries it) and sends forged
  notifs: PUSH_REGs for requests P never saw (fresh, replayed byte for byte, naming
  another engine), malformed notif bundles, garbage, heartbeats naming unknown ids, and
  at the producer READ notifs naming no grant.

Publications reach it on stdin as the soak relays them (`{"mm_hash", "tokens"}`), after
`go`; `stop` ends it. Its summary says how many of each attack it sent. Events go to
stdout as `@@ <json>` lines, like the roles'.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import secrets
import socket
import struct
import sys
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import zmq

from kvhandoff.adapters.zmq.control import MAX_REQUEST_BYTES, MAX_REQUEST_FRAME_BYTES
from kvhandoff.demo.push_role import emit, rss_mb

SOURCE = "127.0.0.2"
OVERSIZED_BYTES = MAX_REQUEST_BYTES + 100  # over the ROUTER's request cap, under its socket's
SOCKET_OVERSIZED_BYTES = max(1 << 20, 2 * MAX_REQUEST_FRAME_BYTES)  # ZMQ drops the peer
HEARTBEAT_IDS = 50


class Attack:
    """What the threads share: the counts, the stop flag, the published hashes and the
    producer's agent metadata once an OK ack brought it."""

    def __init__(self, source: str, rate: float) -> None:
        self.source = source
        self.rate = rate
        self.sent: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.targets_gone: set[str] = set()
        self.stop = threading.Event()
        self.published: list[str] = []
        self.producer_meta: queue.Queue[bytes] = queue.Queue()
        self._lock = threading.Lock()

    def count(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.sent[kind] += n

    def gone(self, target: str) -> None:
        """`target` stopped listening after it was flooded (its role ended first)."""
        with self._lock:
            self.targets_gone.add(target)

    def error(self, what: str) -> None:
        with self._lock:
            self.errors[what[:80]] += 1

    def pause(self, seconds: float) -> None:
        """The flood's pacing (`--rate` scales it); returns early once stopped."""
        self.stop.wait(seconds / max(self.rate, 0.01))

    def run(self, name: str, body: Callable[[], None]) -> threading.Thread:
        def guarded() -> None:
            try:
                body()
            except Exception as exc:  # one attacker's crash is reported, not fatal
                self.error(f"{name}: {type(exc).__name__}: {exc}")

        thread = threading.Thread(target=guarded, name=f"attack:{name}", daemon=True)
        thread.start()
        return thread


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host or "127.0.0.1", int(port)


# -- the push side channel: idle connections past the per-host cap -----------------------


def side_channel_flood(attack: Attack, host: str, port: int, wave: int) -> None:
    held: list[socket.socket] = []
    while not attack.stop.is_set():
        fresh: list[socket.socket] = []
        for _ in range(wave):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            # Reset on close (no TIME_WAIT): the flood may run for minutes.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            try:
                sock.bind((attack.source, 0))
                sock.connect((host, port))
            except ConnectionRefusedError:
                sock.close()
                if attack.sent["side_channel_idle_connections"] == 0:
                    raise  # never listening: an error of the soak, reported
                # P's listener closed: its role finished and left before `stop` reached us
                # (the soak stops the attacks at the first role's summary).
                attack.gone("side_channel")
                attack.stop.wait()
                break
            except OSError as exc:
                sock.close()
                attack.error(f"side channel connect: {exc}")
                continue
            fresh.append(sock)
        attack.count("side_channel_idle_connections", len(fresh))
        for sock in held:
            sock.close()
        held = fresh
        attack.pause(1.0)
    for sock in held:
        sock.close()


# -- the encoder-cache ROUTER: oversized frames, many identities -------------------------


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], source: str, endpoint: str) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, secrets.token_bytes(16))
    sock.setsockopt(zmq.SNDHWM, 64)
    sock.connect(f"tcp://{source}:0;{endpoint.removeprefix('tcp://')}")
    return sock


def ec_router_flood(attack: Attack, host: str, port: int, wave: int) -> None:
    from kvhandoff.protocol.ec_status import XferStatus, compatibility_hash
    from kvhandoff.protocol.ec_wire import XferReq, decode_xfer_ack, encode_xfer_req
    from kvhandoff.protocol.errors import RemoteProtocolError

    # The demo roles' compatibility hash (`demo.ec_requests.COMPAT`, which imports torch).
    compat = compatibility_hash("kvhandoff-demo", "demo-encoder", "bfloat16", 64 * 2)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    endpoint = f"{host}:{port}"
    big = _dealer(ctx, attack.source, endpoint)
    previous: list[zmq.Socket[bytes]] = []
    tick = 0
    need_meta = True
    try:
        while not attack.stop.is_set():
            tick += 1
            sizes = [OVERSIZED_BYTES] * 4 + ([SOCKET_OVERSIZED_BYTES] if tick % 2 else [])
            for size in sizes:
                try:
                    big.send_multipart([b"", b"\xc1" * size], zmq.NOBLOCK)
                except zmq.Again:
                    continue  # reconnecting after ZMQ dropped us: the next tick sends again
                kind = "socket_cap" if size == SOCKET_OVERSIZED_BYTES else "request_cap"
                attack.count(f"ec_router_oversized_{kind}")
            for sock in previous:  # the last wave's answers, then its identities go
                while sock.poll(0, zmq.POLLIN):
                    frames = sock.recv_multipart()
                    try:
                        ack = decode_xfer_ack(frames[-1])
                    except RemoteProtocolError:
                        continue
                    attack.count(f"ec_router_answered_{ack.status.name}")
                    if need_meta and ack.status is XferStatus.OK:
                        attack.producer_meta.put(ack.producer_agent_metadata)
                        need_meta = False
                sock.close(linger=0)
            previous = []
            for i in range(wave):
                sock = _dealer(ctx, attack.source, endpoint)
                previous.append(sock)
                attack.count("ec_router_identities_opened")
                if i % 4 == 0:
                    sock.send_multipart([b"", b"\x85garbage" + secrets.token_bytes(8)])
                    attack.count("ec_router_malformed")
                    continue
                published = attack.published
                if i % 4 == 1 and published:
                    mm_hash = published[-1 - (i // 4) % min(len(published), 4)]  # still held
                    attack.count("ec_router_grant_requests")
                else:
                    mm_hash = f"never-published-{secrets.token_hex(8)}"
                    attack.count("ec_router_unknown_requests")
                req = XferReq(mm_hash, compat, session_id=secrets.token_hex(16))
                sock.send_multipart([b"", encode_xfer_req(req)])
            attack.pause(0.25)
    finally:
        for sock in [big, *previous]:
            sock.close(linger=0)
        ctx.term()


# -- NIXL notifs: forged at P, READ notifs naming no grant at the producer ---------------


class NixlFoothold:
    """The attacker's NIXL agent with P's agent metadata loaded (through a side-channel
    handshake, as any peer gets it): set up before the attacker says it is ready, so the
    flood starts with the soak and not after a handshake that the other floods slow."""

    def __init__(self, attack: Attack, push_host: str, push_port: int) -> None:
        from kvhandoff.adapters.nixl.agent import NixlAgent
        from kvhandoff.adapters.zmq.side_channel import fetch_handshake
        from kvhandoff.protocol.handshake import decode_handshake

        self.payload = decode_handshake(fetch_handshake(push_host, push_port, 30.0))
        self.agent = NixlAgent(f"soak-attacker-{secrets.token_hex(4)}", progress_thread=False)
        try:
            self.p_agent = _add_remote(attack, self.agent, self.payload.agent_metadata)
        except BaseException:
            self.agent.close()
            raise


def nixl_flood(
    attack: Attack, foothold: NixlFoothold, push_host: str, push_port: int, batch: int
) -> None:
    from kvhandoff.protocol.ec_wire import read_notif
    from kvhandoff.protocol.notif_bundle import NOTIF_BUNDLE_PREFIX
    from kvhandoff.protocol.notifs import encode_heartbeat
    from kvhandoff.protocol.push_wire import PushRegistration, encode_push_reg

    payload, agent, p_agent = foothold.payload, foothold.agent, foothold.p_agent
    try:
        producer: str | None = None

        def push_reg(engine: str) -> bytes:
            reg = PushRegistration(
                request_id=f"cmpl-forged{secrets.token_hex(6)}-0-{secrets.token_hex(4)}",
                decode_engine_id=f"decode-forged-{secrets.randbelow(8)}",
                decode_host=attack.source,
                decode_port=9,
                decode_tp_size=1,
                block_ids=(1, 2, 3, 4),
                remote_engine_id=engine,
                remote_host=push_host,
                remote_port=push_port,
                remote_tp_size=1,
            )
            return encode_push_reg(reg)

        def send(remote: str, kind: str, message: bytes) -> None:
            try:
                agent.send_notif(remote, message)
                attack.count(kind)
            except Exception as exc:  # a refused send is reported; the flood goes on
                attack.error(f"{kind}: {type(exc).__name__}: {exc}")

        while not attack.stop.is_set():
            for _ in range(batch):
                forged = push_reg(payload.engine_id)
                send(p_agent, "push_notif_push_reg_unknown_request", forged)
                send(p_agent, "push_notif_push_reg_replayed", forged)
                send(p_agent, "push_notif_push_reg_other_engine", push_reg("prefill-other"))
                body = b"\x91" * (64 + secrets.randbelow(256))
                send(p_agent, "push_notif_malformed_bundle", NOTIF_BUNDLE_PREFIX + body)
                send(p_agent, "push_notif_garbage", b"\xde\xad" + secrets.token_bytes(16))
                ids = [f"cmpl-unknown{secrets.token_hex(6)}-0" for _ in range(HEARTBEAT_IDS)]
                send(p_agent, "push_notif_heartbeat_unknown_ids", encode_heartbeat(ids))
                if producer is None and not attack.producer_meta.empty():
                    producer = agent.add_remote(attack.producer_meta.get())
                if producer is not None:
                    published = attack.published
                    mm_hash = (
                        published[secrets.randbelow(len(published))]
                        if published
                        else f"never-published-{secrets.token_hex(8)}"
                    )
                    notif = read_notif(secrets.token_hex(16), mm_hash)
                    send(producer, "ec_read_notif_no_grant", notif)
                    send(producer, "ec_read_notif_garbage", b"\xff" + secrets.token_bytes(12))
            agent.get_new_notifs()  # our side of the connections progresses
            attack.pause(0.05)
    finally:
        agent.close()


def _add_remote(attack: Attack, agent: Any, metadata: bytes, attempts: int = 5) -> str:
    """Load P's agent metadata; UCX on a busy host sometimes fails the first load
    (`NIXL_ERR_BACKEND`), so the attacker tries again before it reports the error."""
    from kvhandoff.protocol.errors import KvHandoffError

    for attempt in range(attempts):
        try:
            return str(agent.add_remote(metadata))
        except KvHandoffError:
            if attempt == attempts - 1 or attack.stop.wait(0.2 * (attempt + 1)):
                raise
    raise AssertionError("unreachable")


# -- the process ---------------------------------------------------------------------------


def _read_stdin(attack: Attack, go: threading.Event) -> None:
    """`go`, then publications (`{"mm_hash", "tokens"}`) until `stop` or the end."""
    for line in sys.stdin:
        text = line.strip()
        if text == "go":
            go.set()
        elif text == "stop":
            break
        elif text.startswith("{"):
            try:
                mm_hash = json.loads(text)["mm_hash"]
            except (ValueError, KeyError, TypeError):
                continue
            attack.published = [*attack.published[-255:], str(mm_hash)]
    attack.stop.set()
    go.set()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvhandoff.soak.attack")
    parser.add_argument("--push", required=True, help="HOST:PORT of P's push side channel")
    parser.add_argument("--ec", required=True, help="HOST:PORT of the producer's ROUTER")
    parser.add_argument("--source", default=SOURCE, help="the address attacks come from")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=1.0, help="scales every flood's pace")
    parser.add_argument("--connections", type=int, default=160, help="idle connections a wave")
    parser.add_argument("--identities", type=int, default=16, help="DEALERs a wave")
    parser.add_argument("--notifs", type=int, default=4, help="rounds of forged notifs a batch")
    args = parser.parse_args(argv)
    attack = Attack(args.source, args.rate)
    go = threading.Event()
    threading.Thread(target=_read_stdin, args=(attack, go), daemon=True).start()
    push_host, push_port = _host_port(args.push)
    ec_host, ec_port = _host_port(args.ec)
    foothold: NixlFoothold | None = None
    try:
        foothold = NixlFoothold(attack, push_host, push_port)
    except Exception as exc:  # reported in the summary; the other floods still run
        attack.error(f"nixl: {type(exc).__name__}: {exc}")
    emit("ready", role="attacker", pid=os.getpid())
    go.wait()
    rss_start = rss_mb()
    threads = [
        attack.run(
            "side_channel",
            lambda: side_channel_flood(attack, push_host, push_port, args.connections),
        ),
        attack.run("ec_router", lambda: ec_router_flood(attack, ec_host, ec_port, args.identities)),
    ]
    if foothold is not None:
        held = foothold
        threads.append(
            attack.run("nixl", lambda: nixl_flood(attack, held, push_host, push_port, args.notifs))
        )
    attack.stop.wait(args.seconds)
    attack.stop.set()
    for thread in threads:
        thread.join(30.0)
    emit(
        "summary",
        role="attacker",
        sent=dict(attack.sent),
        errors=dict(attack.errors),
        targets_gone=sorted(attack.targets_gone),
        rss_mb_start=rss_start,
        rss_mb=rss_mb(),
    )
    sys.stdout.flush()
    os._exit(0)  # NIXL and ZMQ were closed by their threads; skip the slow teardown


if __name__ == "__main__":
    main()
