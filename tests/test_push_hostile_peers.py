"""Hostile peers against P's writer core and the push decoders (issue 14, item 4-5).

- S-04: every field of a `PUSH_REG` is checked against this engine before anything is
  held: the engine it names, P's TP and PP sizes, a D TP size that maps onto P's, a D
  rank this P rank writes into, blocks at all, and an agent of a known engine may not
  register for another engine.
- S-03: what one peer, and all peers together, can make a rank hold waiting for blocks is
  capped (registrations per peer, in total, block ids in total); a rejection is clear and
  the capacity comes back when the registrations are matched.
- S-05: with a cluster key only notifs sealed with that key by the agent NIXL names are
  opened; without one, a sealed notif is refused.
- S-01, S-06: structure-aware fuzzing of every push decoder (engine handshakes, sealed
  notifs) and of the writer's notif entry point: only `RemoteProtocolError`, counted,
  never raised out of the writer, nothing held.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from push_harness import D_AGENT, D_ENGINE, P_ENGINE, registration, writer
from push_wire_strategies import (
    PEER,
    handshake_maps,
    handshakes,
    msgpack_values,
    sample_handshake,
)

from kvhandoff.machines.push.events import HandshakeStarted, Heartbeat, Matched, Staged
from kvhandoff.machines.push.match import MATCH
from kvhandoff.machines.push.p_lease import P_LEASE, PLeaseCtx
from kvhandoff.machines.push.writer import PushWriter
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.protocol.auth import AUTH_PREFIX, ClusterKey, NonceSource, ReplayWindow
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    EngineHandshake,
    decode_engine_handshake,
    decode_handshake,
    encode_engine_handshake,
    engine_bundle_parts,
)
from kvhandoff.protocol.nixl_wire import AgentMetadataWire, HandshakeWire, KvhandoffExtras
from kvhandoff.protocol.notifs import (
    encode_completion_notif,
    encode_heartbeat,
    encode_write_failed,
)
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.push_wire import PUSH_REG_PREFIX, PushRegistration, encode_push_reg

KEY_TEXT = "hostile-peer-test-cluster-key"
D_IDENTITY = (D_ENGINE.engine_id, 0)


def _p_writer(config: PushConfig | None = None, rank: int = 0) -> PushWriter:
    return writer("prefill", config or PushConfig(), rank)


def _held(w: PushWriter) -> int:
    return w.bus.live(MATCH)


# -- S-04: PUSH_REG fields against this engine ---------------------------------------------


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"remote_engine_id": "prefill-other"}, "PUSH_REG for engine"),
        ({"remote_tp_size": 2}, "names P as TP 2"),
        ({"remote_pp_size": 2}, "x PP 2"),
        ({"block_ids": ()}, "registers no blocks"),
    ],
)
def test_S_04_push_reg_fields_are_checked_against_this_engine(
    fields: dict[str, Any], expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    w = _p_writer()
    with caplog.at_level(logging.WARNING, logger="kvhandoff.push.writer"):
        reg = registration("cmpl-x-0-aaaa", **fields)
        w.on_notif(D_AGENT, D_IDENTITY, encode_push_reg(reg), 0.0)
    assert w.rejected_notifs == 1
    assert _held(w) == 0 and w.pending_count == 0, "nothing held for a refused PUSH_REG"
    assert expected in caplog.text


def test_S_04_R_T03_a_push_reg_of_a_d_rank_this_p_rank_does_not_write_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """P TP 2 -> D TP 2: P rank 0 writes D rank 0 only."""
    w = _p_writer(PushConfig(tp_size=2), rank=0)
    fields: dict[str, Any] = {"remote_tp_size": 2, "decode_tp_size": 2}
    with caplog.at_level(logging.WARNING, logger="kvhandoff.push.writer"):
        bad = registration("cmpl-x-0-aaaa", decode_tp_rank=1, **fields)
        w.on_notif(D_AGENT, D_IDENTITY, encode_push_reg(bad), 0.0)
    assert w.rejected_notifs == 1 and w.pending_count == 0
    assert "which P rank 0 does not write into" in caplog.text
    good = registration("cmpl-x-0-aaaa", decode_tp_rank=0, **fields)
    w.on_notif(D_AGENT, D_IDENTITY, encode_push_reg(good), 0.0)
    assert w.rejected_notifs == 1 and w.pending_count == 1


def test_S_04_an_agent_of_a_known_engine_may_not_register_for_another_engine() -> None:
    w = _p_writer()
    reg = registration("cmpl-x-0-aaaa", decode_engine_id="decode-victim")
    w.on_notif(D_AGENT, D_IDENTITY, encode_push_reg(reg), 0.0)
    assert w.rejected_notifs == 1 and _held(w) == 0
    # The same registration from an agent of no known engine yet is held (it is checked
    # against D's handshake before any WRITE, S-04, in the rank's writer).
    w.on_notif("agent-unknown", None, encode_push_reg(reg), 0.0)
    assert w.rejected_notifs == 1 and w.pending_count == 1


# -- S-03: caps on what peers can make a rank hold -----------------------------------------


def _reg(i: int, blocks: tuple[int, ...] = (1, 2)) -> bytes:
    return encode_push_reg(registration(f"cmpl-cap{i}-0-aaaa", blocks))


def test_S_03_pending_registrations_are_capped_per_peer() -> None:
    w = _p_writer(PushConfig(max_pending_registrations_per_peer=3))
    for i in range(5):
        w.on_notif(D_AGENT, D_IDENTITY, _reg(i), 0.0)
    assert w.pending_count == 3 and w.rejected_notifs == 2
    assert w.pending_by_peer == {D_AGENT: 3}
    w.on_notif("decode-0-agent2", D_IDENTITY, _reg(9), 0.0)  # another peer still has room
    assert w.pending_count == 4 and w.rejected_notifs == 2


def test_S_03_pending_registrations_are_capped_in_total_and_by_block_ids() -> None:
    w = _p_writer(PushConfig(max_pending_registrations=4, max_pending_block_ids=100))
    for i in range(6):
        w.on_notif(f"decode-0-agent{i}", D_IDENTITY, _reg(i), 0.0)
    assert w.pending_count == 4 and w.rejected_notifs == 2
    w = _p_writer(PushConfig(max_pending_block_ids=100))
    for i in range(3):
        w.on_notif(f"decode-0-agent{i}", D_IDENTITY, _reg(i, tuple(range(40))), 0.0)
    assert w.pending_count == 2 and w.pending_blocks == 80 and w.rejected_notifs == 1


def test_S_03_one_peers_block_ids_are_capped() -> None:
    w = _p_writer(PushConfig(max_pending_block_ids_per_peer=100))
    for i in range(3):
        w.on_notif(D_AGENT, D_IDENTITY, _reg(i, tuple(range(40))), 0.0)
    assert w.pending_blocks_by_peer == {D_AGENT: 80} and w.rejected_notifs == 1
    w.on_notif("decode-0-agent2", D_IDENTITY, _reg(7, tuple(range(40))), 0.0)
    assert w.pending_blocks == 120 and w.rejected_notifs == 1, "another peer has its own"


def test_S_03_a_flood_of_invented_agents_never_refuses_a_connected_d() -> None:
    """Agent names are free: a flood from names of no connected engine fills only its
    half of the total budget (count and block ids); a D this rank is connected to still
    registers, and the flood's share comes back as its registrations expire."""
    config = PushConfig(max_pending_registrations=8, max_pending_block_ids=400)
    w = _p_writer(config)
    for i in range(40):  # 4 ids each, count-bound: 4 fit in the share of 8 // 2
        w.on_notif(f"invented-{i}", None, _reg(i, (1, 2, 3, 4)), 0.0)
    assert (w.unknown_count, w.rejected_notifs) == (4, 36)
    for i in range(4):
        w.on_notif(D_AGENT, D_IDENTITY, _reg(100 + i, tuple(range(40))), 0.0)
    assert w.pending_count == 8 and w.rejected_notifs == 36, "the connected D is never refused"
    w = _p_writer(config)
    for i in range(10):  # 60 ids each, block-bound: 3 fit in the share of 400 // 2
        w.on_notif(f"invented-{i}", None, _reg(i, tuple(range(60))), 0.0)
    assert (w.unknown_count, w.unknown_blocks, w.rejected_notifs) == (3, 180, 7)
    w.on_notif(D_AGENT, D_IDENTITY, _reg(100, tuple(range(200))), 0.0)
    assert w.pending_blocks == 380 and w.rejected_notifs == 7
    w.advance(config.pending_ttl + 1.0)
    assert (w.unknown_count, w.unknown_blocks, w.pending_blocks) == (0, 0, 0)


