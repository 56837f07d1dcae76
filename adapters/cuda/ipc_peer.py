"""P's side of one D rank's KV opened through CUDA IPC (issue 18): the mapped
allocations, the per-region address tables (uploaded once), one gather-scatter launch per
batch on the peer's copy stream, and the unmapping when D goes away.

The kernel is the cuda.core one (`ipc_gather.py`: NVRTC, a prepared `cuLaunchKernel`, a
few µs of host time per launch) where it loads, else Triton's (`ipc_kernel.py`), or the
one the caller names (`kernel`). Imported lazily by `ipc_transport.py` (it imports torch)
once a D on the same host has sent its export.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, Protocol, cast

import torch

from kvhandoff.adapters.cuda import ipc_runtime
from kvhandoff.adapters.cuda.ipc_export import IPC_EXPORT_VERSION, IpcExport
from kvhandoff.adapters.cuda.ipc_route import (
    CrossDevice,
    Route,
    RouteChoice,
    choose_route,
    coalesce,
)
from kvhandoff.adapters.cuda.ipc_runtime import IpcError
from kvhandoff.protocol.member_routing import MemberSlot

if TYPE_CHECKING:
    from collections.abc import Callable

    from kvhandoff.adapters.cuda.ipc_gather import GatherLaunches

log = logging.getLogger(__name__)

ALIGN = 16

KernelChoice = Literal["auto", "cuda_core", "triton"]
"""Which gather-scatter kernel: "cuda_core" (NVRTC, prepared `cuLaunchKernel`), "triton",
or "auto" (cuda_core where it loads, else Triton)."""


class Copy(Protocol):
    """A launched copy's end: an event (torch's or the gather launch slot)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _DevicePtr:
    """A `__cuda_array_interface__` of one int64 word at a device address, so torch
    (and Triton) take the address as a base pointer."""

    def __init__(self, ptr: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (1,),
            "typestr": "<i8",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


def _base_tensor(ptr: int, device: torch.device) -> torch.Tensor:
    return torch.as_tensor(_DevicePtr(ptr), device=device)


class OpenedPeer:
    """One D rank's KV regions mapped into this process, matched to ours by member."""

    def __init__(
        self,
        export: IpcExport,
        local: Sequence[MemberSlot],
        device: int,
        kernel: KernelChoice = "auto",
        cross_device: CrossDevice = "auto",
    ) -> None:
        if export.version != IPC_EXPORT_VERSION:
            raise IpcError(f"IPC export version {export.version} is not spoken here")
        if export.host != ipc_runtime.host_identity():
            raise IpcError(f"D runs on another host ({export.host})")
        ipc_runtime.set_device(device)
        remote = {region.name: region for region in export.regions}
        words = {slot.block_len for slot in local}
        if len(words) != 1 or min(words) % ALIGN:
            raise IpcError(f"regions of unequal or unaligned block sizes: {sorted(words)}")
        self.block_len = words.pop()
        peer_device = ipc_runtime.visible_device(export.pci_bus_id)
        reachable = peer_device is not None and ipc_runtime.can_access_peer(device, peer_device)
        self.choice: RouteChoice = choose_route(
            device, peer_device, reachable, self.block_len, cross_device
        )
        """The route this peer takes and why (`ipc_route.choose_route`)."""
        if not self.choice.ipc or peer_device is None:
            raise IpcError(f"{self.choice.reason} ({export.pci_bus_id}): NIXL carries it")
        self.peer_device = peer_device
        if peer_device != device:
            ipc_runtime.enable_peer_access(device, peer_device)
        self.words = self.block_len // 8
        for slot in local:
            region = remote.get(slot.name)
            if region is None or region.block_len != slot.block_len:
                raise IpcError(f"D has no region like {slot.name!r} ({self.block_len} B blocks)")
            if region.offset + region.block_len * region.num_blocks > export.sizes[
                region.allocation
            ] or (region.offset % ALIGN or slot.base_addr % ALIGN):
                raise IpcError(f"D's region {slot.name!r} lies outside its allocation")
        self.device = torch.device("cuda", device)
        self.ptrs: list[int] = []
        self.gather: GatherLaunches | None = None
        try:
            for handle in export.handles:
                self.ptrs.append(ipc_runtime.open_mem_handle(handle))
        except IpcError:
            self.close()
            raise
        src = [slot.base_addr for slot in local]
        dst = [self.ptrs[remote[slot.name].allocation] + remote[slot.name].offset for slot in local]
        self.local_capacity = min(slot.num_blocks for slot in local)
        self.remote_capacity = min(remote[slot.name].num_blocks for slot in local)
        src_base, dst_base = min(src), min(dst)
        self.src = _base_tensor(src_base, self.device)
        # D's addresses as a tensor of D's GPU: torch would copy a pointer of another
        # GPU's memory over to the device asked for.
        self.dst = _base_tensor(dst_base, torch.device("cuda", peer_device))
        self.src_off = torch.tensor(
            [(a - src_base) // 8 for a in src], dtype=torch.int64, device=self.device
        )
        self.dst_off = torch.tensor(
            [(a - dst_base) // 8 for a in dst], dtype=torch.int64, device=self.device
        )
        self.regions = len(local)
        self._src_addrs, self._dst_addrs = src, dst
        self._launch: Callable[..., None] | None = None
        self._stream: torch.cuda.Stream | None = None
        self.kernel: str = "triton"
        """"cuda_core", "triton", or "copy_engine" (no kernel: `route` copy_engine)."""
        self.kernel_note = ""
        """Why the cuda.core kernel is not used ("" when it is)."""
        if self.choice.route == "copy_engine":
            self.kernel = "copy_engine"
        elif kernel != "triton":
            self._open_gather(src, dst)
            if self.gather is None and kernel == "cuda_core":
                self.close()
                raise IpcError(f"kernel cuda_core asked for: {self.kernel_note}")

    def _open_gather(self, src: list[int], dst: list[int]) -> None:
        from kvhandoff.adapters.cuda.ipc_gather import GatherKernel, GatherLaunches
        from kvhandoff.adapters.cuda.runtime import CudaRuntime

        kernel = GatherKernel.load(self.device.index or 0)
        runtime = CudaRuntime.load()
        if isinstance(kernel, str) or isinstance(runtime, str):
            self.kernel_note = kernel if isinstance(kernel, str) else str(runtime)
        else:
            try:
                self.gather = GatherLaunches(kernel, runtime, src, dst, self.block_len)
                self.kernel = "cuda_core"
                return
            except Exception as exc:  # any CUDA failure: the Triton kernel still works
                self.kernel_note = f"gather launches unavailable: {exc}"
        log.warning("CUDA IPC push: %s; using the Triton kernel", self.kernel_note)

    def check_ids(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> None:
        if len(local_ids) != len(remote_ids):
            raise IpcError(f"{len(local_ids)} local blocks for {len(remote_ids)} remote ones")
        if local_ids and not (
            min(local_ids) >= 0
            and max(local_ids) < self.local_capacity
            and min(remote_ids) >= 0
            and max(remote_ids) < self.remote_capacity
        ):
            raise IpcError("a block id lies outside the regions")

    def launch(self, local_ids: list[int], remote_ids: list[int]) -> Copy:
        """One kernel for every (block, region) pair of a batch, on this peer's copy
        stream after the work enqueued so far on the device's default stream (where the
        engine wrote P's KV); returns what says when it ended (`query`, `synchronize`),
        to be given back with `retire` once its requests were completed."""
        if self.gather is not None:
            return cast("Copy", self.gather.launch(local_ids, remote_ids))
        if self.kernel == "copy_engine":
            return self._launch_copies(local_ids, remote_ids)
        return self._launch_triton(local_ids, remote_ids)

    @property
    def route(self) -> Route:
        return self.choice.route

    def _launch_copies(self, local_ids: list[int], remote_ids: list[int]) -> Copy:
        """The copy-engine route: per region, one `cudaMemcpyAsync` per run of blocks
        adjacent on both sides, on this peer's stream after the default stream."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream = self._stream
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        runs = coalesce(local_ids, remote_ids)
        size = self.block_len
        with torch.cuda.device(self.device):
            stream.wait_stream(torch.cuda.default_stream(self.device))
            handle = int(stream.cuda_stream)
            for src, dst in zip(self._src_addrs, self._dst_addrs, strict=True):
                for local, remote, n in runs:
                    ipc_runtime.memcpy_async(
                        dst + remote * size, src + local * size, n * size, handle
                    )
            event.record(stream)
        return event

    def retire(self, copy: Copy) -> None:
        """A launch ended and its requests were completed: its buffers may be reused."""
        if self.gather is not None:
            self.gather.retire(copy)

    def _launch_triton(self, local_ids: list[int], remote_ids: list[int]) -> Copy:
        if self._launch is None:
            from kvhandoff.adapters.cuda.ipc_kernel import launch

            self._launch = launch
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        stream = self._stream
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            stream.wait_stream(torch.cuda.default_stream(self.device))
            host = array("i", local_ids)
            host.extend(remote_ids)
            ids = torch.frombuffer(host, dtype=torch.int32).to(self.device, non_blocking=True)
            self._launch(self.src, self.dst, self.src_off, self.dst_off, ids, self.words)
            event.record(stream)
        return event

    def close(self) -> None:
        """Wait for this peer's launches, then unmap D's allocations; errors (D already
        gone) are logged, never raised."""
        gather, self.gather = getattr(self, "gather", None), None
        if gather is not None:
            try:
                gather.close()
            except Exception as exc:  # a broken context must not stop the unmapping
                log.warning("closing the gather launches failed: %s", exc)
        ptrs, self.ptrs = self.ptrs, []
        for ptr in ptrs:
            try:
                ipc_runtime.close_mem_handle(ptr)
            except IpcError as exc:
                log.warning("closing a CUDA IPC mapping failed: %s", exc)
