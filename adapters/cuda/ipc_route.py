"""Which path P's WRITEs to one D rank take, decided once per peer when its CUDA IPC
export is opened (issue 29, B-12 across the GPUs of one host).

Pure: the caller asks CUDA the facts (D's GPU as this process numbers it, or None where
it is not visible here; `cudaDeviceCanAccessPeer`) and this module turns them into a
route and a reason a person can read:

- `same_device`: P and D on one GPU; the gather-scatter kernel (the one-GPU B-12 path,
  unchanged).
- `peer_kernel`: D on another GPU that P's GPU can reach peer to peer (NVLink or PCIe
  P2P); peer access is enabled (`cudaDeviceEnablePeerAccess`) and the same kernel, run
  on P's GPU, stores into D's IPC-mapped regions.
- `copy_engine`: the same peer access, but the copies are queued on the copy engine
  (`cudaMemcpyAsync` over UVA, one per run of adjacent blocks of a region) instead of a
  kernel. Chosen by "auto" only for blocks of at least `COPY_ENGINE_MIN_BLOCK` bytes,
  where each DMA is large enough to amortise its host cost; vLLM's layer layout (32 KiB
  blocks) stays on the kernel. Not yet measured on two GPUs (bench/RESULTS.md).
- `nixl`: no peer access (D's GPU not visible in this process, or no P2P between the
  two GPUs): the export is refused and NIXL's VRAM WRITE carries this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Route = Literal["same_device", "peer_kernel", "copy_engine", "nixl"]
CrossDevice = Literal["auto", "kernel", "copy_engine"]
"""How a cross-device peer with peer access copies: "kernel", "copy_engine", or "auto"
(the copy engine for blocks of at least `COPY_ENGINE_MIN_BLOCK` bytes, else the kernel)."""

CROSS_DEVICE_CHOICES: tuple[CrossDevice, ...] = ("auto", "kernel", "copy_engine")
COPY_ENGINE_MIN_BLOCK = 1 << 20


@dataclass(frozen=True, slots=True)
class RouteChoice:
    route: Route
    reason: str

    @property
    def ipc(self) -> bool:
        """Whether the export is opened (any route but NIXL)."""
        return self.route != "nixl"


def choose_route(
    device: int,
    peer_device: int | None,
    can_access_peer: bool,
    block_len: int,
    cross_device: CrossDevice = "auto",
) -> RouteChoice:
    """The route of a D rank whose KV lives on `peer_device` (None: not visible here),
    seen from P's `device`."""
    if cross_device not in CROSS_DEVICE_CHOICES:
        raise ValueError(
            f"cross_device must be one of {CROSS_DEVICE_CHOICES}, got {cross_device!r}"
        )
    if peer_device is None:
        return RouteChoice(
            "nixl", f"D's GPU is not visible from this process (GPU {device}): no peer access"
        )
    if peer_device == device:
        return RouteChoice("same_device", f"P and D share GPU {device}")
    if not can_access_peer:
        return RouteChoice(
            "nixl",
            f"GPU {device} has no peer access to D's GPU {peer_device} (cudaDeviceCanAccessPeer)",
        )
    if cross_device == "copy_engine":
        return RouteChoice(
            "copy_engine", f"GPU {device} -> GPU {peer_device}: copy engine asked for"
        )
    if cross_device == "kernel":
        return RouteChoice("peer_kernel", f"GPU {device} -> GPU {peer_device}: kernel asked for")
    if block_len >= COPY_ENGINE_MIN_BLOCK:
        return RouteChoice(
            "copy_engine",
            f"GPU {device} -> GPU {peer_device}: blocks of {block_len} B >= "
            f"{COPY_ENGINE_MIN_BLOCK} B, one DMA each",
        )
    return RouteChoice(
        "peer_kernel",
        f"GPU {device} -> GPU {peer_device}: blocks of {block_len} B < "
        f"{COPY_ENGINE_MIN_BLOCK} B, one kernel per pass",
    )


def coalesce(local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int, int]]:
    """`(local_first, remote_first, count)` runs of block pairs adjacent on both sides, in
    order: the copy engine moves each run of a region as one DMA."""
    runs: list[tuple[int, int, int]] = []
    for local, remote in zip(local_ids, remote_ids, strict=True):
        if runs:
            l0, r0, n = runs[-1]
            if local == l0 + n and remote == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((local, remote, 1))
    return runs
