"""The shared `/dev/shm` region (R-E03) and reaping of regions left by dead owners (B-02).

Most tests use a temporary directory as the shm directory; one runs in `/dev/shm` itself.
Liveness tests use real child processes, SIGKILLed where the test needs a dead owner.
"""

from __future__ import annotations

import importlib.util
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvhandoff.adapters.shm import region as shm_region
from kvhandoff.adapters.shm.region import (
    SharedRegion,
    reap_stale_regions,
    region_name,
)
from kvhandoff.protocol.errors import LocalProtocolError

HELPERS = Path(__file__).resolve().parent / "helpers"
SIZE = 1 << 16


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"kvh_helpers_{name}", HELPERS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


child_mod = _load("child")


@pytest.fixture
def name() -> str:
    return region_name(uuid.uuid4().hex, 0)


@pytest.fixture
def region(tmp_path: Path, name: str) -> Iterator[SharedRegion]:
    reg = SharedRegion.create(name, SIZE, shm_dir=str(tmp_path))
    yield reg
    reg.close()
    reg.unlink()


def holder(tmp_path: Path, mode: str, name: str, *size: str) -> Any:
    """A child process that creates or attaches `name` and holds it; returns the Child."""
    child = child_mod.Child(
        "shm_holder.py",
        mode,
        str(tmp_path),
        name,
        *size,
        stderr_path=tmp_path.parent / f"{tmp_path.name}-{mode}-{uuid.uuid4().hex[:6]}.err",
    )
    assert child.expect().startswith("READY")
    return child


# -- naming ---------------------------------------------------------------------------------


def test_R_E03_region_name_format() -> None:
    assert region_name("inst-1", 3) == "kvhandoff_ec_inst-1_dp3.mmap"
    assert region_name("abc", 0, prefix="vllm_ec") == "vllm_ec_abc_dp0.mmap"
    uid = str(uuid.uuid4())
    assert region_name(uid, 1).endswith(f"_{uid}_dp1.mmap")


@pytest.mark.parametrize("bad", ["", "a/b", "..", "a..b", "../x", ".hidden", "a b", "x\0"])
def test_R_E03_region_name_rejects_bad_instance_ids(bad: str) -> None:
    with pytest.raises(LocalProtocolError):
        region_name(bad, 0)


def test_R_E03_region_name_rejects_bad_rank_and_prefix() -> None:
    with pytest.raises(LocalProtocolError):
        region_name("abc", -1)
    with pytest.raises(LocalProtocolError):
        region_name("abc", 0, prefix="x/y")


def test_R_E03_create_rejects_path_names(tmp_path: Path) -> None:
    for bad in ("../escape.mmap", "a/b.mmap", "..", ""):
        with pytest.raises(LocalProtocolError):
            SharedRegion.create(bad, SIZE, shm_dir=str(tmp_path))


# -- the region -----------------------------------------------------------------------------


def test_R_E03_create_mode_0600_even_with_open_umask(tmp_path: Path, name: str) -> None:
    old = os.umask(0)
    try:
        reg = SharedRegion.create(name, SIZE, shm_dir=str(tmp_path))
    finally:
        os.umask(old)
    try:
        st = os.stat(reg.path)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == SIZE == reg.size
        assert reg.owner
    finally:
        reg.close()
        reg.unlink()


def test_R_E03_create_is_exclusive(region: SharedRegion) -> None:
    region.as_tensor()[:3] = 7
    with pytest.raises(FileExistsError):
        SharedRegion.create(region.name, SIZE, shm_dir=region.shm_dir)
    assert region.as_tensor()[:3].tolist() == [7, 7, 7]


def test_R_E03_plain_o_excl_path_when_o_tmpfile_is_unavailable(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm_region, "_create_linked", lambda dir_fd, name: None)
    reg = SharedRegion.create(name, SIZE, shm_dir=str(tmp_path))
    try:
        assert stat.S_IMODE(os.stat(reg.path).st_mode) == 0o600
        with pytest.raises(FileExistsError):
            SharedRegion.create(name, SIZE, shm_dir=str(tmp_path))
        assert reap_stale_regions(shm_dir=str(tmp_path)) == []  # locked from creation
    finally:
        reg.close()
        reg.unlink()


def test_R_E03_symlink_is_never_followed(tmp_path: Path, name: str) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    link = tmp_path / name
    link.symlink_to(target)
    with pytest.raises(FileExistsError):
        SharedRegion.create(name, SIZE, shm_dir=str(tmp_path))
    with pytest.raises(OSError):
        SharedRegion.attach(name, shm_dir=str(tmp_path))
    assert reap_stale_regions(shm_dir=str(tmp_path)) == []
    assert link.is_symlink()
    assert target.read_bytes() == b"keep me"


