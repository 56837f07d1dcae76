"""`kvhandoff bench push --device cuda --peer-device N` (issue 29, B-12 across the GPUs of
one host): the argument checks and the configuration each side gets, and the NIXL
transport preparing a peer's descriptors on the GPU that peer registered them on. CPU
only: no GPU, no NIXL build."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from kvhandoff.bench.push import QUICK, config_for
from kvhandoff.bench.push_kv import PushBenchConfig, check_peer_device
from kvhandoff.protocol.handshake import HANDSHAKE_PROTOCOL_VERSION, EngineHandshake
from kvhandoff.protocol.member_routing import LocalRegion


def _gpus(n: int) -> Any:
    return lambda: n


def test_B_12_peer_device_goes_to_d_on_cuda() -> None:
    cfg = config_for("cuda", True, "auto", None, 1, device_count=_gpus(2))
    assert (cfg.device, cfg.peer_device, cfg.transport) == ("cuda", 1, "cuda_ipc")
    cfg.check()
    # Without --peer-device, P and D share GPU 0 (today's run, the one-GPU dry run).
    assert config_for("cuda", True, device_count=_gpus(0)).peer_device == 0  # not counted
    assert config_for("cuda", True, "auto", None, 0, device_count=_gpus(1)).peer_device == 0
    assert config_for("cpu", True).peer_device == 0


def test_B_12_peer_device_needs_device_cuda() -> None:
    with pytest.raises(ValueError, match="--peer-device needs --device cuda"):
        config_for("cpu", True, "auto", None, 1)
    with pytest.raises(ValueError, match="--peer-device needs --device cuda"):
        config_for("cpu", True, "auto", None, 0)
    with pytest.raises(ValueError, match="--peer-device needs --device cuda"):
        replace(QUICK, peer_device=1).check()


def test_B_12_peer_device_must_be_a_visible_gpu() -> None:
    with pytest.raises(ValueError, match=r"--peer-device 1: this process sees 1 CUDA GPU \(0..0\)"):
        config_for("cuda", True, "auto", None, 1, device_count=_gpus(1))
    with pytest.raises(ValueError, match=r"sees 2 CUDA GPUs \(0..1\)"):
        check_peer_device(2, 2)
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        check_peer_device(0, 0)
    with pytest.raises(ValueError, match="must not be negative"):
        replace(QUICK, device="cuda", peer_device=-1).check()
    check_peer_device(1, 2)


def test_B_12_cross_device_choice_and_peer_copy_reps_are_checked() -> None:
    with pytest.raises(ValueError, match="ipc_cross_device"):
        replace(QUICK, device="cuda", ipc_cross_device="dma").check()
    with pytest.raises(ValueError, match="peer_copy_reps"):
        replace(QUICK, device="cuda", peer_copy_reps=0).check()
    for choice in ("auto", "kernel", "copy_engine"):
        replace(QUICK, device="cuda", peer_device=1, ipc_cross_device=choice).check()


def test_B_12_cli_refuses_a_peer_device_without_cuda_before_starting_anything() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "bench", "push", "--json", "--peer-device", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode != 0
    assert "--peer-device needs --device cuda" in run.stderr, run.stderr[-2000:]
    assert run.stdout == ""


def test_B_12_the_config_round_trips_to_the_children() -> None:
    """The children rebuild the config from its JSON fields (`push_child.child_main`)."""
    from dataclasses import asdict

    cfg = replace(QUICK, device="cuda", peer_device=3, ipc_cross_device="copy_engine")
    assert PushBenchConfig(**asdict(cfg)) == cfg


# -- NIXL: a peer's descriptors on the GPU it registered them on ----------------------------


@dataclass
class _RecordingAgent:
    """Just what `NixlPushTransport` asks of a NIXL agent while it connects."""

    name: str
    backend: str = "UCX"
    remotes: set[str] = field(default_factory=set)
    registered: list[tuple[int, int, int]] = field(default_factory=list)
    prepped_remote: list[tuple[str, str, int]] = field(default_factory=list)

    def metadata(self) -> bytes:
        return self.name.encode()

    def register_vram(self, addr: int, size: int, device_id: int = 0) -> None:
        self.registered.append((addr, size, device_id))

    def prep_local_blocks(self, rows: Any, mem: str = "DRAM", device_id: int = 0) -> str:
        return f"local:{device_id}"

    def add_remote(self, metadata: bytes) -> str:
        self.remotes.add(metadata.decode())
        return metadata.decode()

    def prep_remote_blocks(
        self, remote_name: str, rows: Any, mem: str = "DRAM", device_id: int = 0
    ) -> Any:
        self.prepped_remote.append((remote_name, mem, device_id))
        from kvhandoff.adapters.nixl.layout import BlockLayout

        return _Prepped(BlockLayout(rows))


@dataclass
class _Prepped:
    layout: Any


def _transport(engine_id: str, device_id: int, is_decoder: bool) -> Any:
    from kvhandoff.adapters.nixl.push_transport import NixlPushTransport

    agent = _RecordingAgent(f"{engine_id}-agent")
    regions = [
        LocalRegion(0x10000 + r * 0x100000, (f"layers.0.{'kv'[r]}",), 4096, 8) for r in (0, 1)
    ]
    return NixlPushTransport(
        engine_id,
        agent,  # type: ignore[arg-type]
        regions,
        compatibility_hash="h",
        is_decoder=is_decoder,
        mem="VRAM",
        device_id=device_id,
    )


def test_B_12_p_prepares_d_descriptors_on_d_gpu() -> None:
    """P on GPU 0, D's KV on GPU 1: P's remote descriptor list names GPU 1 (the GPU D
    registered it on, from D's handshake), its own list GPU 0."""
    prefill, decode = _transport("P", 0, False), _transport("D", 1, True)
    payload = decode.handshake_payload()
    assert payload.device_id == 1
    assert {dev for _a, _s, dev in decode.agent.registered} == {1}
    engine = EngineHandshake(
        protocol_version=HANDSHAKE_PROTOCOL_VERSION, engine_id="D", ranks=(payload,)
    )
    prefill.connect(engine, {0: (1, 1)})
    assert prefill.agent.prepped_remote == [("D-agent", "VRAM", 1)]
    assert prefill._local[1] == "local:0"
