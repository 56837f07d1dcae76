"""Golden tests of the push wire against vLLM 0.33.0's own code (C-01, C-04): what kvhandoff
encodes, vLLM's real decoders read; what vLLM's structures encode, kvhandoff decodes."""

from __future__ import annotations

from pathlib import Path

from kvhandoff.protocol.vllm_compat import NIXL_CONNECTOR_VERSION, VllmCompatFactors

import vllm_harness

NIXL = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"


def _config(model_dir: Path) -> object:
    return vllm_harness.vllm_config(model_dir, kv_connector="NixlConnector", kv_role="kv_both")


def test_C_01_compat_hash_matches_vllm_for_the_same_inputs(tiny_model_dir: Path) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata

    assert metadata.NIXL_CONNECTOR_VERSION == NIXL_CONNECTOR_VERSION
    config = _config(tiny_model_dir)
    for mode in ("push", "pull"):
        for backend in ("CPU_ATTN", "FLASH_ATTN"):
            ours = VllmCompatFactors.from_vllm_config(config, backend, mode)
            theirs = metadata.compute_nixl_compatibility_hash(config, backend, mode)
            assert ours.compatibility_hash() == theirs
    push = VllmCompatFactors.from_vllm_config(config, "CPU_ATTN", "push")
    pull = VllmCompatFactors.from_vllm_config(config, "CPU_ATTN", "pull")
    assert push.compatibility_hash() != pull.compatibility_hash()
    assert push.block_size == vllm_harness.BLOCK_SIZE
    assert push.kv_cache_layout == "LBHNC"


def test_C_01_compat_hash_from_plain_factors_matches_vllm(tiny_model_dir: Path) -> None:
    """The integration-free constructor: the same numbers typed by hand give the same hash."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import metadata

    config = _config(tiny_model_dir)
    factors = VllmCompatFactors(
        model=str(tiny_model_dir),
        dtype="torch.float32",
        num_kv_heads=2,
        head_size=16,
        num_hidden_layers=2,
        attn_backend_name="CPU_ATTN",
        is_hma_enabled=not config.scheduler_config.disable_hybrid_kv_cache_manager,  # type: ignore[attr-defined]
    )
    theirs = metadata.compute_nixl_compatibility_hash(config, "CPU_ATTN", "push")
    assert factors.compatibility_hash() == theirs


# -- handshake payload ---------------------------------------------------------------------


def _kvhandoff_payload(**changes: object) -> object:
    import msgspec

    from kvhandoff.protocol.handshake import HANDSHAKE_PROTOCOL_VERSION, HandshakePayload

    base = HandshakePayload(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION,
        engine_id="engine-kvh",
        agent_name="agent-kvh-0",
        agent_metadata=b"nixl-agent-metadata",
        tp_size=2,
        tp_rank=1,
        kv_block_lens=(4096, 4096),
        num_blocks=(100, 100),
        region_base_addrs=(0x10000, 0x900000),
        physical_blocks_per_logical=1,
        backend="UCX",
        compatibility_hash="ab" * 32,
        region_members=(("model.layers.0.self_attn.attn",), ("model.layers.1.self_attn.attn",)),
        extensions=("push_fail",),
        block_size=32,
        kv_cache_layout="LBHNC",
        attn_backend_name="CPU_ATTN",
    )
    return msgspec.structs.replace(base, **changes)


def test_C_01_vllm_decodes_a_kvhandoff_handshake() -> None:
    """vLLM's own two-phase decode (payload, then agent metadata) reads what kvhandoff
    serves; the kvhandoff extras are ignored by it (C-04)."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    from kvhandoff.protocol.handshake import encode_handshake

    payload = _kvhandoff_payload()
    data = encode_handshake(payload)  # type: ignore[arg-type]
    outer = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(data)
    assert outer.compatibility_hash == "ab" * 32
    meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(outer.agent_metadata_bytes)
    assert meta.engine_id == "engine-kvh"
    assert meta.agent_metadata == b"nixl-agent-metadata"
    assert meta.kv_caches_base_addr == [0x10000, 0x900000]
    assert meta.block_lens == meta.block_strides == [4096, 4096]
    assert (meta.num_blocks, meta.region_num_blocks) == (100, [100, 100])
    assert (meta.block_size, meta.kv_cache_layout, meta.attn_backend_name) == (
        32,
        "LBHNC",
        "CPU_ATTN",
    )
    assert meta.physical_blocks_per_logical_kv_block == 1
    assert meta.region_members == [
        ["model.layers.0.self_attn.attn"],
        ["model.layers.1.self_attn.attn"],
    ]
    assert (meta.dcp_size, meta.pcp_size, tuple(meta.ssm_sizes)) == (1, 1, (0, 0))


