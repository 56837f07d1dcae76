"""Golden tests of the encoder-cache P2P wire against vLLM 0.33.0's own code (C-03, C-04):
what kvhandoff encodes, vLLM's real decoders read, and what vLLM's structs encode,
kvhandoff decodes; the compatibility hash is vLLM's for the same inputs."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import torch

from kvhandoff.protocol import ec_status, ec_wire
from kvhandoff.protocol.ec_grants import grant_ack, nack
from kvhandoff.protocol.ec_publication import parse_ec_transfer_params

vproto = pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.cpu.protocol")
vutils = pytest.importorskip("vllm.distributed.ec_transfer.ec_connector.cpu.utils")

HASH = vproto.compute_ec_compatibility_hash("0.33.0", "org/model", "torch.bfloat16", 4096)


def test_C_03_version_statuses_and_retryable_nacks_are_vllms() -> None:
    assert ec_status.EC_CONNECTOR_VERSION == vproto.EC_CONNECTOR_VERSION
    ours = {s.name: int(s) for s in ec_status.XferStatus}
    assert ours == {s.name: int(s) for s in vproto.XferStatus}
    assert {s.name for s in ec_status.RETRYABLE_NACKS} == {s.name for s in vproto.RETRYABLE_NACKS}


@pytest.mark.parametrize(
    "inputs",
    [
        ("0.33.0", "org/model", torch.bfloat16, 4096),
        ("0.33.0", "/models/tiny", torch.float16, 128),
        ("1.2.3+cpu", "Qwen/Qwen3-VL-8B", torch.float32, 3 * 4096),
        ("0.33.0", 'we"ird\\ mødel', torch.float8_e4m3fn, 1),
    ],
)
def test_C_03_compat_hash_equals_vllms_for_the_same_inputs(inputs: tuple[Any, ...]) -> None:
    version, model, dtype, block = inputs
    expected = vproto.compute_ec_compatibility_hash(version, model, str(dtype), block)
    assert ec_status.compatibility_hash(version, model, str(dtype), block) == expected
    name = str(dtype).removeprefix("torch.")
    assert ec_status.compatibility_hash(version, model, name, block) == expected


def test_C_03_vllm_decodes_kvhandoff_requests() -> None:
    decoder = msgspec.msgpack.Decoder(vproto.XferReq)
    stock_form = ec_wire.XferReq("mm-1", HASH, "sess-1")
    ours = ec_wire.encode_xfer_req(stock_form)
    theirs = msgspec.msgpack.encode(
        vproto.XferReq(mm_hash="mm-1", compatibility_hash=HASH, session_id="sess-1")
    )
    assert ours == theirs, "byte for byte what vLLM sends"
    full = ec_wire.XferReq(
        "mm-1",
        HASH,
        "sess-1",
        transfer_id="ab" * 16,
        consumer_engine_id="e",
        consumer_agent_name="a",
        num_blocks=3,
        size_bytes=3 * 4096,
        extensions=ec_status.EXTENSIONS,
    )
    req = decoder.decode(ec_wire.encode_xfer_req(full))  # the extras are ignored (C-04)
    assert (req.mm_hash, req.compatibility_hash, req.session_id) == ("mm-1", HASH, "sess-1")
    assert req.connector_version == vproto.EC_CONNECTOR_VERSION


def test_C_03_kvhandoff_decodes_vllm_requests() -> None:
    data = msgspec.msgpack.encode(
        vproto.XferReq(mm_hash="mm-2", compatibility_hash=HASH, session_id="s")
    )
    req = ec_wire.decode_xfer_req(data)
    assert (req.mm_hash, req.compat_hash, req.session_id, req.version) == (
        "mm-2",
        HASH,
        "s",
        ec_status.EC_CONNECTOR_VERSION,
    )
    assert (req.transfer_id, req.num_blocks, req.extensions) == ("", 0, ())
    future = msgspec.msgpack.encode(
        vproto.XferReq(mm_hash="mm-3", compatibility_hash=HASH, session_id="s", connector_version=9)
    )
    assert ec_wire.decode_xfer_req(future).version == 9  # answered NACK_VERSION


def _grant(req: ec_wire.XferReq) -> ec_wire.XferAck:
    return grant_ack(
        req,
        producer_agent_name="agent-p",
        producer_agent_metadata=b"nixl-md",
        block_indices=[5, 1, 2],
        block_size_bytes=4096,
        size_bytes=3 * 4096,
        region_base_addr=0x10000,
        lease_s=30.0,
        mem_descriptor=ec_wire.encode_mem_descriptor(0x10000, 4096, 8),
    )


def test_C_03_vllm_decodes_kvhandoff_acks() -> None:
    decoder = msgspec.msgpack.Decoder(vproto.XferAck)
    ok = decoder.decode(ec_wire.encode_xfer_ack(_grant(ec_wire.XferReq("mm", HASH, "s"))))
    assert ok.status is vproto.XferStatus.OK and ok.session_id == "s"
    assert ok.src_block_indices == [5, 1, 2] and ok.agent_metadata == b"nixl-md"
    assert vutils.deserialize_mem_descriptor(ok.mem_descriptor) == vutils.build_block_descs(
        0x10000, 8, 4096
    )
    for status in ec_status.NACKS:
        answer = decoder.decode(
            ec_wire.encode_xfer_ack(nack(ec_wire.XferReq("mm", HASH, "s"), status))
        )
        assert answer.status is vproto.XferStatus[status.name] and answer.src_block_indices == []


def test_C_03_kvhandoff_decodes_vllm_acks() -> None:
    descs = vutils.serialize_mem_descriptor(vutils.build_block_descs(0x20000, 16, 256))
    data = msgspec.msgpack.encode(
        vproto.XferAck(
            mm_hash="mm",
            status=vproto.XferStatus.OK,
            session_id="s",
            src_block_indices=[3, 4],
            agent_metadata=b"md",
            mem_descriptor=descs,
        )
    )
    ack = ec_wire.decode_xfer_ack(data)
    assert ack.status is ec_status.XferStatus.OK and ack.block_indices == [3, 4]
    assert (ack.region_base_addr, ack.block_size_bytes, ack.lease_s) == (0x20000, 256, 30.0)
    for status in vproto.XferStatus:
        if status is vproto.XferStatus.OK:
            continue
        raw = msgspec.msgpack.encode(vproto.XferAck(mm_hash="mm", status=status))
        assert ec_wire.decode_xfer_ack(raw).status.name == status.name


def test_C_03_vllm_publications_parse_and_ours_carry_vllms_keys() -> None:
    entry = {
        "modality": "image",
        "item_indices": [0, 2],
        "metadata": {},  # a model that declares no placeholder fields
        "peer_host": "10.0.0.1",
        "peer_port": 5601,
        "size_bytes": 3 * 4096,
        "shape": [3, 2048],
    }
    parsed = parse_ec_transfer_params(
        {"mm": entry, "gone": {"modality": "image", "item_indices": [1], "metadata": {}}}
    )
    assert parsed["gone"] is None
    mine = parsed["mm"]
    assert mine is not None and (mine.shape, mine.item_indices) == ((3, 2048), (0, 2))
    assert mine.to_entry() == entry
