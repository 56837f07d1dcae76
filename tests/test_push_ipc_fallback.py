"""The CUDA IPC push wrapper without a GPU (issue 18): everything goes to NIXL, exports
are taken out of the notif stream, refusals are recorded, and the module imports neither
Triton nor cuda.bindings. Runs on the CPU CI; the GPU side is tests/test_push_ipc_gpu.py."""

from __future__ import annotations

import subprocess
import sys

from ipc_stub import StubNixl

from kvhandoff.adapters.cuda import ipc_runtime
from kvhandoff.adapters.cuda.ipc_export import (
    IPC_EXPORT_PREFIX,
    IPC_EXPORT_VERSION,
    IpcExport,
    IpcRegion,
    decode_export,
    encode_export,
)
from kvhandoff.adapters.cuda.ipc_transport import IpcHandle, IpcPushTransport
from kvhandoff.protocol.handshake import EXT_CUDA_IPC
from kvhandoff.protocol.member_routing import MemberSlot

SLOTS = (MemberSlot("layer.0.k", 0, 1 << 20, 4096, 8), MemberSlot("layer.0.v", 0, 2 << 20, 4096, 8))


def _export(host: str, bus: str = "0000:ff:00.0") -> IpcExport:
    regions = tuple(
        IpcRegion(s.name, 0, i * 32768, s.block_len, s.num_blocks, s.base_addr)
        for i, s in enumerate(SLOTS)
    )
    return IpcExport(IPC_EXPORT_VERSION, host, bus, (b"\x01" * 64,), (65536,), regions)


def _wrapper() -> tuple[StubNixl, IpcPushTransport]:
    stub = StubNixl(slots=SLOTS)
    return stub, IpcPushTransport(stub, device=0)  # type: ignore[arg-type]


def test_export_round_trips() -> None:
    export = _export("host/boot")
    assert decode_export(encode_export(export)) == export


def test_without_an_export_writes_go_to_nixl() -> None:
    stub, ipc = _wrapper()
    handle = ipc.write_blocks("D", 0, [1, 2], [3, 4], b"done")
    assert not isinstance(handle, IpcHandle)
    assert stub.writes == [("D", 0, (1, 2), (3, 4), b"done")]
    assert ipc.path("D", 0) == "nixl"
    assert (ipc.stats.nixl_writes, ipc.stats.ipc_writes) == (1, 0)


def test_exports_leave_the_notif_stream_and_other_notifs_pass() -> None:
    stub, ipc = _wrapper()
    stub.inbox = [("d-agent", encode_export(_export("elsewhere/boot"))), ("d-agent", b"REG")]
    assert ipc.get_new_notifs() == [("d-agent", b"REG")]


def test_an_export_from_another_host_is_refused_and_nixl_is_used() -> None:
    stub, ipc = _wrapper()
    stub.inbox = [("d-agent", encode_export(_export("elsewhere/boot")))]
    ipc.get_new_notifs()
    handle = ipc.write_blocks("D", 0, [1], [2], b"n")
    assert not isinstance(handle, IpcHandle)
    assert len(stub.writes) == 1
    assert "another host" in ipc.stats.refused_peers["D/0"]
    assert ipc.path("D", 0) == "nixl"


def test_an_unusable_export_on_this_host_falls_back_to_nixl() -> None:
    """Without cuda-python (CPU CI) or with a GPU that is not here: refused, NIXL."""
    stub, ipc = _wrapper()
    stub.inbox = [("d-agent", encode_export(_export(ipc_runtime.host_identity())))]
    ipc.get_new_notifs()
    ipc.write_blocks("D", 0, [1], [2], b"n")
    assert len(stub.writes) == 1
    assert "D/0" in ipc.stats.refused_peers
    ipc.forget("D")
    assert stub.forgotten == ["D"]


def test_garbage_after_the_prefix_is_refused_not_raised() -> None:
    stub, ipc = _wrapper()
    stub.inbox = [("d-agent", b"kvhandoff-ipc1:\xc1\xff")]
    assert ipc.get_new_notifs() == []
    ipc.write_blocks("D", 0, [1], [2], b"n")
    assert len(stub.writes) == 1


def test_a_decoder_without_cuda_exports_nothing() -> None:
    stub = StubNixl(slots=SLOTS)
    ipc = IpcPushTransport(stub, device=0, export=not ipc_runtime.available())  # type: ignore[arg-type]
    assert ipc._export is None


def test_C_04_the_export_goes_only_to_a_peer_advertising_cuda_ipc() -> None:
    """A stock vLLM P advertises no ``cuda_ipc``: D's export notif is never sent to it
    (it would be an unknown notif there); a kvhandoff P's wrapper advertises it."""
    for extensions, sent in ((frozenset(), 0), (frozenset({EXT_CUDA_IPC}), 1)):
        stub = StubNixl(slots=SLOTS, peer_extensions=extensions)
        ipc = IpcPushTransport(stub, device=0)  # type: ignore[arg-type]
        ipc._export = encode_export(_export("host/boot"))
        ipc.connect(None, None)  # type: ignore[arg-type]
        assert [m for _e, _r, m in stub.sent if m.startswith(IPC_EXPORT_PREFIX)] == (
            [ipc._export] * sent
        )
    ipc.advertise(["push_fail"], "")
    assert stub.advertised == ("push_fail", EXT_CUDA_IPC)


def test_importing_the_wrapper_imports_no_triton_or_cuda_bindings() -> None:
    code = (
        "import sys; import kvhandoff.adapters.cuda.ipc_transport;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('triton', 'cuda')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_bench_picks_the_ipc_transport_on_cuda_only() -> None:
    import pytest

    from kvhandoff.bench.push import _path, _percentiles, config_for

    assert config_for("cuda", True).transport == "cuda_ipc"
    assert config_for("cuda", True, "nixl").transport == "nixl"
    assert config_for("cpu", True).transport == "nixl"
    with pytest.raises(ValueError, match="cuda_ipc"):
        config_for("cpu", True, "cuda_ipc").check()
    ipc = config_for("cuda", True)
    assert _path(ipc, {"ipc_writes": 4, "nixl_writes": 0}) == "cuda_ipc"
    assert _path(ipc, {"ipc_writes": 0, "nixl_writes": 4}) == "nixl (cuda_ipc refused)"
    assert _percentiles([3.0, 1.0, 2.0]) == {"p50": 2.0, "p99": 3.0, "n": 3}
