"""Hypothesis strategies that build push-mode wire messages (shared by the wire tests)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    HandshakePayload,
    compatibility_hash,
    encode_handshake,
)
from kvhandoff.protocol.push_wire import (
    PUSH_REG_PREFIX,
    PushRegistration,
    encode_push_reg,
)

PEER = "peer-under-test"


ids = st.text(min_size=1, max_size=40)
hex8 = st.text(alphabet="0123456789abcdef", min_size=8, max_size=8)
ports = st.integers(1, 65535)

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=24), children, max_size=4)
    ),
    max_leaves=24,
)


@st.composite
def registrations(draw: st.DrawFn) -> PushRegistration:
    tp_size = draw(st.integers(1, 64))
    return PushRegistration(
        request_id=draw(ids),
        decode_engine_id=draw(ids),
        decode_host=draw(ids),
        decode_port=draw(ports),
        decode_tp_size=tp_size,
        decode_tp_rank=draw(st.none() | st.integers(0, tp_size - 1)),
        block_ids=tuple(draw(st.lists(st.integers(0, 2**40), max_size=50))),
        remote_engine_id=draw(ids),
        remote_host=draw(ids),
        remote_port=draw(ports),
        remote_tp_size=draw(st.integers(1, 64)),
    )


def valid_hash() -> str:
    return compatibility_hash("0.1.0", "model", "bfloat16", 16)


@st.composite
def handshakes(draw: st.DrawFn) -> HandshakePayload:
    n = draw(st.integers(1, 6))
    tp_size = draw(st.integers(1, 16))
    per_region = st.lists(st.integers(1, 1 << 20), min_size=n, max_size=n)
    members = st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3).map(tuple)
    region_members = draw(st.just(()) | st.lists(members, min_size=n, max_size=n).map(tuple))
    return HandshakePayload(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION,
        engine_id=draw(ids),
        agent_name=draw(ids),
        agent_metadata=draw(st.binary(min_size=1, max_size=64)),
        tp_size=tp_size,
        tp_rank=draw(st.integers(0, tp_size - 1)),
        kv_block_lens=tuple(draw(per_region)),
        num_blocks=tuple(draw(per_region)),
        region_base_addrs=tuple(draw(st.lists(st.integers(0, 1 << 48), min_size=n, max_size=n))),
        physical_blocks_per_logical=draw(st.integers(1, 8)),
        backend=draw(st.sampled_from(["UCX", "GDS", "LIBFABRIC"])),
        compatibility_hash=draw(st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)),
        region_members=region_members,
    )


def sample_registration(**changes: Any) -> PushRegistration:
    base = PushRegistration(
        request_id="cmpl-abc-0-1234abcd",
        decode_engine_id="D",
        decode_host="10.0.0.2",
        decode_port=5600,
        decode_tp_size=2,
        decode_tp_rank=1,
        block_ids=(3, 7, 9),
        remote_engine_id="P",
        remote_host="10.0.0.1",
        remote_port=5601,
        remote_tp_size=1,
    )
    return msgspec.structs.replace(base, **changes)


def sample_handshake(**changes: Any) -> HandshakePayload:
    base = HandshakePayload(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION,
        engine_id="engine-D",
        agent_name="agent-D-0",
        agent_metadata=b"nixl-metadata",
        tp_size=2,
        tp_rank=0,
        kv_block_lens=(4096, 4096),
        num_blocks=(100, 80),
        region_base_addrs=(0x1000, 0x900000),
        physical_blocks_per_logical=2,
        backend="UCX",
        compatibility_hash=valid_hash(),
        region_members=(("layers.0",), ("layers.1", "layers.2")),
    )
    return msgspec.structs.replace(base, **changes)


def handshake_maps(
    payload: HandshakePayload | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The outer map and the agent metadata map of a payload's wire form (C-01)."""
    outer: dict[str, Any] = msgspec.msgpack.decode(encode_handshake(payload or sample_handshake()))
    agent: dict[str, Any] = msgspec.msgpack.decode(outer["agent_metadata_bytes"])
    return outer, agent


def handshake_bytes(payload: HandshakePayload | None = None, **changes: Any) -> bytes:
    """Wire bytes from (possibly edited) maps; `changes` edit the agent map, except the
    keys `extras` (merged into the `kvhandoff` map) and `outer` (merged into the outer)."""
    outer, agent = handshake_maps(payload)
    if "extras" in changes:
        outer["kvhandoff"] = {**outer["kvhandoff"], **changes.pop("extras")}
    agent.update(changes.pop("agent", {}))
    outer_changes = changes.pop("outer", {})
    agent.update(changes)
    outer["agent_metadata_bytes"] = msgspec.msgpack.encode(agent)
    outer.update(outer_changes)
    return msgspec.msgpack.encode(outer)


def raw_reg_dict(**changes: Any) -> dict[str, Any]:
    """The wire map of the sample registration (vLLM 0.33's keys, C-01), edited."""
    body = encode_push_reg(sample_registration())[len(PUSH_REG_PREFIX) :]
    raw: dict[str, Any] = msgspec.msgpack.decode(body)
    raw.update(changes)
    return raw


def push_reg_bytes(raw: Any) -> bytes:
    return PUSH_REG_PREFIX + msgspec.msgpack.encode(raw)


# -- side-channel requests (C-01, S-01) -------------------------------------------------

GET_META_MSG = b"get_meta_msg"


def _not_the_valid_request(frames: list[bytes]) -> bool:
    """True unless `frames` happen to be the one request the server under test answers."""
    if len(frames) != 2 or frames[0] != b"":
        return True
    try:
        value = msgspec.msgpack.decode(frames[1])
    except msgspec.DecodeError:
        return True
    return not (
        isinstance(value, list)
        and len(value) == 3
        and value[0] == GET_META_MSG
        and type(value[1]) is int
        and type(value[2]) is int
        and (value[1], value[2]) == (0, 0)
    )


_ranks = st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=4) | st.none()
_verbs = st.sampled_from([GET_META_MSG, b"GET_META", b"get_meta", b""]) | st.binary(max_size=16)

hostile_side_channel_requests = st.one_of(
    # garbage frames, any count (what a DEALER sends; the ROUTER adds the identity)
    st.lists(st.binary(max_size=64), min_size=1, max_size=5),
    # kvhandoff's old dialect, with and without the REQ delimiter
    st.sampled_from([[b"GET_META"], [b"", b"GET_META"]]),
    # a msgpack value of any shape after the delimiter
    msgpack_values.map(lambda v: [b"", msgspec.msgpack.encode(v)]),
    # the right shape, wrong verb or ranks (a rank the engine lacks included)
    st.tuples(_verbs, _ranks, _ranks).map(lambda t: [b"", msgspec.msgpack.encode(list(t))]),
    st.integers(1, 3).map(lambda tp: [b"", msgspec.msgpack.encode([GET_META_MSG, 0, tp])]),
    # nesting deeper than any decoder should recurse
    st.integers(2, 900).map(lambda depth: [b"", b"\x91" * depth + b"\xc0"]),
    # a valid request in the wrong envelope
    st.sampled_from(
        [
            [msgspec.msgpack.encode([GET_META_MSG, 0, 0])],
            [b"x", msgspec.msgpack.encode([GET_META_MSG, 0, 0])],
            [b"", msgspec.msgpack.encode([GET_META_MSG, 0, 0]), b""],
        ]
    ),
).filter(_not_the_valid_request)
"""Side-channel messages (DEALER frames) that a server serving only rank (0, 0) must drop."""
