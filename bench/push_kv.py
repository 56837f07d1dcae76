"""`kvhandoff bench push`: what is measured — the configuration, each request's blocks,
and the KV cache each side holds with the patterns written and checked in it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kvhandoff.adapters.cuda.ipc_route import CROSS_DEVICE_CHOICES

if TYPE_CHECKING:
    import torch

Device = Literal["cpu", "cuda"]
KVLayout = Literal["layer", "cross_layer"]
TransportPath = Literal["nixl", "cuda_ipc"]

BASELINE_NOTIF = "kvhandoff-bench-baseline:"
RAW_NOTIF = "kvhandoff-bench-raw:"


@dataclass(frozen=True, slots=True)
class PushBenchConfig:
    """One benchmark run; the defaults make a 1 GiB KV pool (32 layers, 512 blocks)."""

    device: Device = "cpu"
    layers: int = 32
    blocks: int = 512
    """Blocks per region; `requests * blocks_per_request` of them are pushed per rep."""
    requests: int = 32
    block_tokens: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    reps: int = 5
    warmup: int = 1
    step_us: float = 50.0
    """How long an idle engine step waits before the next one (P and D)."""
    finish_per_step: int = 0
    """Requests P finishes per engine step; 0: all of them in the first step."""
    scattered: bool = False
    """Give each request a random set of blocks instead of one contiguous run per side."""
    kv_layout: KVLayout = "layer"
    """"layer": a K and a V region per layer; "cross_layer": one region, blocks span layers."""
    progress_thread: bool = True
    ucx_sgl: bool = False
    """Set NIXL_UCX_SGL_ENABLE=1 in both processes: NIXL posts a multi-descriptor WRITE
    as one scatter-gather request instead of one UCX put per descriptor."""
    diagnose: bool = False
    """Also time, without the framework, raw WRITEs of the same block descriptors: one per
    request (`raw_per_request`) and one for all requests (`raw_one_write`)."""
    raw_per_request: bool = False
    """Also time raw WRITEs of the framework's block descriptors, one per request with its
    notif (`raw_per_request`, without `raw_one_write`): the NIXL-only path's own baseline."""
    backend: str = "UCX"
    timeout_s: float = 120.0
    nixl_post_every: int = 0
    """NIXL path: queued WRITEs per D rank posted at once, before the writer pass ends
    (`WriteBatcher.post_every`; 0: all of a pass in one transfer when it ends)."""
    ipc_launch_every: int = 0
    """cuda_ipc: queued WRITEs per D rank that launch a kernel from the writer at once
    (0: all of a writer pass in one launch, when the pass ends)."""
    ipc_poll_us: float = 100.0
    """cuda_ipc: how soon P's writer asks a running launch's event again."""
    ipc_wait: bool = True
    """cuda_ipc: P's writer waits for its running launches at the end of each pass."""
    ipc_kernel: str = "auto"
    """cuda_ipc: the gather-scatter kernel, "cuda_core", "triton" or "auto" (cuda_core
    where it loads)."""
    transport: TransportPath = "nixl"
    """"cuda_ipc": wrap the NIXL transport in `IpcPushTransport` (same-host WRITEs by one
    CUDA IPC gather-scatter kernel per writer pass, NIXL for the rest and the baseline)."""
    peer_device: int = 0
    """cuda: the GPU that D's process keeps its KV and baseline buffer on (P stays on GPU
    0); 0 is P and D sharing one GPU (issue 29)."""
    ipc_cross_device: str = "auto"
    """cuda_ipc with D on another GPU: "kernel", "copy_engine" or "auto"
    (`ipc_route.choose_route`)."""
    peer_copy_reps: int = 3
    """cuda: raw device-to-device copies of the pushed bytes, P's GPU to D's, timed with
    CUDA events after each rep's baseline (`peer_copy_gbps`, the median of all)."""

    @property
    def block_len(self) -> int:
        return self.block_tokens * self.kv_heads * self.head_dim * 2  # bf16

    @property
    def regions(self) -> int:
        return 2 * self.layers

    @property
    def blocks_per_request(self) -> int:
        return self.blocks // self.requests

    @property
    def descriptors_per_request(self) -> int:
        """Block descriptors a WRITE names, before NIXL merges adjacent ones."""
        per_block = 1 if self.kv_layout == "cross_layer" else self.regions
        return per_block * self.blocks_per_request

    @property
    def pushed_bytes(self) -> int:
        return self.regions * self.requests * self.blocks_per_request * self.block_len

    def check(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if min(self.layers, self.requests, self.reps) < 1 or self.warmup < 0:
            raise ValueError("layers, requests and reps must be positive, warmup not negative")
        if self.kv_layout not in ("layer", "cross_layer"):
            raise ValueError(f"kv_layout must be layer or cross_layer, got {self.kv_layout!r}")
        if self.transport not in ("nixl", "cuda_ipc"):
            raise ValueError(f"transport must be nixl or cuda_ipc, got {self.transport!r}")
        if self.transport == "cuda_ipc" and self.device != "cuda":
            raise ValueError("the cuda_ipc transport needs --device cuda")
        if self.blocks_per_request < 1:
            raise ValueError(f"{self.blocks} blocks cannot be shared by {self.requests} requests")
        if self.peer_device < 0:
            raise ValueError(f"--peer-device must not be negative, got {self.peer_device}")
        if self.peer_device and self.device != "cuda":
            raise ValueError("--peer-device needs --device cuda")
        if self.ipc_cross_device not in CROSS_DEVICE_CHOICES:
            raise ValueError(
                f"ipc_cross_device must be one of {CROSS_DEVICE_CHOICES}, "
                f"got {self.ipc_cross_device!r}"
            )
        if self.peer_copy_reps < 1:
            raise ValueError("peer_copy_reps must be positive")


def check_peer_device(peer_device: int, device_count: int) -> None:
    """D's GPU must be one this process sees (`torch.cuda.device_count()`)."""
    if device_count < 1:
        raise ValueError(f"--peer-device {peer_device}: torch sees no CUDA GPU here")
    if not 0 <= peer_device < device_count:
        raise ValueError(
            f"--peer-device {peer_device}: this process sees {device_count} CUDA GPU"
            f"{'s' if device_count != 1 else ''} (0..{device_count - 1}); D's GPU must be one"
        )


QUICK = PushBenchConfig(layers=2, blocks=32, requests=4, reps=2, warmup=1, timeout_s=60.0)


# -- block assignment and patterns ---------------------------------------------------------


def request_blocks(cfg: PushBenchConfig, role: str) -> list[list[int]]:
    """Each request's block ids on one side; P and D use different blocks on purpose."""
    n, count = cfg.blocks_per_request, cfg.requests
    if cfg.scattered:
        import random

        order = list(range(cfg.blocks))
        random.Random(1 if role == "prefill" else 2).shuffle(order)
        return [order[q * n : (q + 1) * n] for q in range(count)]
    if role == "prefill":
        return [list(range(q * n, (q + 1) * n)) for q in range(count)]
    return [list(range((count - 1 - q) * n, (count - q) * n)) for q in range(count)]


class BenchKV:
    """One side's KV cache, bf16, in one of two layouts (`PushBenchConfig.kv_layout`).

    - "layer": a tensor per layer, `[2, blocks, tokens, heads, dim]` (K then V); every
      layer's K and V is a region of its own, `2 x layers` regions of `block_len` bytes.
    - "cross_layer": one tensor `[blocks, layers, 2, tokens, heads, dim]`: a block holds
      every layer's K and V, so the cache is one region whose blocks are
      `2 x layers x block_len` bytes.

    `region(r)` is the `[blocks, words]` int64 view of K/V region `r = 2 * layer + kv`
    either way; patterns are written and checked through it.
    """

    def __init__(self, cfg: PushBenchConfig, role: str, device: torch.device) -> None:
        import torch

        self.cfg = cfg
        self.torch = torch
        self.words = cfg.block_len // 8
        per_block = (cfg.block_tokens, cfg.kv_heads, cfg.head_dim)
        if cfg.kv_layout == "cross_layer":
            whole_shape = (cfg.blocks, cfg.layers, 2, *per_block)
            self.tensors = [torch.empty(whole_shape, dtype=torch.bfloat16, device=device)]
            whole = self.tensors[0].view(torch.int64).view(cfg.blocks, cfg.regions, self.words)
            self._regions = [whole[:, r] for r in range(cfg.regions)]
        else:
            shape = (2, cfg.blocks, *per_block)
            self.tensors = [
                torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(cfg.layers)
            ]
            self._regions = [
                t.view(torch.int64).view(2, cfg.blocks, self.words)[kv]
                for t in self.tensors
                for kv in (0, 1)
            ]
        self.blocks = request_blocks(cfg, role)
        owner = torch.full((cfg.blocks,), -1, dtype=torch.int64)
        ordinal = torch.zeros(cfg.blocks, dtype=torch.int64)
        for q, ids in enumerate(self.blocks):
            owner[ids] = q
            ordinal[ids] = torch.arange(len(ids), dtype=torch.int64)
        self.used = (owner >= 0).to(device)
        self.owner = owner.to(device)
        self.ordinal = ordinal.to(device)
        self.word_index = torch.arange(self.words, dtype=torch.int64, device=device)

    def region(self, r: int) -> torch.Tensor:
        return self._regions[r]

    def regions(self) -> list[Any]:
        """The `LocalRegion`s the push transport registers and describes."""
        from kvhandoff.protocol.member_routing import LocalRegion

        cfg = self.cfg
        if cfg.kv_layout == "cross_layer":
            base = int(self.tensors[0].data_ptr())
            return [LocalRegion(base, ("model.kv_cache",), cfg.regions * cfg.block_len, cfg.blocks)]
        return [
            LocalRegion(
                int(t[kv].data_ptr()),
                (f"model.layers.{layer}.self_attn.{'kv'[kv]}_cache",),
                cfg.block_len,
                cfg.blocks,
            )
            for layer, t in enumerate(self.tensors)
            for kv in (0, 1)
        ]

    def expected(self, rep: int, region: int) -> torch.Tensor:
        """`[blocks, words]`: the words of every block of `region` in `rep`."""
        base = (((rep * 1009 + self.owner) * 257 + region) * 65537 + self.ordinal) << 13
        return base[:, None] + self.word_index[None, :]

    def fill(self, rep: int) -> None:
        for r in range(self.cfg.regions):
            self.region(r).copy_(self.expected(rep, r))

    def poison(self) -> None:
        for t in self.tensors:
            t.view(self.torch.int64).fill_(-1)

    def verify(self, rep: int) -> bool:
        used = self.used
        for r in range(self.cfg.regions):
            if not self.torch.equal(self.region(r)[used], self.expected(rep, r)[used]):
                return False
        return True


def baseline_pattern(words: int, rep: int, device: torch.device) -> torch.Tensor:
    """The baseline buffer's words in `rep`: never zero, different in every rep."""
    import torch

    return torch.arange(words, dtype=torch.int64, device=device) + ((rep + 1) << 40)