def test_R_E03_attach_sees_writes_in_both_directions(region: SharedRegion) -> None:
    other = SharedRegion.attach(region.name, shm_dir=region.shm_dir, expected_size=SIZE)
    try:
        assert not other.owner and other.size == SIZE
        region.as_tensor()[100:104] = 9
        assert other.as_tensor()[100:104].tolist() == [9, 9, 9, 9]
        view = other.buffer()
        view[0:2] = b"\x01\x02"
        view.release()
        assert bytes(region.buffer()[0:2]) == b"\x01\x02"
    finally:
        other.close()
    with pytest.raises(LocalProtocolError):
        SharedRegion.attach(region.name, shm_dir=region.shm_dir, expected_size=SIZE + 1)


def test_R_E03_attach_from_another_process(region: SharedRegion, tmp_path: Path) -> None:
    region.as_tensor()[:4] = 0xAB
    child = holder(tmp_path, "attach", region.name)
    try:
        assert child.request("READ 0 4") == "abababab"
        assert child.request("WRITE 8 cafe") == "OK"
        assert bytes(region.buffer()[8:10]) == b"\xca\xfe"
    finally:
        assert child.close() == 0


def test_R_E03_addr_is_the_mapping_address(region: SharedRegion) -> None:
    tensor = region.as_tensor()
    assert region.addr == tensor.data_ptr()
    assert tensor.numel() == SIZE


def test_R_E03_close_refuses_while_views_are_alive(region: SharedRegion) -> None:
    tensor = region.as_tensor()[10:20]  # a slice still pins the mapping
    with pytest.raises(LocalProtocolError):
        region.close()
    del tensor
    region.close()
    region.close()
    assert region.closed
    with pytest.raises(LocalProtocolError):
        region.as_tensor()


def test_R_E03_unlink_is_idempotent_and_spares_a_reused_name(tmp_path: Path, name: str) -> None:
    reg = SharedRegion.create(name, SIZE, shm_dir=str(tmp_path))
    assert reg.unlink()
    assert not reg.unlink()
    assert not os.path.exists(reg.path)
    newer = SharedRegion.create(name, SIZE, shm_dir=str(tmp_path))
    try:
        assert not reg.unlink()  # the name now belongs to another region
        assert os.path.exists(newer.path)
    finally:
        reg.close()
        newer.close()
        newer.unlink()


def test_R_E03_region_in_dev_shm() -> None:
    if not os.path.isdir(shm_region.SHM_DIR):
        pytest.skip("no /dev/shm")
    prefix = f"kvhtest{uuid.uuid4().hex[:8]}"
    reg = SharedRegion.create(region_name("a", 0, prefix=prefix), SIZE)
    try:
        assert reg.path.startswith("/dev/shm/")
        assert reap_stale_regions(prefix) == []
    finally:
        reg.close()
    assert reap_stale_regions(prefix) == [reg.name]
    assert not reg.unlink()


# -- liveness (B-02) ------------------------------------------------------------------------


def test_B02_region_of_sigkilled_owner_is_reaped(tmp_path: Path, name: str) -> None:
    child = holder(tmp_path, "create", name, str(SIZE))
    assert reap_stale_regions(shm_dir=str(tmp_path)) == []  # owner alive
    child.sigkill()
    child.close()
    assert (tmp_path / name).exists()  # leaked by the kill
    assert reap_stale_regions(shm_dir=str(tmp_path)) == [name]
    assert not (tmp_path / name).exists()
    assert reap_stale_regions(shm_dir=str(tmp_path)) == []


def test_B02_region_held_by_live_process_is_kept(tmp_path: Path) -> None:
    live = region_name("live", 0)
    dead = region_name("dead", 0)
    keeper = holder(tmp_path, "create", live, str(SIZE))
    victim = holder(tmp_path, "create", dead, str(SIZE))
    try:
        victim.sigkill()
        assert reap_stale_regions(shm_dir=str(tmp_path)) == [dead]
        assert (tmp_path / live).exists()
    finally:
        victim.close()
        assert keeper.close() == 0
    assert not (tmp_path / live).exists()  # its owner unlinked it at shutdown


def test_B02_attached_worker_keeps_region_of_dead_owner(tmp_path: Path, name: str) -> None:
    owner = holder(tmp_path, "create", name, str(SIZE))
    worker = SharedRegion.attach(name, shm_dir=str(tmp_path))
    try:
        owner.sigkill()
        assert reap_stale_regions(shm_dir=str(tmp_path)) == []
    finally:
        owner.close()
        worker.close()
    assert reap_stale_regions(shm_dir=str(tmp_path)) == [name]


def test_B02_reap_touches_only_matching_region_files(tmp_path: Path) -> None:
    others = ["ucx_shm_posix_1", "kvhandoff_ec_x.tmp", "kvhandoff_ecx_dp0.mmap", "other.mmap"]
    for other in others:
        (tmp_path / other).write_bytes(b"")
    (tmp_path / "kvhandoff_ec_dir_dp0.mmap").mkdir()
    stale = tmp_path / region_name("old", 2)
    stale.write_bytes(b"\0" * 16)
    assert reap_stale_regions(shm_dir=str(tmp_path)) == [stale.name]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*others, "kvhandoff_ec_dir_dp0.mmap"]
    )
    with pytest.raises(LocalProtocolError):
        reap_stale_regions("", shm_dir=str(tmp_path))
