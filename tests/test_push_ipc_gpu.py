"""The same-host CUDA IPC push path on a GPU (issue 18): P in this process, D in a child
process on the same GPU (`helpers/ipc_holder.py`).

- bytes verified: two requests queued, ONE kernel launch, each completion notif sent only
  after the launch's event fired, D finds exactly the written blocks changed;
- D killed while P holds its handles: the queued request fails cleanly, P unmaps, its
  CUDA context keeps working and its next WRITE goes to NIXL;
- the whole push path through `kvhandoff bench push --transport cuda_ipc` (NIXL for
  handshake and notifs), bytes verified, path reported.

Skipped, with the reason printed, without CUDA, cuda-python or Triton.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from ipc_stub import StubNixl

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip(
        "CUDA is not available here: the IPC push test runs on a GPU", allow_module_level=True
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
BLOCKS, WORDS = 16, 512


def _pattern(region: int, block: int) -> torch.Tensor:
    base = (region << 24) + (block << 12)
    return torch.arange(WORDS, dtype=torch.int64, device="cuda") + base


class _Holder:
    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HOLDER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        assert self.proc.stdout is not None
        self.export = bytes.fromhex(self.proc.stdout.readline().strip())

    def verify(self, pairs: list[tuple[int, int]]) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"verify {json.dumps(pairs)}\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def holder() -> _Holder:
    h = _Holder()
    yield h  # type: ignore[misc]
    if h.proc.poll() is None:
        h.kill()


def _local() -> tuple[list[torch.Tensor], tuple[MemberSlot, ...]]:
    layers = [torch.empty((2, BLOCKS, WORDS), dtype=torch.int64, device="cuda") for _ in (0, 1)]
    regions = [t[kv] for t in layers for kv in (0, 1)]
    for r, region in enumerate(regions):
        for b in range(BLOCKS):
            region[b].copy_(_pattern(r, b))
    torch.cuda.synchronize()
    slots = tuple(
        MemberSlot(f"layer.{r // 2}.{'kv'[r % 2]}", r // 2, t.data_ptr(), WORDS * 8, BLOCKS)
        for r, t in enumerate(regions)
    )
    return layers, slots


def _wait(ipc: IpcPushTransport, handles: list[IpcHandle]) -> list[str]:
    """Act as P's writer thread: end the pass (launch what is queued), then complete
    launches until every handle's outcome is published."""
    ipc.flush_writes()
    for _ in range(100_000):
        ipc.complete_writes(ipc.clock())
        states = [ipc.poll(h) for h in handles]
        if "PROC" not in states:
            return states
        torch.cuda.synchronize()
    return states


KERNELS = pytest.mark.parametrize("kernel", ["cuda_core", "triton"])


@KERNELS
def test_ipc_write_bytes_verified_then_d_killed(holder: _Holder, kernel: str) -> None:
    layers, slots = _local()
    stub = StubNixl(slots=slots)
    ipc = IpcPushTransport(stub, device=0, kernel=kernel)  # type: ignore[arg-type]
    stub.inbox = [("d-agent", holder.export)]
    assert ipc.get_new_notifs() == []
    first = ipc.write_blocks("D", 0, [0, 1], [9, 10], b"done:r1")
    second = ipc.write_blocks("D", 0, [5], [3], b"done:r2")
    assert isinstance(first, IpcHandle) and isinstance(second, IpcHandle)
    assert stub.sent == []  # queued: nothing launched, no notif yet
    assert _wait(ipc, [first, second]) == ["DONE", "DONE"]
    assert ipc.stats.launches == 1, ipc.stats
    assert ipc.stats.kernel == kernel, ipc.stats
    assert stub.sent == [("D", 0, b"done:r1"), ("D", 0, b"done:r2")]
    assert stub.writes == []
    assert ipc.path("D", 0) == "cuda_ipc"
    assert holder.verify([(0, 9), (1, 10), (5, 3)]) == "ok"

    queued = ipc.write_blocks("D", 0, [2], [4], b"done:r3")
    holder.kill()  # D dies while P holds its handles and a WRITE is queued
    ipc.forget("D")
    assert ipc.poll(queued) == "ERR"
    assert len(stub.sent) == 2  # no notif for the failed request
    assert float(torch.ones(8, device="cuda").sum().item()) == 8.0  # P's CUDA still works
    stub.connected = True  # D is back (a new D would re-export; this one did not)
    after = ipc.write_blocks("D", 0, [2], [4], b"done:r4")
    assert not isinstance(after, IpcHandle)
    assert stub.writes[-1][-1] == b"done:r4"
    assert ipc.path("D", 0) == "nixl"
    del layers


