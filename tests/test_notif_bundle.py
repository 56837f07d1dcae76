"""B-13, notif bundles: the codec against hostile bytes, and the real NIXL transport
bundling a completed batch's notifs toward a peer that advertises ``notif_bundle`` (one
NIXL notif on the wire, the same notifs in the same order after D's transport splits it),
sending them one by one to a peer that does not (a stock vLLM D), and dropping a
malformed bundle without losing the notifs after it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError
from kvhandoff.protocol.handshake import decode_engine_handshake
from kvhandoff.protocol.notif_bundle import (
    EXT_NOTIF_BUNDLE,
    MAX_BUNDLE_BYTES,
    MAX_BUNDLE_NOTIFS,
    NOTIF_BUNDLE_PREFIX,
    decode_notif_bundle,
    encode_notif_bundle,
)

notif_bytes = st.binary(min_size=1, max_size=300).filter(
    lambda b: not b.startswith(NOTIF_BUNDLE_PREFIX)
)


@given(st.lists(notif_bytes, min_size=1, max_size=64))
def test_B_13_a_bundle_carries_its_notifs_in_order(notifs: list[bytes]) -> None:
    (bundle,) = encode_notif_bundle(notifs)
    assert decode_notif_bundle(bundle) == notifs


def test_B_13_the_sender_splits_at_the_caps() -> None:
    many = [b"r%d:1" % i for i in range(MAX_BUNDLE_NOTIFS + 3)]
    bundles = encode_notif_bundle(many)
    assert len(bundles) == 2
    assert [n for b in bundles for n in decode_notif_bundle(b)] == many
    big = [b"x" * (MAX_BUNDLE_BYTES // 3)] * 4
    bundles = encode_notif_bundle(big)
    assert len(bundles) >= 2 and all(len(b) <= MAX_BUNDLE_BYTES for b in bundles)
    assert [n for b in bundles for n in decode_notif_bundle(b)] == big
    with pytest.raises(LocalProtocolError):
        encode_notif_bundle([b"x" * MAX_BUNDLE_BYTES])
    with pytest.raises(LocalProtocolError):
        encode_notif_bundle([NOTIF_BUNDLE_PREFIX + b"\x90"])


# Structured hostile bundles: right prefix, wrong body.
_leaf = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.none(),
)
_values = st.recursive(_leaf, lambda kids: st.lists(kids, max_size=4), max_leaves=20)
_FIXED_BODIES = {
    "too many": lambda: msgspec.msgpack.encode([b"a"] * (MAX_BUNDLE_NOTIFS + 1)),
    "announces 4 G elements": lambda: b"\xdd\xff\xff\xff\xff",
    "nested bundle": lambda: msgspec.msgpack.encode([NOTIF_BUNDLE_PREFIX + b"\x91\xc4\x01x"]),
    "empty": lambda: msgspec.msgpack.encode([]),
    "trailing bytes": lambda: msgspec.msgpack.encode([b"a"]) + b"\x00",
}
hostile_bodies = st.one_of(
    st.binary(max_size=64),  # garbage
    _values.filter(
        lambda v: not (isinstance(v, list) and v and all(type(x) is bytes for x in v))
    ).map(msgspec.msgpack.encode),  # well-formed msgpack of the wrong shape
    st.integers(min_value=17, max_value=5000).map(lambda d: b"\x91" * d + b"\xc4\x01x"),  # deep
    st.sampled_from(sorted(_FIXED_BODIES)).map(lambda name: _FIXED_BODIES[name]()),
)


@settings(max_examples=300)
@given(hostile_bodies)
def test_B_13_S_01_a_hostile_bundle_raises_only_a_remote_protocol_error(body: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_notif_bundle(NOTIF_BUNDLE_PREFIX + body, peer="impostor")


def test_B_13_S_01_an_oversized_bundle_is_refused_unread() -> None:
    huge = NOTIF_BUNDLE_PREFIX + b"\xc6" + (MAX_BUNDLE_BYTES).to_bytes(4, "big")
    with pytest.raises(RemoteProtocolError, match="exceeds"):
        decode_notif_bundle(huge + b"\0" * MAX_BUNDLE_BYTES)


# -- the real transport ------------------------------------------------------------------------


def _nixl_or_skip() -> None:
    try:
        from kvhandoff.adapters.nixl.loader import load_nixl

        load_nixl()
    except Exception as exc:
        pytest.skip(f"no importable nixl build: {exc}")


@pytest.fixture(scope="module")
def sides() -> Iterator[tuple[object, object, object]]:
    """P, a D that speaks B-13 and a D that does not (as a stock vLLM D), connected."""
    _nixl_or_skip()
    from test_push_transport_conformance import MEMBERS_A, MEMBERS_B, ROUTES, NixlSide

    p = NixlSide("engine-p", MEMBERS_A)
    d_bundles = NixlSide("engine-d", MEMBERS_B)
    d_bundles.transport.advertise((), "")  # the transport adds notif_bundle itself
    d_plain = NixlSide("engine-d-plain", MEMBERS_B)
    assert EXT_NOTIF_BUNDLE in d_bundles.transport.handshake_payload().extensions
    assert EXT_NOTIF_BUNDLE not in d_plain.transport.handshake_payload().extensions
    for d in (d_bundles, d_plain):
        raw = p.transport.fetch_handshake(d.host, d.port, 20.0, [(0, 0)])
        p.transport.connect(decode_engine_handshake(raw), ROUTES)
        raw = d.transport.fetch_handshake(p.host, p.port, 20.0, [(0, 0)])
        d.transport.connect(decode_engine_handshake(raw), ROUTES)
    yield p, d_bundles, d_plain
    for side in (p, d_bundles, d_plain):
        side.close()


def _raw_notifs(side: object, count: int) -> list[tuple[str, bytes]]:
    """`count` notifs straight from the side's NIXL agent (not split), within 20 s."""
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 20.0
    while len(got) < count and time.monotonic() < deadline:
        got.extend(side.agent.get_new_notifs())  # type: ignore[attr-defined]
    assert len(got) == count, got
    return got


