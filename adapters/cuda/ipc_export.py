"""What D tells a P on the same host so P can write D's KV through CUDA IPC (issue 18).

D sends its `IpcExport` to each rank of a P it connects to, as one NIXL notif prefixed
with `IPC_EXPORT_PREFIX` (the transport wrapper of either side takes it out of the notif
stream; the push machines never see it). It names D's host (hostname and boot id) and
GPU (PCI bus id), one IPC handle per device allocation and, per member region, where its
blocks sit in those allocations. P opens the handles only when host and GPU match (or
its GPU has peer access to D's) and every region agrees with D's handshake; otherwise it
keeps using NIXL.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvhandoff.adapters.cuda import ipc_runtime
from kvhandoff.protocol.member_routing import MemberSlot

IPC_EXPORT_PREFIX = b"kvhandoff-ipc1:"
IPC_EXPORT_VERSION = 1


class IpcRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One member region: block `b` is at `offset + b * block_len` of allocation
    `allocation`; `base_addr` is the address D advertised in its handshake."""

    name: str
    allocation: int
    offset: int
    block_len: int
    num_blocks: int
    base_addr: int


class IpcExport(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    version: int
    host: str
    pci_bus_id: str
    handles: tuple[bytes, ...]
    sizes: tuple[int, ...]
    regions: tuple[IpcRegion, ...]


def build_export(slots: Sequence[MemberSlot], device: int) -> IpcExport:
    """D: one IPC handle per device allocation under `slots` (raises `IpcError`)."""
    ipc_runtime.set_device(device)
    bases: dict[int, int] = {}
    handles: list[bytes] = []
    sizes: list[int] = []
    regions = []
    for slot in slots:
        base, size = ipc_runtime.allocation_range(slot.base_addr)
        if base not in bases:
            bases[base] = len(handles)
            handles.append(ipc_runtime.get_mem_handle(base))
            sizes.append(size)
        regions.append(
            IpcRegion(
                slot.name,
                bases[base],
                slot.base_addr - base,
                slot.block_len,
                slot.num_blocks,
                slot.base_addr,
            )
        )
    return IpcExport(
        IPC_EXPORT_VERSION,
        ipc_runtime.host_identity(),
        ipc_runtime.pci_bus_id(device),
        tuple(handles),
        tuple(sizes),
        tuple(regions),
    )


def encode_export(export: IpcExport) -> bytes:
    return IPC_EXPORT_PREFIX + msgspec.msgpack.encode(export)


def decode_export(message: bytes) -> IpcExport:
    """Raises `msgspec.DecodeError` / `ValidationError` on bytes that are no export."""
    return msgspec.msgpack.decode(message[len(IPC_EXPORT_PREFIX) :], type=IpcExport)