@KERNELS
def test_a_released_queued_write_never_lands(holder: _Holder, kernel: str) -> None:
    layers, slots = _local()
    stub = StubNixl(slots=slots)
    ipc = IpcPushTransport(stub, device=0, kernel=kernel)  # type: ignore[arg-type]
    stub.inbox = [("d-agent", holder.export)]
    ipc.get_new_notifs()
    dropped = ipc.write_blocks("D", 0, [7], [7], b"done:gone")
    kept = ipc.write_blocks("D", 0, [8], [8], b"done:kept")
    ipc.release(dropped)
    assert _wait(ipc, [kept]) == ["DONE"]
    assert stub.sent == [("D", 0, b"done:kept")]
    assert holder.verify([(8, 8)]) == "ok"
    ipc.forget("D")
    del layers


def test_framework_push_over_cuda_ipc_bytes_verified() -> None:
    from kvhandoff.adapters.nixl.loader import load_nixl
    from kvhandoff.bench.push import QUICK, run_push_bench

    try:
        load_nixl()
    except Exception as exc:
        pytest.skip(f"NIXL is not importable here: {exc}")

    cfg = replace(QUICK, device="cuda", ucx_sgl=True, transport="cuda_ipc")
    result = run_push_bench(cfg, print)
    assert result["framework_verified"] is True, result["notes"]
    assert result["baseline_verified"] is True, result["notes"]
    assert result["path"] == "cuda_ipc", result["p_counters"]
    assert result["p_counters"]["ipc_kernel"] == "cuda_core", result["p_counters"]


@KERNELS
def test_many_launches_in_flight_reuse_their_slots(holder: _Holder, kernel: str) -> None:
    """One launch per WRITE (`launch_every=1`), more launches than a pool starts with
    in flight at once: every copy lands, every notif leaves once, in order."""
    layers, slots = _local()
    stub = StubNixl(slots=slots)
    ipc = IpcPushTransport(stub, device=0, kernel=kernel, launch_every=1)  # type: ignore[arg-type]
    stub.inbox = [("d-agent", holder.export)]
    ipc.get_new_notifs()
    pairs = [(b, BLOCKS - 1 - b) for b in range(BLOCKS)]
    handles = [ipc.write_blocks("D", 0, [src], [dst], f"done:{src}".encode()) for src, dst in pairs]
    assert all(isinstance(h, IpcHandle) for h in handles)
    assert _wait(ipc, handles) == ["DONE"] * BLOCKS  # type: ignore[arg-type]
    assert ipc.stats.launches == BLOCKS, ipc.stats
    assert [m for _e, _r, m in stub.sent] == [f"done:{s}".encode() for s, _d in pairs]
    assert holder.verify(pairs) == "ok"
    # A second round reuses the slots the first one gave back.
    again = [ipc.write_blocks("D", 0, [s], [d], b"again") for s, d in pairs[:4]]
    assert _wait(ipc, again) == ["DONE"] * 4  # type: ignore[arg-type]
    assert ipc.stats.launches == BLOCKS + 4, ipc.stats
    assert holder.verify(pairs) == "ok"  # rewritten with the same bytes, nothing else
    ipc.forget("D")
    del layers
