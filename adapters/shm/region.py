"""The shared `/dev/shm` region of the encoder-cache CPU tier (R-E03, B-02).

One region per instance and DP rank, shared by all TP/PCP workers of that instance: the
owner calls `SharedRegion.create`, the other workers `SharedRegion.attach`, and the owner
calls `unlink()` at shutdown.

Liveness (B-02): every process using a region holds `flock(LOCK_SH)` on it for as long as
it has it open, and the kernel drops that lock when the process dies, SIGKILL included.
`reap_stale_regions` takes `LOCK_EX | LOCK_NB` on each region file: when that succeeds no
live process holds the region, so it is a leftover and is unlinked.

The owner's file is created already locked: an unnamed `O_TMPFILE` file is locked, sized
and then linked under its name (`linkat` fails if the name exists, as `O_EXCL` does), so a
concurrent reaper can never see a fresh region unlocked. Where `O_TMPFILE` or `/proc` is
not available the file is opened with `O_CREAT | O_EXCL | O_RDWR | O_NOFOLLOW` and locked
right after. Files are mode 0600 and never opened through a symlink.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import stat
from typing import TYPE_CHECKING

from kvhandoff.protocol.errors import LocalProtocolError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_PREFIX",
    "SHM_DIR",
    "SharedRegion",
    "reap_stale_regions",
    "region_name",
]

SHM_DIR = "/dev/shm"
DEFAULT_PREFIX = "kvhandoff_ec"
SUFFIX = ".mmap"
_MODE = 0o600
_TOKEN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_MAX_NAME = 255


def _check_token(what: str, value: str) -> None:
    """Reject anything that is not a plain file-name fragment."""
    if not _TOKEN.fullmatch(value) or ".." in value or len(value) > 128:
        raise LocalProtocolError(
            f"{what} {value!r} must be 1-128 characters of [A-Za-z0-9._-], "
            "start with a letter or digit, and contain no '..'"
        )


def region_name(instance_id: str, dp_rank: int, prefix: str = DEFAULT_PREFIX) -> str:
    """`<prefix>_<instance_id>_dp<dp_rank>.mmap`, with every part validated."""
    _check_token("prefix", prefix)
    _check_token("instance id", instance_id)
    if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
        raise LocalProtocolError(f"dp_rank must be a non-negative int, got {dp_rank!r}")
    return f"{prefix}_{instance_id}_dp{dp_rank}{SUFFIX}"


def _check_name(name: str) -> None:
    """A region file name: one path component, no traversal."""
    if (
        not name
        or len(name) > _MAX_NAME
        or "/" in name
        or "\0" in name
        or name in (".", "..")
        or ".." in name
    ):
        raise LocalProtocolError(f"invalid shared-region name {name!r}")


def _open_dir(shm_dir: str) -> int:
    return os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _create_linked(dir_fd: int, name: str) -> int | None:
    """Create `name` as an already-locked file via O_TMPFILE + linkat; None if unsupported."""
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, _MODE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.fchmod(fd, _MODE)
        proc_fd = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.link(str(fd), name, src_dir_fd=proc_fd, dst_dir_fd=dir_fd, follow_symlinks=True)
        finally:
            os.close(proc_fd)
    except FileExistsError:
        os.close(fd)
        raise
    except OSError:  # no /proc, or a file system that cannot link it: use the plain path
        os.close(fd)
        return None
    return fd


def _create_exclusive(dir_fd: int, name: str) -> int:
    """Create `name` with O_CREAT|O_EXCL|O_RDWR|O_NOFOLLOW, then lock it."""
    flags = os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, _MODE, dir_fd=dir_fd)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.fchmod(fd, _MODE)
    return fd


def _map(fd: int, size: int) -> tuple[mmap.mmap, int]:
    """Map `size` bytes of `fd` shared read-write; returns the map and its address."""
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    anchor = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(anchor)
    del anchor  # drop the buffer export so the map can be closed later
    return mm, addr


class SharedRegion:
    """A mapped `/dev/shm` file held under a shared flock for its whole open lifetime."""

    __slots__ = ("_fd", "_identity", "_mm", "addr", "name", "owner", "path", "shm_dir", "size")

    def __init__(
        self, name: str, shm_dir: str, fd: int, mm: mmap.mmap, addr: int, size: int, owner: bool
    ) -> None:
        st = os.fstat(fd)
        self.name = name
        self.shm_dir = shm_dir
        self.path = os.path.join(shm_dir, name)
        self.size = size
        self.addr = addr
        self.owner = owner
        self._fd = fd
        self._mm: mmap.mmap | None = mm
        self._identity = (st.st_dev, st.st_ino)

    @classmethod
    def create(
        cls, name: str, size: int, *, shm_dir: str = SHM_DIR, preallocate: bool = False
    ) -> SharedRegion:
        """Create, size and map a new region; `FileExistsError` if the name is taken.

        `preallocate` reserves the pages now (`posix_fallocate`) so a full tmpfs fails
        here instead of with SIGBUS on first touch.
        """
        _check_name(name)
        if size <= 0:
            raise LocalProtocolError(f"region size must be positive, got {size}")
        dir_fd = _open_dir(shm_dir)
        try:
            fd = _create_linked(dir_fd, name)
            if fd is None:
                fd = _create_exclusive(dir_fd, name)
            try:
                os.ftruncate(fd, size)
                if preallocate:
                    os.posix_fallocate(fd, 0, size)
                mm, addr = _map(fd, size)
            except BaseException:
                try:
                    os.unlink(name, dir_fd=dir_fd)
                finally:
                    os.close(fd)
                raise
        finally:
            os.close(dir_fd)
        return cls(name, shm_dir, fd, mm, addr, size, owner=True)

    @classmethod
    def attach(
        cls, name: str, *, shm_dir: str = SHM_DIR, expected_size: int | None = None
    ) -> SharedRegion:
        """Map an existing region read-write (another worker of the same instance)."""
        _check_name(name)
        dir_fd = _open_dir(shm_dir)
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise LocalProtocolError(f"{name} is not a regular file owned by this user")
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits out a reaper holding LOCK_EX
            if os.fstat(fd).st_nlink == 0:
                raise FileNotFoundError(errno.ENOENT, "region was reaped", name)
            size = st.st_size
            if size <= 0 or (expected_size is not None and size != expected_size):
                raise LocalProtocolError(
                    f"{name} has {size} bytes, expected {expected_size or 'a positive size'}"
                )
            mm, addr = _map(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, shm_dir, fd, mm, addr, size, owner=False)

    # -- views -------------------------------------------------------------------------

    def _live(self) -> mmap.mmap:
        if self._mm is None:
            raise LocalProtocolError(f"shared region {self.name} is closed")
        return self._mm

    @property
    def closed(self) -> bool:
        """True after `close()`."""
        return self._mm is None

    def buffer(self) -> memoryview:
        """A writable memoryview of the whole region (release it before `close`)."""
        return memoryview(self._live())

    def as_tensor(self) -> torch.Tensor:
        """The region as a flat torch uint8 tensor sharing its memory.

        The tensor (and every view of it) keeps a buffer export of the mapping alive, so
        `close()` refuses to unmap memory a tensor still points at.
        """
        import numpy as np
        import torch

        return torch.from_numpy(np.frombuffer(self._live(), dtype=np.uint8))

    # -- teardown ----------------------------------------------------------------------

    def close(self) -> None:
        """Unmap and drop the lock. Idempotent.

        Raises `LocalProtocolError` while a memoryview or tensor of the region is alive.
        """
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError as exc:
                raise LocalProtocolError(
                    f"views of shared region {self.name} are still alive; drop them first"
                ) from exc
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> bool:
        """Remove the name if it still refers to this region; True if it was removed.

        Idempotent, and safe when the name was reaped and reused by another region.
        """
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (st.st_dev, st.st_ino) != self._identity:
            return False
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            return False
        return True

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def reap_stale_regions(prefix: str = DEFAULT_PREFIX, shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink regions named `<prefix>_*.mmap` that no live process holds; returns their names.

    Only regular files owned by this user are considered; symlinks are skipped.
    """
    _check_token("prefix", prefix)
    start = prefix + "_"
    reaped: list[str] = []
    dir_fd = _open_dir(shm_dir)
    try:
        names = sorted(
            entry.name
            for entry in os.scandir(dir_fd)
            if entry.name.startswith(start) and entry.name.endswith(SUFFIX)
        )
        for name in names:
            if _reap_one(dir_fd, name):
                reaped.append(name)
    finally:
        os.close(dir_fd)
    return reaped


def _reap_one(dir_fd: int, name: str) -> bool:
    """Unlink `name` if nobody holds its lock; False when live, foreign or gone."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError:  # vanished, a symlink (ELOOP) or not ours to open
        return False
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a live process holds it
        try:
            now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # the name was reused meanwhile
        os.unlink(name, dir_fd=dir_fd)
        return True
    finally:
        os.close(fd)
