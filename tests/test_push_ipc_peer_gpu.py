"""The CUDA IPC push across two GPUs of one host (issue 29, B-12): P on GPU 0, D's KV on
GPU 1.

- the IPC transport alone (D in a child process, `helpers/ipc_holder.py 1`): WRITEs
  through each cross-device route (`peer_kernel` with either kernel, `copy_engine`),
  bytes verified on D's GPU (the written blocks hold P's pattern, the others untouched),
  the route recorded in `stats.routes`;
- the whole push path through `kvhandoff bench push --device cuda --peer-device 1`
  (`run_push_bench`), over CUDA IPC and over NIXL alone: D verifies every pushed word on
  its GPU, the baseline WRITE and the raw peer copy are verified too.

Skipped, with the reason printed, without two CUDA GPUs (with peer access), cuda-python
or Triton (and NIXL for the whole path).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from ipc_stub import StubNixl

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    _seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    pytest.skip(
        f"needs 2 CUDA GPUs: {_seen} visible here (P on GPU 0 pushes into D on GPU 1)",
        allow_module_level=True,
    )
if not torch.cuda.can_device_access_peer(0, 1):
    pytest.skip(
        "needs 2 CUDA GPUs with peer access: GPU 0 cannot reach GPU 1 (NIXL carries it)",
        allow_module_level=True,
    )
for _module, _why in (("cuda.bindings", "cuda-python"), ("triton", "Triton")):
    try:
        __import__(_module)
    except ImportError:
        pytest.skip(
            f"{_why} is not installed: the IPC push path needs kvhandoff[gpu]",
            allow_module_level=True,
        )

from kvhandoff.adapters.cuda.ipc_transport import IpcHandle, IpcPushTransport  # noqa: E402
from kvhandoff.protocol.member_routing import MemberSlot  # noqa: E402

HOLDER = Path(__file__).resolve().parent / "helpers" / "ipc_holder.py"
BLOCKS, WORDS = 16, 512  # as helpers/ipc_holder.py
D_GPU = 1


class _Holder:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HOLDER), str(D_GPU)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        assert self.proc.stdout is not None
        self.export = bytes.fromhex(self.proc.stdout.readline().strip())

    def verify(self, pairs: list[tuple[int, int]]) -> str:
        import json

        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"verify {json.dumps(pairs)}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


@pytest.fixture
def holder() -> Any:
    h = _Holder()
    yield h
    h.close()


def _local() -> tuple[list[Any], tuple[MemberSlot, ...]]:
    """P's two layers of K/V regions on GPU 0, block b of region r holding its pattern."""
    torch.cuda.set_device(0)
    layers = [torch.empty((2, BLOCKS, WORDS), dtype=torch.int64, device="cuda:0") for _ in (0, 1)]
    regions = [t[kv] for t in layers for kv in (0, 1)]
    for r, region in enumerate(regions):
        for b in range(BLOCKS):
            base = (r << 24) + (b << 12)
            region[b].copy_(torch.arange(WORDS, dtype=torch.int64, device="cuda:0") + base)
    torch.cuda.synchronize()
    slots = tuple(
        MemberSlot(f"layer.{r // 2}.{'kv'[r % 2]}", r // 2, t.data_ptr(), WORDS * 8, BLOCKS)
        for r, t in enumerate(regions)
    )
    return layers, slots


def _wait(ipc: IpcPushTransport, handles: list[IpcHandle]) -> list[str]:
    states: list[str] = []
    for _ in range(100_000):
        states = [ipc.poll(h) for h in handles]
        if "PROC" not in states:
            return states
        torch.cuda.synchronize(0)
    return states


@pytest.mark.parametrize(
    ("kernel", "cross_device", "route", "used"),
    [
        ("cuda_core", "auto", "peer_kernel", "cuda_core"),  # 4 KiB blocks: the kernel
        ("triton", "kernel", "peer_kernel", "triton"),
        ("auto", "copy_engine", "copy_engine", "copy_engine"),
    ],
)
def test_B_12_ipc_write_across_gpus_bytes_verified_on_d_gpu(
    holder: _Holder, kernel: str, cross_device: str, route: str, used: str
) -> None:
    layers, slots = _local()
    stub = StubNixl(slots=slots)
    ipc = IpcPushTransport(
        stub,  # type: ignore[arg-type]
        device=0,
        kernel=kernel,  # type: ignore[arg-type]
        cross_device=cross_device,  # type: ignore[arg-type]
    )
    stub.inbox = [("d-agent", holder.export)]
    assert ipc.get_new_notifs() == []
    # Adjacent on both sides (one copy-engine run) and a lone block.
    first = ipc.write_blocks("D", 0, [0, 1, 2], [9, 10, 11], b"done:r1")
    second = ipc.write_blocks("D", 0, [5], [3], b"done:r2")
    assert isinstance(first, IpcHandle) and isinstance(second, IpcHandle), ipc.stats
    assert _wait(ipc, [first, second]) == ["DONE", "DONE"]
    assert ipc.stats.routes == {"D/0": route}, ipc.stats
    assert ipc.stats.kernel == used, ipc.stats
    assert ipc.stats.launches == 1, ipc.stats
    assert stub.sent == [("D", 0, b"done:r1"), ("D", 0, b"done:r2")]
    assert stub.writes == []  # nothing went through NIXL
    assert holder.verify([(0, 9), (1, 10), (2, 11), (5, 3)]) == "ok"
    ipc.forget("D")
    assert float(torch.ones(8, device="cuda:0").sum().item()) == 8.0  # P's CUDA still works
    del layers


def _bench(**changes: Any) -> dict[str, Any]:
    from kvhandoff.adapters.nixl.loader import load_nixl
    from kvhandoff.bench.push import QUICK, run_push_bench

    try:
        load_nixl()
    except Exception as exc:
        pytest.skip(f"NIXL is not importable here: {exc}")
    cfg = replace(QUICK, device="cuda", ucx_sgl=True, peer_device=D_GPU, **changes)
    result = run_push_bench(cfg, print)
    assert result["peer_device"] == D_GPU
    assert result["framework_verified"] is True, result["notes"]  # D checked on GPU 1
    assert result["baseline_verified"] is True, result["notes"]
    assert result["peer_copy_verified"] is True, result["notes"]
    assert result["peer_copy_p2p"] is True, result
    assert result["peer_copy_gbps"] > 0 and result["ratio_vs_peer_copy"] > 0, result
    return result


@pytest.mark.parametrize(
    ("cross_device", "route"), [("auto", "peer_kernel"), ("copy_engine", "copy_engine")]
)
def test_B_12_framework_push_across_gpus_over_cuda_ipc_bytes_verified(
    cross_device: str, route: str
) -> None:
    result = _bench(transport="cuda_ipc", ipc_cross_device=cross_device)
    assert result["path"] == "cuda_ipc", result["p_counters"]
    assert result["route"] == route, result["p_counters"]


def test_B_12_framework_push_across_gpus_over_nixl_bytes_verified() -> None:
    """NIXL's VRAM WRITE between the two GPUs (the fallback route): P prepares D's
    descriptors on GPU 1."""
    result = _bench(transport="nixl", raw_per_request=True)
    assert result["path"] == "nixl"
    assert result["route"] is None
    assert result["raw_per_request_verified"] is True, result["notes"]