def test_S_03_the_capacity_comes_back_when_registrations_expire() -> None:
    config = PushConfig(max_pending_registrations_per_peer=2)
    w = _p_writer(config)
    for i in range(2):
        w.on_notif(D_AGENT, D_IDENTITY, _reg(i), 0.0)
    w.on_notif(D_AGENT, D_IDENTITY, _reg(2), 0.0)
    assert (w.pending_count, w.rejected_notifs) == (2, 1)
    w.advance(config.pending_ttl + 1.0)  # the waiting registrations are dropped
    assert w.pending_count == 0 and w.pending_by_peer == {} and w.pending_blocks == 0
    w.on_notif(D_AGENT, D_IDENTITY, _reg(3), config.pending_ttl + 2.0)
    assert w.pending_count == 1 and w.rejected_notifs == 1


# -- S-05: the cluster key -------------------------------------------------------------------


_NONCES = NonceSource(b"testnonc")


def _sealed(key: ClusterKey, sender: str, message: bytes, at: float = 0.0) -> bytes:
    return key.seal(sender, message, nonce=_NONCES.next(), sealed_at=at)


def test_S_05_with_a_key_only_notifs_sealed_by_the_named_agent_are_opened() -> None:
    key = ClusterKey.from_text(KEY_TEXT)
    w = _p_writer(PushConfig(cluster_key=KEY_TEXT))
    plain = _reg(0)
    w.on_notif(D_AGENT, D_IDENTITY, plain, 0.0)
    assert (w.rejected_notifs, w.pending_count) == (1, 0), "a plain notif is refused"
    rogue = ClusterKey.from_text("a-rogue-key-of-its-own-000")
    w.on_notif(D_AGENT, D_IDENTITY, _sealed(rogue, D_AGENT, plain), 0.0)
    assert (w.rejected_notifs, w.pending_count) == (2, 0), "another key is refused"
    w.on_notif("decode-0-spoofer", None, _sealed(key, D_AGENT, plain), 0.0)
    assert (w.rejected_notifs, w.pending_count) == (3, 0), "a seal passed off by another agent"
    w.on_notif(D_AGENT, D_IDENTITY, _sealed(key, D_AGENT, plain), 0.0)
    assert (w.rejected_notifs, w.pending_count) == (3, 1), "the peer's own sealed notif"


