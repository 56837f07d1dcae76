"""The NIXL agent adapter over real NIXL (UCX, DRAM) between two OS processes (R-P15, B-03).

The test process plays P; `helpers/nixl_peer.py` plays D in a child process. Agent
metadata travels over the ZMQ side channel in both directions. Every wait is bounded
polling against a deadline.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from kvhandoff.adapters.nixl.agent import (
    BlockLayout,
    IndexList,
    NixlAgent,
    NixlTransferError,
    PreppedBlocks,
    XferHandle,
)
from kvhandoff.adapters.nixl.loader import load_nixl
from kvhandoff.adapters.zmq.side_channel import SideChannelServer, fetch_handshake
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError

HELPERS = Path(__file__).resolve().parent / "helpers"
BLOCK = 4096
BLOCKS = 8
REGIONS = 2
SIZE = BLOCK * BLOCKS * REGIONS
DEADLINE_S = 20.0
Bytes = npt.NDArray[np.uint8]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvh_helpers_{name}", HELPERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child_mod = _load("child")
peer_mod = _load("nixl_peer")


def pattern(size: int, seed: int) -> Bytes:
    result: Bytes = peer_mod.pattern(size, seed)
    return result


def regions_of(addr: int) -> list[tuple[int, int, int]]:
    """The test layout: REGIONS regions of BLOCKS blocks each, back to back."""
    return [(addr + r * BLOCK * BLOCKS, BLOCK, BLOCKS) for r in range(REGIONS)]


def wait_done(agent: NixlAgent, handle: XferHandle) -> str:
    """Bounded polling until the transfer leaves PROC."""
    deadline = time.monotonic() + DEADLINE_S
    while agent.poll(handle) == "PROC" and time.monotonic() < deadline:
        time.sleep(0.0005)  # poll interval; the deadline bounds the wait
    return handle.xfer_status


class Pair:
    """P (this process) and D (a child process), handshaken both ways over the side channel."""

    def __init__(self, tmp_path: Path, name: str) -> None:
        self.buf = pattern(SIZE, -1)
        self.agent = NixlAgent(name)
        self.agent.register_dram(self.buf.ctypes.data, self.buf.nbytes)
        self.server = SideChannelServer("127.0.0.1", 0, self._payload)
        self.child = child_mod.Child(
            "nixl_peer.py",
            "D",
            str(SIZE),
            "-1",
            str(self.server.port),
            stderr_path=tmp_path / f"{name}.stderr",
        )
        self.port = int(self.child.expect().split()[1])
        assert self.child.expect() == "READY"
        self.local_blocks = self.agent.prep_local_blocks(regions_of(self.buf.ctypes.data))
        self.connect()

    def _payload(self, pp_rank: int, tp_rank: int) -> bytes:
        return msgspec.msgpack.encode({"meta": self.agent.metadata()})

    def connect(self) -> None:
        """Fetch D's handshake, load D and prepare D's blocks."""
        hs: dict[str, Any] = msgspec.msgpack.decode(
            fetch_handshake("127.0.0.1", self.port, DEADLINE_S)
        )
        self.remote_addr = int(hs["addr"])
        self.remote = self.agent.add_remote(hs["meta"])
        self.remote_blocks = self.agent.prep_remote_blocks(
            self.remote, regions_of(self.remote_addr)
        )

    def fill(self, p_seed: int, d_seed: int) -> None:
        """Known contents on both sides; reconnect if a test removed D."""
        self.buf[:] = pattern(SIZE, p_seed)
        assert self.child.request(f"FILL {d_seed}") == "FILLED"
        if self.remote not in self.agent.remotes:
            self.connect()

    def notifs(self, count: int) -> list[list[str]]:
        got: list[list[str]] = json.loads(
            self.child.request(f"NOTIFS {DEADLINE_S} {count}").split(" ", 1)[1]
        )
        return got

    def check(self, seed: int, pairs: list[tuple[int, int]]) -> str:
        spec = {"seed": seed, "block_len": BLOCK, "pairs": pairs}
        answer: str = self.child.request("CHECK " + json.dumps(spec))
        return answer

    def close(self) -> None:
        if self.child.proc.poll() is None:
            self.child.send("EXIT")
        self.child.close()
        self.server.close()
        self.agent.close()


@pytest.fixture(scope="module")
def shared_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    pair = Pair(tmp_path_factory.mktemp("nixl"), "P")
    yield pair
    pair.close()


@pytest.fixture
def pair_p_writes(shared_pair: Pair) -> Pair:
    """P holds pattern(7), D holds zeros."""
    shared_pair.fill(7, -1)
    return shared_pair


@pytest.fixture
def pair_p_reads(shared_pair: Pair) -> Pair:
    """P holds zeros, D holds pattern(11)."""
    shared_pair.fill(-1, 11)
    return shared_pair


def _write(pair: Pair, local: IndexList, remote: IndexList, notif: bytes) -> XferHandle:
    return pair.agent.write(pair.local_blocks, local, pair.remote_blocks, remote, notif)


# -- layout maths (no process needed) ---------------------------------------------------


def test_R_P06_descriptor_index_is_region_major() -> None:
    layout = BlockLayout([(0x1000, 64, 4), (0x9000, 64, 4)])
    assert layout.num_descs == 8
    assert [layout.index(r, b) for r in range(2) for b in range(4)] == list(range(8))
    assert layout.index(1, 2) == 1 * 4 + 2
    assert layout.indices_for_blocks([3, 0]).tolist() == [3, 0, 7, 4]
    assert layout.indices_for_blocks([1], regions=[1]).tolist() == [5]
    rows = layout.descriptor_rows()
    assert rows[6].tolist() == [0x9000 + 2 * 64, 64, 0]


def test_R_P14_uneven_region_capacities_offset_by_capacity() -> None:
    layout = BlockLayout([(0, 16, 3), (4096, 32, 5), (8192, 16, 2)])
    assert layout.index(1, 0) == 3
    assert layout.index(2, 1) == 3 + 5 + 1
    assert layout.descriptor_rows()[3 + 4].tolist() == [4096 + 4 * 32, 32, 0]
    with pytest.raises(LocalProtocolError):
        layout.index(2, 2)
    with pytest.raises(LocalProtocolError):
        layout.indices_for_blocks([2])  # region 2 has only 2 blocks
    with pytest.raises(LocalProtocolError):
        BlockLayout([])


def test_R_E02_load_nixl_names_the_fix_when_missing() -> None:
    assert hasattr(load_nixl(), "nixl_agent")
    with pytest.raises(RuntimeError, match="pip install nixl"):
        load_nixl(("kvhandoff_no_such_nixl",))


def test_B03_backend_configurable() -> None:
    with NixlAgent("b03-ucx", backend="UCX") as agent:
        assert agent.backend == "UCX"
        assert agent.metadata()
    with pytest.raises(NixlTransferError) as info:
        NixlAgent("b03-none", backend="NO_SUCH_BACKEND")
    assert info.value.op == "create_backend"
    assert "NO_SUCH_BACKEND" in info.value.detail
    assert isinstance(info.value, KvHandoffError)


def test_R_P15_closed_agent_is_a_local_error() -> None:
    agent = NixlAgent("closed")
    agent.close()
    agent.close()
    with pytest.raises(LocalProtocolError):
        agent.metadata()


def test_R_P15_bad_metadata_maps_to_nixl_transfer_error() -> None:
    with NixlAgent("bad-md") as agent, pytest.raises(NixlTransferError) as info:
        agent.add_remote(b"not nixl metadata")
    assert info.value.op == "add_remote"


def test_R_P15_register_tensor_and_loopback_write() -> None:
    import torch

    src = torch.arange(4 * BLOCK, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros(4 * BLOCK, dtype=torch.uint8)
    with NixlAgent("loop") as agent:
        assert agent.register_tensor(src).mem == "DRAM"
        agent.register_tensor(dst)
        local = agent.prep_local_blocks([(src.data_ptr(), BLOCK, 4)])
        target = agent.prep_remote_blocks("loop", [(dst.data_ptr(), BLOCK, 4)])
        handle = agent.write(local, [0, 3], target, [1, 2], b"req-0:1")
        assert wait_done(agent, handle) == "DONE"
        agent.release(handle)
        assert torch.equal(dst[BLOCK : 2 * BLOCK], src[:BLOCK])
        assert torch.equal(dst[2 * BLOCK : 3 * BLOCK], src[3 * BLOCK :])
        with pytest.raises(LocalProtocolError):
            agent.write(local, [0, 1], target, [0], b"")
        with pytest.raises(LocalProtocolError):
            agent.write(local, [4], target, [0], b"")
        with pytest.raises(LocalProtocolError):
            agent.write(target, [0], local, [0], b"")  # sides swapped
        with pytest.raises(LocalProtocolError):
            agent.register_tensor(src[::2])


# -- two processes ------------------------------------------------------------------------


@pytest.mark.integration
def test_R_P15_write_blocks_by_index_with_notif(pair_p_writes: Pair) -> None:
    pair = pair_p_writes
    layout = pair.local_blocks.layout
    # P's (region, block) -> D's (region, block): scattered, across regions.
    moves = [((0, 1), (0, 6)), ((0, 2), (1, 0)), ((1, 7), (0, 3)), ((1, 4), (1, 4))]
    local = [layout.index(*src) for src, _ in moves]
    remote = [pair.remote_blocks.layout.index(*dst) for _, dst in moves]
    handle = _write(pair, local, remote, b"req-1:1")
    assert wait_done(pair.agent, handle) == "DONE"
    pair.agent.release(handle)
    pair.agent.release(handle)  # idempotent

    assert pair.notifs(1) == [["P", "req-1:1"]]
    moved = [(li * BLOCK, ri * BLOCK) for li, ri in zip(local, remote, strict=True)]
    assert pair.check(7, moved) == "OK"
    untouched = [(0, i * BLOCK) for i in range(BLOCKS * REGIONS) if i not in remote]
    assert pair.check(-1, untouched) == "OK"


@pytest.mark.integration
def test_R_P15_concurrent_writes_each_notify_once(pair_p_writes: Pair) -> None:
    pair = pair_p_writes
    ids = pair.local_blocks.layout.indices_for_blocks([0, 5])
    handles = [_write(pair, ids, ids, f"req-{n}:1".encode()) for n in range(3)]
    assert [wait_done(pair.agent, h) for h in handles] == ["DONE"] * 3
    for handle in handles:
        pair.agent.release(handle)
    # NIXL does not keep the posting order of notifs across concurrent transfers.
    assert sorted(pair.notifs(3)) == [["P", f"req-{n}:1"] for n in range(3)]
    assert pair.check(7, [(int(i) * BLOCK, int(i) * BLOCK) for i in ids]) == "OK"


@pytest.mark.integration
def test_R_P15_read_blocks_from_peer(pair_p_reads: Pair) -> None:
    pair = pair_p_reads
    local = [pair.local_blocks.layout.index(1, 1), pair.local_blocks.layout.index(0, 0)]
    remote = [pair.remote_blocks.layout.index(0, 5), pair.remote_blocks.layout.index(1, 2)]
    handle = pair.agent.read(pair.local_blocks, local, pair.remote_blocks, remote)
    assert wait_done(pair.agent, handle) == "DONE"
    pair.agent.release(handle)
    source = pattern(SIZE, 11)
    for li, ri in zip(local, remote, strict=True):
        got = pair.buf[li * BLOCK : (li + 1) * BLOCK]
        assert np.array_equal(got, source[ri * BLOCK : (ri + 1) * BLOCK])
    assert not pair.buf[2 * BLOCK : 3 * BLOCK].any()


@pytest.mark.integration
def test_R_P15_notifs_flow_both_ways(pair_p_writes: Pair) -> None:
    pair = pair_p_writes
    assert pair.child.request("SEND_NOTIF HB:req-9") == "SENT"
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + DEADLINE_S
    while not got and time.monotonic() < deadline:
        got = pair.agent.get_new_notifs()
    assert got == [("D", b"HB:req-9")]


@pytest.mark.integration
def test_R_P15_transfer_to_removed_remote_raises(pair_p_writes: Pair) -> None:
    pair = pair_p_writes
    stale: PreppedBlocks = pair.remote_blocks
    pair.agent.remove_remote(pair.remote)
    assert pair.remote not in pair.agent.remotes
    with pytest.raises(NixlTransferError) as info:
        _write(pair, [0], [0], b"req-2:1")
    assert info.value.op == "write"
    assert stale.released
    with pytest.raises(NixlTransferError) as info:
        pair.agent.prep_remote_blocks(pair.remote, regions_of(pair.remote_addr))
    assert info.value.op == "prep_remote_blocks"
    with pytest.raises(NixlTransferError) as info:
        pair.agent.send_notif(pair.remote, b"HB:x")
    assert info.value.op == "send_notif"


@pytest.mark.integration
def test_B08_rehandshake_after_remove_restores_transfers(pair_p_writes: Pair) -> None:
    pair = pair_p_writes
    pair.agent.remove_remote(pair.remote)
    pair.connect()
    assert pair.remote == "D"
    handle = _write(pair, [3], [3], b"req-3:1")
    assert wait_done(pair.agent, handle) == "DONE"
    pair.agent.release(handle)
    assert pair.notifs(1) == [["P", "req-3:1"]]
    assert pair.check(7, [(3 * BLOCK, 3 * BLOCK)]) == "OK"


@pytest.mark.integration
def test_R_P12_write_to_killed_peer_fails_typed(tmp_path: Path) -> None:
    pair = Pair(tmp_path, "P-kill")
    try:
        pair.child.sigkill()
        outcome = ""
        deadline = time.monotonic() + DEADLINE_S
        while not outcome and time.monotonic() < deadline:
            try:
                handle = _write(pair, [0], [0], b"req-4:1")
            except NixlTransferError as exc:
                assert exc.op == "write"
                outcome = "raised"
                break
            if wait_done(pair.agent, handle) == "ERR":
                outcome = "err"
            pair.agent.release(handle)
        assert outcome in ("raised", "err")
    finally:
        pair.close()
