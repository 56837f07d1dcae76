"""Hypothesis strategies that build push-mode wire messages (shared by the wire tests)."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from kvhandoff.protocol.handshake import (
    HANDSHAKE_PROTOCOL_VERSION,
    HandshakePayload,
    compatibility_hash,
)
from kvhandoff.protocol.push_wire import (
    PUSH_REG_PREFIX,
    PushRegistration,
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
        decode_tp_rank=draw(st.integers(0, tp_size - 1)),
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


def raw_reg_dict(**changes: Any) -> dict[str, Any]:
    raw: dict[str, Any] = msgspec.to_builtins(sample_registration())
    raw.update(changes)
    return raw


def push_reg_bytes(raw: Any) -> bytes:
    return PUSH_REG_PREFIX + msgspec.msgpack.encode(raw)