def test_C_01_kvhandoff_decodes_a_stock_vllm_handshake() -> None:
    """What vLLM's worker encodes: no kvhandoff extras, so the rank's coordinates are the
    ones the request named, and it advertises no extension (C-04)."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    from kvhandoff.protocol.handshake import check_compatible, decode_handshake

    meta = NixlAgentMetadata(
        engine_id="engine-vllm",
        agent_metadata=b"vllm-agent",
        kv_caches_base_addr=[0x20000, 0xA00000],
        device_id=0,
        num_blocks=64,
        block_lens=[8192, 8192],
        block_strides=[8192, 8192],
        kv_cache_layout="LBHNC",
        block_size=32,
        ssm_sizes=(0, 0),
        attn_backend_name="CPU_ATTN",
        physical_blocks_per_logical_kv_block=1,
        region_num_blocks=[64, 64],
        region_group_ids=[0, 0],
        region_mem_types=["DRAM", "DRAM"],
    )
    wire = NixlHandshakePayload(
        compatibility_hash="ab" * 32,
        agent_metadata_bytes=msgspec.msgpack.encode(meta),
    )
    payload = decode_handshake(msgspec.msgpack.encode(wire), slot=(1, 0, 1, 0))
    assert (payload.engine_id, payload.agent_metadata) == ("engine-vllm", b"vllm-agent")
    assert payload.region_base_addrs == (0x20000, 0xA00000)
    assert payload.kv_block_lens == (8192, 8192) and payload.num_blocks == (64, 64)
    assert (payload.tp_size, payload.tp_rank) == (1, 0)
    assert not payload.from_kvhandoff and payload.extensions == ()
    check_compatible(_kvhandoff_payload(), payload)  # type: ignore[arg-type]


def test_C_01_vllm_listener_serves_the_kvhandoff_client() -> None:
    """vLLM 0.33's own side-channel listener thread answers kvhandoff's client, rank by
    rank, and keeps listening."""
    import socket
    import threading

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_scheduler import (
        NixlBaseConnectorScheduler,
    )

    from kvhandoff.adapters.zmq.side_channel import fetch_rank_handshakes

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    data = {(0, 0): b"rank-0", (0, 1): b"rank-1"}
    ready, stop = threading.Event(), threading.Event()
    listener = threading.Thread(
        target=NixlBaseConnectorScheduler._nixl_handshake_listener,
        args=(data, ready, stop, "127.0.0.1", port),
        daemon=True,
    )
    listener.start()
    try:
        assert ready.wait(10)
        assert fetch_rank_handshakes("127.0.0.1", port, 5.0, [(0, 0), (0, 1)]) == [
            b"rank-0",
            b"rank-1",
        ]
        assert fetch_rank_handshakes("127.0.0.1", port, 5.0, [(0, 1)]) == [b"rank-1"]
        assert listener.is_alive()
    finally:
        stop.set()
        listener.join(5)


# -- PUSH_REG, heartbeats, ids -------------------------------------------------------------


def _vllm_registration() -> dict[str, object]:
    """The registration dict vLLM 0.33's push scheduler builds (its keys and shapes)."""
    return {
        "request_id": "cmpl-abc-0-1234abcd",
        "decode_engine_id": "engine-vllm-D",
        "decode_host": "127.0.0.1",
        "decode_port": 5600,
        "decode_tp_size": 1,
        "local_block_ids": ([3, 7, 9],),
        "remote_engine_id": "engine-kvh-P",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "remote_tp_size": 1,
        "remote_pp_size": 1,
    }


