"""ctypes access to the CUDA runtime calls torch does not expose (GPU only).

`CudaRuntime` binds the `libcudart` that torch already loaded (never a second copy):
async memcpy and `cudaMemcpyBatchAsync`, events without timing, stream waits, and the
device pointer of host-registered memory. `DeviceArray` wraps a device address in a
`__cuda_array_interface__` so torch can view the region's device mapping. Used by the
encoder-cache CUDA copy engine (`ec_copy_cuda`).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

__all__ = ["CudaRuntime", "DeviceArray"]


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = (
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


_SRC_ACCESS_ORDER_STREAM = 1
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (UVA) addresses
_EVENT_DISABLE_TIMING = 2
_MEM_LOCATION_DEVICE = 1
_MEM_LOCATION_HOST = 2


class CudaRuntime:
    """ctypes access to the `libcudart` that torch already loaded (never a second copy)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        version = ctypes.c_int(0)
        lib.cudaRuntimeGetVersion(ctypes.byref(version))
        self.version = version.value
        lib.cudaGetLastError.restype = ctypes.c_int
        self._memcpy: Any = lib.cudaMemcpyAsync
        self._memcpy.restype = ctypes.c_int
        self._memcpy.argtypes = (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        )
        for name in ("cudaEventCreateWithFlags", "cudaEventRecord", "cudaStreamWaitEvent"):
            getattr(lib, name).restype = ctypes.c_int
        lib.cudaEventCreateWithFlags.argtypes = (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint)
        lib.cudaEventRecord.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
        lib.cudaStreamWaitEvent.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
        lib.cudaEventDestroy.argtypes = (ctypes.c_void_p,)
        self._record: Any = lib.cudaEventRecord
        self._wait: Any = lib.cudaStreamWaitEvent
        lib.cudaHostGetDevicePointer.restype = ctypes.c_int
        lib.cudaHostGetDevicePointer.argtypes = (
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
            ctypes.c_uint,
        )
        self._batch: Any = None
        self.batch_reason = "cudaMemcpyBatchAsync needs CUDA >= 12.8"
        if self.version >= 12080 and hasattr(lib, "cudaMemcpyBatchAsync"):
            fn = lib.cudaMemcpyBatchAsync
            fn.restype = ctypes.c_int
            ptr = ctypes.c_void_p
            head = (ptr, ptr, ptr, ctypes.c_size_t, ptr, ptr, ctypes.c_size_t)
            # CUDA 13 dropped the `failIdx` out-parameter that 12.8/12.9 have before the stream.
            fn.argtypes = (*head, ptr) if self.version >= 13000 else (*head, ptr, ptr)
            self._batch = fn
            self.batch_reason = ""

    @classmethod
    def find(cls) -> CudaRuntime | None:
        """The loaded libcudart, by soname or from /proc/self/maps; None if not found."""
        names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
        try:
            with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
                for line in maps:
                    path = line.split()[-1] if line.strip() else ""
                    if "/libcudart.so" in path and path not in names:
                        names.insert(0, path)
        except OSError:
            pass
        for name in names:
            try:
                return cls(ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL))
            except (OSError, AttributeError):
                continue
        return None

    def clear_error(self) -> int:
        return int(self.lib.cudaGetLastError())

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """One `cudaMemcpyAsync` (direction from the addresses) on `stream`."""
        err = int(self._memcpy(dst, src, nbytes, _MEMCPY_DEFAULT, stream))
        if err != 0:
            self.clear_error()
            raise RuntimeError(f"cudaMemcpyAsync failed with CUDA error {err}")

    def new_event(self) -> int:
        """A cudaEvent_t without timing (for stream order only), or 0."""
        event = ctypes.c_void_p(0)
        if self.lib.cudaEventCreateWithFlags(ctypes.byref(event), _EVENT_DISABLE_TIMING) != 0:
            self.clear_error()
            return 0
        return event.value or 0

    def destroy_event(self, event: int) -> None:
        self.lib.cudaEventDestroy(event)

    def wait_for(self, stream: int, other: int, event: int) -> None:
        """Make `stream` wait for the work enqueued on `other` so far (through `event`)."""
        err = int(self._record(event, other)) or int(self._wait(stream, event, 0))
        if err != 0:
            self.clear_error()
            raise RuntimeError(f"cross-stream wait failed with CUDA error {err}")

    def device_pointer(self, host_ptr: int) -> int | None:
        out = ctypes.c_void_p(0)
        if self.lib.cudaHostGetDevicePointer(ctypes.byref(out), host_ptr, 0) != 0:
            self.clear_error()
            return None
        return out.value

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def memcpy_batch(
        self,
        dsts: np.ndarray[Any, Any],
        srcs: np.ndarray[Any, Any],
        sizes: np.ndarray[Any, Any],
        to_host: bool,
        device_index: int,
        stream: int,
    ) -> None:
        """One `cudaMemcpyBatchAsync` of `len(sizes)` copies (uint64 arrays) on `stream`."""
        attrs = _MemcpyAttributes()
        attrs.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
        device = _MemLocation(_MEM_LOCATION_DEVICE, device_index)
        host = _MemLocation(_MEM_LOCATION_HOST, 0)
        attrs.srcLocHint, attrs.dstLocHint = (device, host) if to_host else (host, device)
        attrs.flags = 0
        index = ctypes.c_size_t(0)
        args: list[Any] = [
            dsts.ctypes.data,
            srcs.ctypes.data,
            sizes.ctypes.data,
            len(sizes),
            ctypes.addressof(attrs),
            ctypes.addressof(index),
            1,
        ]
        if self.version < 13000:
            fail = ctypes.c_size_t(0)
            args.append(ctypes.addressof(fail))
        args.append(stream)
        err = int(self._batch(*args))
        if err != 0:
            self.clear_error()
            raise RuntimeError(f"cudaMemcpyBatchAsync failed with CUDA error {err}")


class DeviceArray:
    """A `__cuda_array_interface__` over a device address (the region's mapping)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }
