"""`kvhandoff bench push --device cuda --peer-device N`: the physical limit of the push,
a raw device-to-device copy of the pushed bytes from P's GPU (0) to D's (N) (issue 29).

Run in P's process after each rep's baseline WRITE, while P's baseline buffer holds that
rep's pattern: peer access is enabled where `cudaDeviceCanAccessPeer` allows it, then
`peer_copy_reps` copies (`cudaMemcpyPeerAsync` through cuda.bindings, or torch's
`dst.copy_(src)` where cuda.bindings is missing) into a buffer of P's own on GPU N, each
timed with CUDA events on one stream; the buffer is poisoned before and checked against
the pattern after. With N = 0 it is a copy within one GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvhandoff.bench.push_kv import baseline_pattern

if TYPE_CHECKING:
    import torch


class PeerCopy:
    """P's buffer on D's GPU, the stream and the way the copies are made."""

    def __init__(self, src: torch.Tensor, peer_device: int) -> None:
        import torch

        self.torch = torch
        self.src = src
        self.src_device = src.device.index or 0
        self.peer_device = peer_device
        self.dst = torch.empty_like(src, device=torch.device("cuda", peer_device))
        self.stream = torch.cuda.Stream(src.device)  # type: ignore[no-untyped-call]
        self.p2p = True
        self.method = "cudaMemcpyPeerAsync"
        try:
            from kvhandoff.adapters.cuda import ipc_runtime

            if peer_device != self.src_device:
                self.p2p = ipc_runtime.can_access_peer(self.src_device, peer_device)
                if self.p2p:
                    ipc_runtime.enable_peer_access(self.src_device, peer_device)
            ipc_runtime.set_device(self.src_device)
            self._runtime: Any = ipc_runtime
        except Exception:  # no cuda.bindings: torch's copy (it enables peer access itself)
            self._runtime = None
            self.method = "torch copy_"
            if peer_device != self.src_device:
                self.p2p = bool(torch.cuda.can_device_access_peer(self.src_device, peer_device))

    def _copy(self) -> None:
        nbytes = self.src.numel() * self.src.element_size()
        if self._runtime is not None:
            self._runtime.memcpy_peer_async(
                self.dst.data_ptr(),
                self.peer_device,
                self.src.data_ptr(),
                self.src_device,
                nbytes,
                int(self.stream.cuda_stream),
            )
        else:
            with self.torch.cuda.stream(self.stream):
                self.dst.copy_(self.src, non_blocking=True)

    def run(self, rep: int, copies: int) -> dict[str, Any]:
        """`copies` timed copies of P's buffer (holding rep's pattern) into GPU N's."""
        torch = self.torch
        self.dst.fill_(-1)
        torch.cuda.synchronize(self.dst.device)
        torch.cuda.synchronize(self.src.device)
        marks = []
        with torch.cuda.device(self.src.device):
            for _ in range(copies):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(self.stream)
                self._copy()
                end.record(self.stream)
                marks.append((start, end))
            self.stream.synchronize()
        seconds = [start.elapsed_time(end) / 1e3 for start, end in marks]
        pattern = baseline_pattern(self.dst.numel(), rep, self.dst.device)
        verified = bool(torch.equal(self.dst, pattern))
        return {
            "seconds": seconds,
            "verified": verified,
            "method": self.method,
            "p2p": self.p2p,
        }
