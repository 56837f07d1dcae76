"""CUDA IPC through NVIDIA's `cuda.bindings` (the `gpu` extra): export a device
allocation as an IPC handle, open a peer's handle once, close it (issue 18).

Nothing here imports `cuda.bindings` at module import time: `available()` says whether
it can be loaded, and each call loads it through the shared loader (`bindings`), so the
CPU-only install and CI never touch CUDA. Every function returns plain ints and bytes; a
CUDA error is an `IpcError` (a `KvHandoffError`), never a crash, so a caller falls back
to NIXL.
"""

from __future__ import annotations

import ctypes
import socket
from collections.abc import Callable
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import cast

from kvhandoff.adapters.cuda import bindings
from kvhandoff.protocol.errors import KvHandoffError

IPC_HANDLE_BYTES = 64
PEER_ACCESS_ALREADY_ENABLED = 704
"""cudaErrorPeerAccessAlreadyEnabled."""


class IpcError(KvHandoffError):
    """A CUDA IPC call failed (or `cuda.bindings` is missing): use another path."""


def available() -> bool:
    """Whether `cuda.bindings` imports (not whether a GPU is present)."""
    return bindings.available()


def _rt() -> ModuleType:
    return bindings.runtime(IpcError)


def _drv() -> ModuleType:
    return bindings.driver(IpcError)


def _call(module: ModuleType, name: str, *args: object) -> tuple[object, ...]:
    return bindings.call(module, name, *args, error=IpcError)


_as_int = bindings.as_int


def set_device(device: int) -> None:
    """Make `device` (and its primary context) current on the calling thread."""
    _call(_rt(), "cudaSetDevice", device)


def pci_bus_id(device: int) -> str:
    (raw,) = _call(_rt(), "cudaDeviceGetPCIBusId", 64, device)
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text.rstrip("\x00").strip().lower()


def device_by_pci_bus_id(bus_id: str) -> int:
    (device,) = _call(_rt(), "cudaDeviceGetByPCIBusId", bus_id.encode())
    return int(cast(int, device))


def can_access_peer(device: int, peer: int) -> bool:
    if device == peer:
        return True
    (ok,) = _call(_rt(), "cudaDeviceCanAccessPeer", device, peer)
    return bool(ok)


def visible_device(bus_id: str) -> int | None:
    """This process's number for the GPU at `bus_id`, or None where it is not visible
    (CUDA_VISIBLE_DEVICES hides it, or no such GPU)."""
    try:
        return device_by_pci_bus_id(bus_id)
    except IpcError:
        return None


def enable_peer_access(device: int, peer: int) -> None:
    """Let kernels and copies of `device` reach `peer`'s memory (cudaDeviceEnablePeerAccess
    from `device`); enabled already counts as done. The caller checked
    `can_access_peer` first."""
    if device == peer:
        return
    rt = _rt()
    set_device(device)
    result = rt.cudaDeviceEnablePeerAccess(peer, 0)
    err = result[0] if isinstance(result, tuple) else result
    code = int(cast(int, getattr(err, "value", err)))
    if code == PEER_ACCESS_ALREADY_ENABLED:
        rt.cudaGetLastError()  # take the (non-sticky) error back off the thread
        return
    if code != 0:
        raise IpcError(f"cudaDeviceEnablePeerAccess({device} -> {peer}) failed: {err}")


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """One copy-engine copy between UVA device addresses (an IPC-mapped peer address
    too: with peer access the driver routes it GPU to GPU, as cudaMemcpyPeerAsync)."""
    rt = _rt()
    _call(rt, "cudaMemcpyAsync", dst, src, nbytes, rt.cudaMemcpyKind.cudaMemcpyDefault, stream)


def memcpy_peer_async(
    dst: int, dst_device: int, src: int, src_device: int, nbytes: int, stream: int
) -> None:
    """cudaMemcpyPeerAsync between two of this process's own allocations."""
    _call(_rt(), "cudaMemcpyPeerAsync", dst, dst_device, src, src_device, nbytes, stream)


def allocation_range(ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation holding `ptr` (cuMemGetAddressRange)."""
    drv = _drv()
    dptr = cast(Callable[[int], object], drv.CUdeviceptr)(ptr)
    base, size = _call(drv, "cuMemGetAddressRange", dptr)
    return _as_int(base), int(cast(int, size))


def _handle_bytes(handle: object) -> bytes:
    getter = getattr(handle, "getPtr", None)
    if getter is not None:
        return ctypes.string_at(int(cast(int, getter())), IPC_HANDLE_BYTES)
    return bytes(cast(bytes, handle.reserved))  # type: ignore[attr-defined]


def get_mem_handle(base: int) -> bytes:
    """The 64-byte IPC handle of the allocation starting at `base`."""
    (handle,) = _call(_rt(), "cudaIpcGetMemHandle", base)
    return _handle_bytes(handle)


def open_mem_handle(data: bytes) -> int:
    """Map a peer's allocation into this process (once per peer); returns its address."""
    if len(data) != IPC_HANDLE_BYTES:
        raise IpcError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(data)}")
    rt = _rt()
    handle = cast(Callable[[], object], rt.cudaIpcMemHandle_t)()
    getter = getattr(handle, "getPtr", None)
    if getter is not None:
        ctypes.memmove(int(cast(int, getter())), data, IPC_HANDLE_BYTES)
    else:
        handle.reserved = data  # type: ignore[attr-defined]
    flag = rt.cudaIpcMemLazyEnablePeerAccess
    (ptr,) = _call(rt, "cudaIpcOpenMemHandle", handle, flag)
    return _as_int(ptr)


def close_mem_handle(ptr: int) -> None:
    _call(_rt(), "cudaIpcCloseMemHandle", ptr)


@cache
def host_identity() -> str:
    """Who "the same host" is: the hostname and this boot's id (a restarted or another
    host never matches, so IPC is refused there)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "unknown-boot"
    return f"{socket.gethostname()}/{boot}"
