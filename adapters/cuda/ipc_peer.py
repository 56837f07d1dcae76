"""P's side of one D rank's KV opened through CUDA IPC (issue 18): the mapped
allocations, the per-region offset tables (uploaded once), one gather-scatter launch per
batch, and the unmapping when D goes away.

Imported lazily by `ipc_transport.py` (it imports torch, and the kernel module imports
Triton) once a D on the same host has sent its export.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvhandoff.adapters.cuda import ipc_runtime
from kvhandoff.adapters.cuda.ipc_export import IPC_EXPORT_VERSION, IpcExport
from kvhandoff.adapters.cuda.ipc_runtime import IpcError
from kvhandoff.protocol.member_routing import MemberSlot

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger(__name__)

ALIGN = 16


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

    def __init__(self, export: IpcExport, local: Sequence[MemberSlot], device: int) -> None:
        if export.version != IPC_EXPORT_VERSION:
            raise IpcError(f"IPC export version {export.version} is not spoken here")
        if export.host != ipc_runtime.host_identity():
            raise IpcError(f"D runs on another host ({export.host})")
        ipc_runtime.set_device(device)
        peer_device = ipc_runtime.device_by_pci_bus_id(export.pci_bus_id)
        if not ipc_runtime.can_access_peer(device, peer_device):
            raise IpcError(f"GPU {device} has no peer access to D's GPU {export.pci_bus_id}")
        remote = {region.name: region for region in export.regions}
        words = {slot.block_len for slot in local}
        if len(words) != 1 or min(words) % ALIGN:
            raise IpcError(f"regions of unequal or unaligned block sizes: {sorted(words)}")
        self.block_len = words.pop()
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
        self.dst = _base_tensor(dst_base, self.device)
        self.src_off = torch.tensor(
            [(a - src_base) // 8 for a in src], dtype=torch.int64, device=self.device
        )
        self.dst_off = torch.tensor(
            [(a - dst_base) // 8 for a in dst], dtype=torch.int64, device=self.device
        )
        self.regions = len(local)
        self._launch: Callable[..., None] | None = None

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

    def launch(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> None:
        """One kernel on the current stream for every (block, region) pair of a batch."""
        if self._launch is None:
            from kvhandoff.adapters.cuda.ipc_kernel import launch

            self._launch = launch
        host = array("i", local_ids)
        host.extend(remote_ids)
        ids = torch.frombuffer(host, dtype=torch.int32).to(self.device, non_blocking=True)
        self._launch(self.src, self.dst, self.src_off, self.dst_off, ids, self.words)

    def close(self) -> None:
        """Unmap D's allocations; errors (D already gone) are logged, never raised."""
        ptrs, self.ptrs = self.ptrs, []
        for ptr in ptrs:
            try:
                ipc_runtime.close_mem_handle(ptr)
            except IpcError as exc:
                log.warning("closing a CUDA IPC mapping failed: %s", exc)