def test_S_05_without_a_key_a_sealed_notif_is_refused() -> None:
    w = _p_writer()
    sealed = _sealed(ClusterKey.from_text(KEY_TEXT), D_AGENT, _reg(0))
    w.on_notif(D_AGENT, D_IDENTITY, sealed, 0.0)
    assert (w.rejected_notifs, w.pending_count) == (1, 0)


def test_S_05_a_replayed_sealed_push_reg_is_refused_from_anyone_and_when_stale() -> None:
    """The same sealed bytes a second time, from the true sender or from an agent that
    claims its name later, change nothing; the registration's own retry (sealed anew)
    is taken. Bytes older than the window are refused as stale."""
    key, config = ClusterKey.from_text(KEY_TEXT), PushConfig(cluster_key=KEY_TEXT)
    w = _p_writer(config)
    captured = _sealed(key, D_AGENT, _reg(0), at=10.0)
    w.on_notif(D_AGENT, D_IDENTITY, captured, 10.0)
    assert (w.rejected_notifs, w.pending_count) == (0, 1)
    w.advance(config.pending_ttl + 11.0)  # the registration expired: its base id is free
    assert w.pending_count == 0
    w.on_notif(D_AGENT, D_IDENTITY, captured, 20.0)
    assert (w.rejected_notifs, w.pending_count) == (1, 0), "a replay within the window"
    late = 10.0 + config.sealed_notif_ttl + config.sealed_notif_skew + 1.0
    w.on_notif(D_AGENT, None, captured, late)
    assert (w.rejected_notifs, w.pending_count) == (2, 0), "a replay after the window: stale"
    w.on_notif(D_AGENT, D_IDENTITY, _sealed(key, D_AGENT, _reg(0), at=late), late)
    assert (w.rejected_notifs, w.pending_count) == (2, 1), "sealed anew: a real retry"


def test_S_05_bytes_sealed_before_a_restart_are_refused_by_the_new_process() -> None:
    """A P that restarts (same engine id, same agent name) remembers no nonce, but what
    was sealed before it started is refused, even while it would still be fresh."""
    key, config = ClusterKey.from_text(KEY_TEXT), PushConfig(cluster_key=KEY_TEXT)
    captured = _sealed(key, D_AGENT, _reg(0), at=100.0)
    restarted = PushWriter("prefill", P_ENGINE.engine_id, config, started_at=150.0)
    restarted.on_notif(D_AGENT, D_IDENTITY, captured, 160.0)
    assert (restarted.rejected_notifs, restarted.pending_count) == (1, 0)
    restarted.on_notif(D_AGENT, D_IDENTITY, _sealed(key, D_AGENT, _reg(0), at=155.0), 160.0)
    assert (restarted.rejected_notifs, restarted.pending_count) == (1, 1)


