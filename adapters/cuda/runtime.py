"""The CUDA runtime calls torch does not expose, through NVIDIA's `cuda.bindings` (the
`gpu` extra; GPU only).

`CudaRuntime` holds the bound calls of the encoder-cache copy engine (`ec_copy`): async
memcpy and `cudaMemcpyBatchAsync`, events without timing, stream waits, host
registration of the region and the device pointer of host-registered memory. Streams
and events are plain ints (torch's raw handles). `DeviceArray` wraps a device address
in a `__cuda_array_interface__` so torch can view the region's device mapping.
`cuda.bindings` is loaded through the loader shared with the IPC path (`bindings`),
only when an engine starts.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

import numpy as np

from kvhandoff.adapters.cuda import bindings
from kvhandoff.adapters.cuda.bindings import CudaError

__all__ = ["CudaError", "CudaRuntime", "DeviceArray"]

_HOST_REGISTER_PORTABLE = 1
_HOST_REGISTER_MAPPED = 2
_EVENT_DISABLE_TIMING = 2


class CudaRuntime:
    """The copy engine's runtime calls, bound once from `cuda.bindings.runtime`."""

    def __init__(self, rt: ModuleType) -> None:
        self.rt = rt
        (version,) = bindings.call(rt, "cudaRuntimeGetVersion")
        self.version = int(cast(int, version))
        self._success: object = rt.cudaError_t.cudaSuccess
        self._default: object = rt.cudaMemcpyKind.cudaMemcpyDefault  # direction from UVA
        self._memcpy: Any = rt.cudaMemcpyAsync
        self._record: Any = rt.cudaEventRecord
        self._wait: Any = rt.cudaStreamWaitEvent
        self._batch: Any = None
        self.batch_reason = "cudaMemcpyBatchAsync needs CUDA >= 12.8"
        if self.version >= 12080 and hasattr(rt, "cudaMemcpyBatchAsync"):
            self._batch = rt.cudaMemcpyBatchAsync
            self.batch_reason = ""

    @classmethod
    def load(cls) -> CudaRuntime | str:
        """The runtime calls, or why there are none (cuda-python missing or broken)."""
        mods = bindings.modules()
        if mods is None:
            return f"the CUDA copy engine {bindings.MISSING}"
        try:
            return cls(mods[0])
        except (CudaError, AttributeError) as exc:
            return f"cuda.bindings.runtime unusable: {exc}"

    def _fail(self, what: str, err: object) -> CudaError:
        self.clear_error()
        return CudaError(f"{what} failed with CUDA error {err!r}")

    def clear_error(self) -> None:
        """Clear this thread's last runtime error (a failed call must not stick)."""
        cast(Callable[[], object], self.rt.cudaGetLastError)()

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """One `cudaMemcpyAsync` (direction from the addresses) on `stream`."""
        err = self._memcpy(dst, src, nbytes, self._default, stream)[0]
        if err != self._success:
            raise self._fail("cudaMemcpyAsync", err)

    def new_event(self) -> int:
        """A cudaEvent_t without timing (for stream order only), or 0."""
        flags = getattr(self.rt, "cudaEventDisableTiming", _EVENT_DISABLE_TIMING)
        err, event = self.rt.cudaEventCreateWithFlags(flags)
        if err != self._success:
            self.clear_error()
            return 0
        return bindings.as_int(event)

    def destroy_event(self, event: int) -> None:
        self.rt.cudaEventDestroy(event)

    def wait_for(self, stream: int, other: int, event: int) -> None:
        """Make `stream` wait for the work enqueued on `other` so far (through `event`)."""
        err = self._record(event, other)[0]
        if err == self._success:
            err = self._wait(stream, event, 0)[0]
        if err != self._success:
            raise self._fail("cross-stream wait", err)

    def host_register(self, ptr: int, nbytes: int) -> None:
        """Page-lock host memory (portable, mapped into the device's address space)."""
        flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED
        (err,) = self.rt.cudaHostRegister(ptr, nbytes, flags)
        if err != self._success:
            raise self._fail(f"cudaHostRegister of {nbytes} bytes", err)

    def host_unregister(self, ptr: int) -> None:
        (err,) = self.rt.cudaHostUnregister(ptr)
        if err != self._success:
            self.clear_error()

    def device_pointer(self, host_ptr: int) -> int | None:
        """The device address of host-registered memory, or None."""
        err, out = self.rt.cudaHostGetDevicePointer(host_ptr, 0)
        if err != self._success:
            self.clear_error()
            return None
        return bindings.as_int(out)

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
        """One `cudaMemcpyBatchAsync` of `len(sizes)` copies (uint64 arrays) on `stream`,
        sources read in stream order, with the host/device location hints."""
        rt = self.rt
        device, host = rt.cudaMemLocation(), rt.cudaMemLocation()
        device.type, device.id = rt.cudaMemLocationType.cudaMemLocationTypeDevice, device_index
        host.type, host.id = rt.cudaMemLocationType.cudaMemLocationTypeHost, 0
        attrs = rt.cudaMemcpyAttributes()
        attrs.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        attrs.srcLocHint, attrs.dstLocHint = (device, host) if to_host else (host, device)
        attrs.flags = 0
        count = len(sizes)
        # CUDA 12.8/12.9 also return the failing index; CUDA 13 dropped it.
        result = self._batch(
            dsts.tolist(), srcs.tolist(), sizes.tolist(), count, [attrs], [0], 1, stream
        )
        err = result[0] if isinstance(result, tuple) else result
        if err != self._success:
            raise self._fail("cudaMemcpyBatchAsync", err)


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