def test_C_01_kvhandoff_decodes_a_stock_vllm_push_reg() -> None:
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        PUSH_REG_NOTIF_PREFIX,
    )

    from kvhandoff.protocol.push_wire import decode_push_reg

    notif = PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(_vllm_registration())
    reg = decode_push_reg(notif)
    assert reg.block_ids == (3, 7, 9) and reg.decode_tp_rank is None
    assert (reg.decode_engine_id, reg.remote_engine_id) == ("engine-vllm-D", "engine-kvh-P")


def test_C_01_vllm_reads_a_kvhandoff_push_reg() -> None:
    """vLLM's P decodes PUSH_REG as a plain dict and reads these keys."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        PUSH_REG_NOTIF_PREFIX,
    )

    from kvhandoff.protocol.push_wire import PushRegistration, encode_push_reg

    reg = PushRegistration(
        request_id="cmpl-abc-0-1234abcd",
        decode_engine_id="engine-kvh-D",
        decode_host="127.0.0.1",
        decode_port=5600,
        decode_tp_size=2,
        decode_tp_rank=1,
        block_ids=(3, 7, 9),
        remote_engine_id="engine-vllm-P",
        remote_host="127.0.0.1",
        remote_port=5601,
        remote_tp_size=1,
    )
    notif = encode_push_reg(reg)
    assert notif.startswith(PUSH_REG_NOTIF_PREFIX)
    data = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX) :])
    expected = _vllm_registration()
    for key in expected:
        assert key in data, key
    assert data["local_block_ids"] == [[3, 7, 9]]
    assert (data["decode_tp_size"], data["remote_pp_size"]) == (2, 1)


def test_C_01_heartbeat_and_base_ids_agree_with_vllm() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id

    from kvhandoff.protocol.notifs import decode_heartbeat, encode_heartbeat
    from kvhandoff.protocol.request_ids import get_base_request_id as ours

    message = encode_heartbeat(["cmpl-a-0-1234abcd", "cmpl-b-1-DEADBEEF"])
    assert message.decode().startswith("HB:")
    assert message.decode()[3:].split(",") == ["cmpl-a-0-1234abcd", "cmpl-b-1-DEADBEEF"]
    assert decode_heartbeat(b"HB:" + b"p-1,p-2").request_ids == ("p-1", "p-2")
    for rid in ["cmpl-a-0-1234abcd", "cmpl-b-1-DEADBEEF", "cmpl-c-2", "x-1a2b3c4g"]:
        assert ours(rid) == get_base_request_id(rid)


def test_C_01_decode_leg_params_are_what_vllm_reads() -> None:
    """A kvhandoff P's request_finished params carry what vLLM's D reads (`tp_size`,
    `remote_request_id` ...); vLLM's own push params are read by kvhandoff's D."""
    from kvhandoff.protocol.legs import (
        PrefillCoordinates,
        prefill_coordinates,
        push_decode_params,
    )

    here = PrefillCoordinates("engine-kvh-P", "127.0.0.1", 5601, 2, 1, "cmpl-x-0-1234abcd")
    params = push_decode_params(here, [1, 2])
    for key in ("remote_engine_id", "remote_host", "remote_port", "tp_size", "remote_request_id"):
        assert key in params
    vllm_params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2]],
        "remote_engine_id": "engine-vllm-P",
        "remote_request_id": "cmpl-y-0-aaaabbbb",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": 64,
        "transfer_mode": "push",
    }
    coords = prefill_coordinates(vllm_params)
    assert (coords.tp_size, coords.request_id) == (1, "cmpl-y-0-aaaabbbb")