def test_S_03_S_05_the_replay_window_holds_a_bounded_number_of_nonces() -> None:
    window = ReplayWindow(0.0, ttl=10.0, skew=1.0, capacity=4)
    key = ClusterKey.from_text(KEY_TEXT)
    for i in range(10):
        window.admit(key.open(D_AGENT, _sealed(key, D_AGENT, b"m", at=float(i))), float(i))
    assert (len(window), window.evicted) == (4, 6)
    window.admit(key.open(D_AGENT, _sealed(key, D_AGENT, b"m", at=30.0)), 30.0)
    assert len(window) == 1, "stale nonces are forgotten"
    with pytest.raises(RemoteProtocolError, match="future"):
        window.admit(key.open(D_AGENT, _sealed(key, D_AGENT, b"m", at=40.0)), 30.0)


# -- S-01: structure-aware fuzzing of the decoders ----------------------------------------


def _engine(ranks: int = 2) -> EngineHandshake:
    payloads = tuple(
        msgspec.structs.replace(
            sample_handshake(), engine_id="engine-D", tp_rank=r, agent_name=f"agent-D-{r}"
        )
        for r in range(ranks)
    )
    return EngineHandshake(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION, engine_id="engine-D", ranks=payloads
    )


AGENT_FIELDS = [*AgentMetadataWire.__struct_fields__, "extra"]
EXTRA_FIELDS = [*KvhandoffExtras.__struct_fields__, "extra"]


@settings(deadline=None, max_examples=300)
@given(
    where=st.sampled_from(["outer", "agent", "kvhandoff"]),
    field=st.sampled_from(sorted({*HandshakeWire.__struct_fields__, *AGENT_FIELDS, *EXTRA_FIELDS})),
    rank=st.integers(0, 1),
    value=msgpack_values,
    drop=st.booleans(),
)
def test_S_01_decode_engine_handshake_on_mutated_maps_raises_only_remote_errors(
    where: str, field: str, rank: int, value: Any, drop: bool
) -> None:
    """One rank's wire maps (C-01: vLLM's outer map, its agent metadata map, kvhandoff's
    extras) mutated: the engine decodes whole or is refused with a remote error."""
    parts = list(engine_bundle_parts(encode_engine_handshake(_engine())))
    outer, agent = handshake_maps(decode_handshake(parts[rank]))
    target = {"outer": outer, "agent": agent, "kvhandoff": outer["kvhandoff"]}[where]
    if drop:
        target.pop(field, None)
    else:
        target[field] = value
    outer["agent_metadata_bytes"] = msgspec.msgpack.encode(agent)
    parts[rank] = msgspec.msgpack.encode(outer)
    try:
        engine = decode_engine_handshake(parts, peer=PEER, engine_id="engine-D", tp_size=2)
    except RemoteProtocolError as exc:
        assert exc.peer == PEER
    else:
        assert decode_engine_handshake(encode_engine_handshake(engine)) == engine


@settings(deadline=None, max_examples=100)
@given(st.lists(handshakes(), min_size=1, max_size=4))
def test_S_01_engine_handshakes_round_trip_or_are_refused(payloads: list[Any]) -> None:
    engine = EngineHandshake(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION, engine_id="E", ranks=tuple(payloads)
    )
    try:
        data = encode_engine_handshake(engine)
    except Exception as exc:  # a local misuse: refused before it leaves
        assert not isinstance(exc, RemoteProtocolError)
        return
    assert decode_engine_handshake(data) == engine


@settings(deadline=None, max_examples=300)
@given(
    message=st.binary(max_size=64),
    sender=st.text(min_size=1, max_size=40),
    flip=st.integers(0, 10_000),
    xor=st.integers(1, 255),
)
def test_S_01_S_05_sealed_notifs_with_any_byte_changed_never_open_as_something_else(
    message: bytes, sender: str, flip: int, xor: int
) -> None:
    key = ClusterKey.from_text(KEY_TEXT)
    sealed = bytearray(_sealed(key, sender, message))
    sealed[flip % len(sealed)] ^= xor
    try:
        opened = key.open(sender, bytes(sealed))
    except RemoteProtocolError as exc:
        assert exc.peer == sender
    else:
        assert opened.message == message, "a changed frame opened as another message"


