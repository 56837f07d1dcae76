"""No input on an encoder-cache control socket stops its listener (issue 16 item 3; S-01,
S-06): the producer's ROUTER and a consumer's DEALER, each a real `ECSide` over real ZMQ
and NIXL, are sent hostile multipart messages built by Hypothesis (a wrong frame count,
a missing or non-empty delimiter, garbage, kvhandoff's earlier `kind` dialect, deep
nesting, a megabyte of junk) and each must answer or drop it with a counted rejection,
then serve the next valid message (the producer's from another peer: ZMQ drops a peer
whose frame is over the socket cap, and what that peer sent after it). Framing and
messages are vLLM 0.33.0's (C-03).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq
from ec_hostile_strategies import hostile_ec_message, nested
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.adapters.zmq.control import MAX_REQUEST_BYTES, ControlClient, ControlServer
from kvhandoff.machines.ec.meta import ECRequestInfo
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.ec_status import XferStatus, compatibility_hash
from kvhandoff.protocol.ec_wire import (
    XferAck,
    XferReq,
    decode_xfer_ack,
    encode_xfer_ack,
    encode_xfer_req,
)

HIDDEN, DTYPE_SIZE, BLOCKS = 16, 4, 32
BLOCK = HIDDEN * DTYPE_SIZE
COMPAT = compatibility_hash("0.33.0", "hostile-model", "float32", BLOCK)
_serial = itertools.count()


def side(role: str, **extra: Any) -> ECSide:
    config = ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role=role,  # type: ignore[arg-type]
        ec_connector_extra_config={"ec_cpu_bytes": BLOCKS * BLOCK, "ec_enable_nixl": True, **extra},
        engine_id=f"hostile-{role}-{time.monotonic_ns()}",
    )
    listen = ("127.0.0.1", 0) if role == "ec_producer" else None
    return ECSide(
        config, ECLayout(HIDDEN, DTYPE_SIZE, BLOCKS * BLOCK), compat_hash=COMPAT, listen=listen
    )


def until(step: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not step():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.0005)


# -- hostile multipart messages --------------------------------------------------------------

_payloads = st.one_of(
    hostile_ec_message(),
    st.binary(max_size=64),
    st.builds(lambda d: nested(d, "mixed"), st.integers(9, 5000)),
    st.just(
        msgspec.msgpack.encode(
            {"kind": "XferReq", "version": 1, "transfer_id": "t", "mm_hash": "m"}
        )
    ),
    st.just(b"\x00" * (MAX_REQUEST_BYTES + 1)),  # over the request cap, under the socket's
)


@st.composite
def hostile_frames(draw: st.DrawFn) -> list[bytes]:
    """What a hostile peer sends after its identity: any frame shape, any payload."""
    payload = draw(_payloads)
    shape = draw(st.sampled_from(["bare", "delimited", "bad_delimiter", "extra", "only_empty"]))
    if shape == "bare":
        return [payload]
    if shape == "delimited":
        return [b"", payload]
    if shape == "bad_delimiter":
        return [draw(st.binary(min_size=1, max_size=8)), payload]
    if shape == "extra":
        return [b"", payload, *draw(st.lists(st.binary(max_size=16), min_size=1, max_size=3))]
    return [b""]


# -- the producer's ROUTER -------------------------------------------------------------------


@pytest.fixture(scope="module")
def producer() -> Iterator[tuple[ECSide, zmq.Socket[bytes]]]:
    with side("ec_producer") as prod:
        ctx = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{prod.publish_port}")
        try:
            yield prod, dealer
        finally:
            dealer.close(linger=0)


def _replies(dealer: zmq.Socket[bytes]) -> list[list[bytes]]:
    out = []
    while dealer.poll(0, zmq.POLLIN):
        out.append(dealer.recv_multipart())
    return out


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=hostile_frames())
def test_S_01_producer_router_survives_any_frames_then_serves(
    producer: tuple[ECSide, zmq.Socket[bytes]], frames: list[bytes]
) -> None:
    prod, dealer = producer
    before = prod.rejected
    answered_before = sum(prod.acks_sent.values())
    dealer.send_multipart(frames)
    probe = f"probe-{next(_serial)}"
    # A stock vLLM consumer's request, framed as vLLM frames it: answered NACK_MISSING.
    # It comes from a peer of its own: a hostile frame over the socket cap makes ZMQ drop
    # the hostile peer's connection, and with it whatever that peer sent next (found by a
    # clean-clone CI run; a real consumer's retry would go out on the reconnected socket).
    polite = zmq.Context.instance().socket(zmq.DEALER)
    polite.setsockopt(zmq.LINGER, 0)
    polite.connect(f"tcp://127.0.0.1:{prod.publish_port}")
    polite.send_multipart([b"", encode_xfer_req(XferReq(probe, COMPAT, "session-x"))])
    got: list[XferAck] = []

    def answered() -> bool:
        prod.poll()
        _replies(dealer)  # what the hostile peer is told is not the probe's business
        for reply in _replies(polite):
            assert len(reply) == 2 and reply[0] == b"", "replies are vLLM-framed"
            ack = decode_xfer_ack(reply[1])
            if ack.mm_hash == probe:
                got.append(ack)
        return bool(got)

    try:
        until(answered, "the probe to be answered")
    finally:
        polite.close(linger=0)
    assert got[0].status is XferStatus.NACK_MISSING
    hostile_answered = sum(prod.acks_sent.values()) - answered_before - 1
    assert prod.rejected - before + hostile_answered >= 1, "answered or counted, never silent"


def test_S_01_producer_router_survives_a_message_over_the_socket_cap(
    producer: tuple[ECSide, zmq.Socket[bytes]],
) -> None:
    prod, _ = producer
    ctx = zmq.Context.instance()
    rude = ctx.socket(zmq.DEALER)
    rude.setsockopt(zmq.LINGER, 0)
    rude.connect(f"tcp://127.0.0.1:{prod.publish_port}")
    rude.send_multipart([b"", b"\xc1" * (17 << 20)])  # ZMQ drops this peer's connection
    rude.close(linger=0)
    polite = ControlClient("127.0.0.1", prod.publish_port)
    try:
        assert polite.send(encode_xfer_req(XferReq("probe-big", COMPAT, "s")))
        replies: list[bytes] = []

        def answered() -> bool:
            prod.poll()
            replies.extend(polite.poll_replies())
            return bool(replies)

        until(answered, "a request after an oversized one")
        assert decode_xfer_ack(replies[0]).status is XferStatus.NACK_MISSING
    finally:
        polite.close()


# -- a consumer's DEALER -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def consumer() -> Iterator[tuple[ECSide, ControlServer]]:
    with side("ec_consumer", consumer_ack_timeout_s=30.0) as cons:
        hostile = ControlServer("127.0.0.1", 0)
        try:
            yield cons, hostile
        finally:
            hostile.close()


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(frames=hostile_frames())
def test_S_01_consumer_dealer_survives_any_frames_then_serves(
    consumer: tuple[ECSide, ControlServer], frames: list[bytes]
) -> None:
    cons, hostile = consumer
    sock = hostile._live()
    mm_hash = f"img-{next(_serial)}"
    params = {
        mm_hash: {
            "metadata": {"grid": [1, 2, 2]},
            "peer_host": "127.0.0.1",
            "peer_port": hostile.port,
            "size_bytes": 2 * BLOCK,
        }
    }
    info = ECRequestInfo(f"r-{mm_hash}", (mm_hash,), ec_transfer_params=params, mm_tokens=(2,))
    sched = cons.scheduler
    assert not sched.ensure_cache_available(info, 0, cons.clock())
    asked: list[tuple[bytes, bytes]] = []

    def requested() -> bool:
        cons.poll()
        asked.extend(hostile.poll_requests())
        return bool(asked)

    until(requested, "the consumer's XferReq")
    identity, _ = asked[-1]
    before = cons.rejected
    sock.send_multipart([identity, *frames])
    # The producer's real answer, as a stock vLLM producer frames and encodes a NACK.
    sock.send_multipart([identity, b"", encode_xfer_ack(XferAck(mm_hash, XferStatus.NACK_MISSING))])

    def settled() -> bool:
        cons.poll()
        return sched.ensure_cache_available(info, 0, cons.clock())

    until(settled, "the read to settle")
    assert sched.local_reason(info.request_id, mm_hash) == "NACK_MISSING"
    sched.request_finished(info, cons.clock())
    assert cons.rejected > before, "the hostile message was counted"


def test_R_E07_a_read_in_flight_keeps_the_engine_stepping(
    consumer: tuple[ECSide, ControlServer],
) -> None:
    """While a read awaits its ack the engine must keep stepping (vLLM 0.33 keeps it
    stepping with NIXL on), or its ack and its timeout would never be seen; once it is
    settled and the request finished, nothing holds the engine."""
    cons, producer = consumer
    mm_hash = f"img-pending-{next(_serial)}"
    params = {
        mm_hash: {
            "metadata": {"grid": [1, 2, 2]},
            "peer_host": "127.0.0.1",
            "peer_port": producer.port,
            "size_bytes": 2 * BLOCK,
        }
    }
    info = ECRequestInfo(f"r-{mm_hash}", (mm_hash,), ec_transfer_params=params, mm_tokens=(2,))
    sched = cons.scheduler
    assert not sched.ensure_cache_available(info, 0, cons.clock())
    assert cons.has_pending_push_work(), "a read is in flight"
    asked: list[tuple[bytes, bytes]] = []

    def requested() -> bool:
        cons.poll()
        asked.extend(producer.poll_requests())
        return bool(asked)

    until(requested, "the consumer's XferReq")
    nack = encode_xfer_ack(XferAck(mm_hash, XferStatus.NACK_MISSING))
    producer._live().send_multipart([asked[-1][0], b"", nack])
    until(
        lambda: cons.poll() >= 0 and sched.ensure_cache_available(info, 0, cons.clock()),
        "the read to settle",
    )
    sched.request_finished(info, cons.clock())
    assert not cons.has_pending_push_work(), "settled: nothing holds the engine"