def _split_notifs(side: object, count: int) -> list[tuple[str, bytes]]:
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + 20.0
    while len(got) < count and time.monotonic() < deadline:
        got.extend(side.transport.get_new_notifs())  # type: ignore[attr-defined]
    assert len(got) == count, got
    return got


def test_B_13_a_batch_toward_a_bundling_d_is_one_notif_on_the_wire(sides: tuple) -> None:
    p, d, _plain = sides
    notifs = [f"req-b15-{i}:1".encode() for i in range(5)]
    handles = [
        p.transport.write_blocks(d.transport.engine_id, 0, [i], [i], n)
        for i, n in enumerate(notifs)
    ]
    assert p.transport.flush_writes() == []
    deadline = time.monotonic() + 20.0
    while "PROC" in [p.transport.poll(h) for h in handles] and time.monotonic() < deadline:
        p.transport.complete_writes(time.monotonic())  # P's writer pass settles the batch
    assert [p.transport.poll(h) for h in handles] == ["DONE"] * 5
    ((sender, wire),) = _raw_notifs(d, 1)
    assert sender == p.agent.name and wire.startswith(NOTIF_BUNDLE_PREFIX)
    assert decode_notif_bundle(wire) == notifs
    for h in handles:
        p.transport.release(h)


def test_B_13_C_04_a_d_without_the_extension_gets_one_notif_each(sides: tuple) -> None:
    p, _d, plain = sides
    notifs = [f"req-plain-{i}:1".encode() for i in range(3)]
    p.transport.send_notifs(plain.transport.engine_id, 0, notifs)
    got = _raw_notifs(plain, 3)
    assert sorted(m for _s, m in got) == sorted(notifs)
    assert not any(m.startswith(NOTIF_BUNDLE_PREFIX) for _s, m in got)


def test_B_13_S_01_d_splits_bundles_and_drops_a_malformed_one(sides: tuple) -> None:
    p, d, _plain = sides
    d_agent = d.transport.handshake_payload().agent_name
    before = d.transport.rejected_bundles
    p.agent.send_notif(d_agent, NOTIF_BUNDLE_PREFIX + b"\x91" * 5000)  # an impostor's
    p.transport.send_notifs(d.transport.engine_id, 0, [b"HB:a", b"HB:b", b"HB:c"])
    got = _split_notifs(d, 3)
    assert [m for _s, m in got] == [b"HB:a", b"HB:b", b"HB:c"]
    assert {s for s, _m in got} == {p.agent.name}
    assert d.transport.rejected_bundles == before + 1


def test_S_06_malformed_bundles_are_counted_and_warned_rate_limited(
    sides: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    """Ten malformed bundles from one agent: each counted, one warning line (each had
    its own before), and the notif after them served."""
    p, d, _plain = sides
    d_agent = d.transport.handshake_payload().agent_name
    before = d.transport.rejected_bundles
    with caplog.at_level(logging.WARNING, logger="kvhandoff"):
        for _ in range(10):
            p.agent.send_notif(d_agent, NOTIF_BUNDLE_PREFIX + b"\x91" * 5000)
        p.agent.send_notif(d_agent, b"HB:after")
        got: list[tuple[str, bytes]] = []
        deadline = time.monotonic() + 20.0
        # NIXL may deliver concurrent notifs in any order: wait for all eleven.
        while (
            not got or d.transport.rejected_bundles < before + 10
        ) and time.monotonic() < deadline:
            got.extend(d.transport.get_new_notifs())
    assert [m for _s, m in got] == [b"HB:after"]
    assert d.transport.rejected_bundles == before + 10
    lines = [r.getMessage() for r in caplog.records if "bundle" in r.getMessage()]
    # at most one (an earlier test's bundle from the same agent may hold this interval's)
    assert len(lines) <= 1, lines