@settings(deadline=None, max_examples=200)
@given(body=st.binary(max_size=200) | msgpack_values.map(msgspec.msgpack.encode))
def test_S_01_sealed_notif_frames_of_arbitrary_bytes_raise_only_remote_errors(
    body: bytes,
) -> None:
    with pytest.raises(RemoteProtocolError):
        ClusterKey.from_text(KEY_TEXT).open(PEER, AUTH_PREFIX + body)


_ids = st.text(alphabet="abcdef-0123456789", min_size=1, max_size=30)
_notifs = st.one_of(
    st.builds(lambda raw: PUSH_REG_PREFIX + msgspec.msgpack.encode(raw), msgpack_values),
    st.builds(
        lambda field, value: (
            PUSH_REG_PREFIX
            + msgspec.msgpack.encode(
                {**msgspec.to_builtins(registration("cmpl-f-0-aaaa")), field: value}
            )
        ),
        st.sampled_from(PushRegistration.__struct_fields__),
        msgpack_values,
    ),
    st.builds(encode_heartbeat, st.lists(_ids, min_size=1, max_size=5)),
    st.builds(encode_completion_notif, _ids, st.integers(1, 8)),
    st.builds(encode_write_failed, _ids, st.text(max_size=30)),
    st.binary(max_size=120),
)


@settings(deadline=None, max_examples=300)
@given(
    notifs=st.lists(
        st.tuples(
            st.sampled_from([D_AGENT, "agent-unknown", "prefill-0-agent1"]),
            st.sampled_from([D_IDENTITY, None, (P_ENGINE.engine_id, 0)]),
            _notifs,
        ),
        max_size=8,
    ),
    keyed=st.booleans(),
)
def test_S_01_S_06_the_writer_takes_any_notif_without_raising(
    notifs: list[tuple[str, Any, bytes]], keyed: bool
) -> None:
    w = _p_writer(PushConfig(cluster_key=KEY_TEXT) if keyed else None)
    for sender, identity, data in notifs:
        before = w.rejected_notifs
        w.on_notif(sender, identity, data, 0.0)
        held = w.pending_count
        assert w.rejected_notifs >= before
        assert held <= len(notifs)
    assert w.pending_count == sum(w.pending_by_peer.values())
    assert w.pending_blocks == sum(w.pending_blocks_by_peer.values())
    assert 0 <= w.unknown_count <= w.pending_count and 0 <= w.unknown_blocks <= w.pending_blocks


# -- S-02: heartbeats before P's handshake with D identified D's agents ----------------------


def test_S_02_R_P08_before_the_handshake_only_the_registering_agents_extend_the_lease() -> None:
    """P's lease is bound to D's engine and to the agents whose `PUSH_REG`s matched; while
    P's handshake with D is still under way the heartbeats' senders are not identified
    yet, and only those agents may extend the lease."""
    bus = EventBus()
    bus.register(P_LEASE, PushConfig().machine_config())
    rid = "cmpl-hb-0-0a0a0a0a"
    bus.create(P_LEASE, PLeaseCtx(rid, (1, 2), lease_extension=20.0), 0.0)
    bus.dispatch(P_LEASE, rid, Staged(), 0.0)
    bus.dispatch(P_LEASE, rid, Matched(engine=D_ENGINE.engine_id, agents=(D_AGENT,)), 0.0)
    bus.dispatch(P_LEASE, rid, HandshakeStarted(), 0.0)
    assert bus.deadline_of(P_LEASE, rid) == 30.0
    with pytest.raises(RemoteProtocolError):  # an unidentified agent that never registered
        bus.dispatch(P_LEASE, rid, Heartbeat(None, "decode-0-spoofer"), 15.0)
    with pytest.raises(RemoteProtocolError):  # an identified agent of another engine
        bus.dispatch(P_LEASE, rid, Heartbeat("decode-other", D_AGENT), 15.0)
    assert bus.deadline_of(P_LEASE, rid) == 30.0, "refused heartbeats change nothing"
    bus.dispatch(P_LEASE, rid, Heartbeat(None, D_AGENT), 15.0)
    assert bus.deadline_of(P_LEASE, rid) == 35.0
    bus.dispatch(P_LEASE, rid, Heartbeat(D_ENGINE.engine_id, "decode-0-agent9"), 20.0)
    assert bus.deadline_of(P_LEASE, rid) == 40.0, "any identified agent of the bound engine"
