"""`kvhandoff bench push`: the framework's multi-request push against one raw NIXL WRITE.

Two OS processes, P and D, each own one NIXL agent; the same two agents carry both
measurements, taken in the same run and interleaved rep by rep:

- framework: `requests` requests, each owning `blocks_per_request` blocks in every one of
  the `2 x layers` KV regions (K and V of each layer), pushed through the whole push path:
  D's scheduler/worker API and writer thread send `PUSH_REG`, P's `request_finished`
  stages the blocks, P's writer matches them, WRITEs into D's memory by descriptor index
  with the completion notif, and D's writer and main thread turn the notifs into
  `finished_recving`. Time: from just before P's first `request_finished` to D's step
  that reports the last `finished_recving`.
- baseline: one WRITE of the same number of bytes, one descriptor on each side, from a
  buffer of P's into a buffer of D's (registered by the same agents), with a completion
  notif. Time: from just before P creates the transfer to D's poll that sees the notif.

The KV regions use a real attention layout: each layer is one tensor of
`2 x blocks x block_tokens x kv_heads x head_dim` bf16 (32 KiB per block per region with
the defaults), or, with `kv_layout="cross_layer"`, one tensor whose blocks hold every
layer (see `BenchKV`); on `--device cuda` these are CUDA tensors registered with NIXL as
VRAM and both processes share the one GPU (the CLI then sets NIXL_UCX_SGL_ENABLE). P
writes a pattern derived from (rep, request, region, block ordinal) into its blocks
before each rep; D poisons its blocks before registering them and checks every word
after the timed window. The result reports the median of the timed reps (after `warmup`
untimed ones) of each measurement, every sample, and the milestones of each framework rep
(`framework_phases_ms`). With `diagnose`, two raw NIXL measurements of the framework's own
block descriptors are added (one WRITE per request; one WRITE for all), which separate
the framework's cost from NIXL's per-descriptor and per-WRITE costs.

Between commands both processes keep stepping their connector like an idle engine, so
D's PUSH_REGs reach P's writer before P finishes its requests, as in a deployment where D
registers while P computes the prefill. Both processes read `time.monotonic()`, one
system-wide clock on Linux.
"""

from __future__ import annotations

import json
import os
import secrets
import select
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from kvhandoff.demo.launcher import RoleProcess, _pump_events, _pump_stderr, stop_all
from kvhandoff.demo.push_role import MARK

if TYPE_CHECKING:
    import torch

    from kvhandoff.adapters.nixl.agent import NixlAgent, PreppedBlocks
    from kvhandoff.adapters.push_side import PushSide
    from kvhandoff.adapters.push_writer_thread import PushWriterThread
    from kvhandoff.machines.push.scheduler import PushConnectorOutput

Device = Literal["cpu", "cuda"]
KVLayout = Literal["layer", "cross_layer"]

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
    backend: str = "UCX"
    timeout_s: float = 120.0

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
        if self.blocks_per_request < 1:
            raise ValueError(f"{self.blocks} blocks cannot be shared by {self.requests} requests")


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


# -- one side, in its own process -----------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    print(MARK + json.dumps({"event": event, **fields}), flush=True)


class _Side:
    """P or D: KV regions, a NIXL agent, the push side, its writer thread."""

    def __init__(self, cfg: PushBenchConfig, role: str) -> None:
        import torch

        from kvhandoff.adapters.nixl.agent import NixlAgent
        from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
        from kvhandoff.adapters.push_side import PushSide
        from kvhandoff.adapters.push_writer_thread import HandshakeExecutor, PushWriterThread
        from kvhandoff.machines.push.scheduler import LocalEngine
        from kvhandoff.protocol.handshake import compatibility_hash
        from kvhandoff.protocol.push_config import PushConfig

        self.cfg = cfg
        self.role = role
        self.torch = torch
        self.device = torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu")
        if cfg.device == "cuda":
            torch.cuda.set_device(self.device)
        self.kv = BenchKV(cfg, role, self.device)
        self.engine_id = f"bench-{role}"
        self.agent: NixlAgent = NixlAgent(
            f"{self.engine_id}-{secrets.token_hex(4)}",
            cfg.backend,
            progress_thread=cfg.progress_thread,
        )
        self.transport = NixlPushTransport(
            self.engine_id,
            self.agent,
            self.kv.regions(),
            compatibility_hash=compatibility_hash(
                "kvhandoff-bench", "bench-model", "bfloat16", cfg.block_len
            ),
            is_decoder=role == "decode",
            mem="VRAM" if cfg.device == "cuda" else "DRAM",
            device_id=0,
        )
        # The baseline buffers are registered before the side channel serves this agent's
        # metadata, so the peer loads them with the first handshake.
        words = cfg.pushed_bytes // 8
        self.baseline = torch.empty(words, dtype=torch.int64, device=self.device)
        self.agent.register_tensor(self.baseline)
        self.server = self.transport.serve("127.0.0.1", 0)
        self.executor = HandshakeExecutor()
        self.local_engine = LocalEngine(self.engine_id, "127.0.0.1", self.server.port)
        self.side: PushSide = PushSide(
            role,  # type: ignore[arg-type]
            self.local_engine,
            self.transport,
            self.executor.submit,
            config=PushConfig(nixl_backend=cfg.backend),
        )
        self._writer_type = PushWriterThread
        self.writer: PushWriterThread | None = PushWriterThread(self.side).start()
        self.suffix = secrets.token_hex(4)
        self._baseline_descs: tuple[PreppedBlocks, PreppedBlocks] | None = None

    # engine-like helpers

    def step(self) -> PushConnectorOutput:
        return self.side.step()

    def idle(self) -> None:
        time.sleep(self.cfg.step_us / 1e6)

    def sync(self) -> None:
        if self.cfg.device == "cuda":
            self.torch.cuda.synchronize(self.device)

    def client_id(self, rep: int, q: int) -> str:
        return f"cmpl-bench{rep:04d}{q:05d}-0"

    def request_id(self, rep: int, q: int) -> str:
        return f"{self.client_id(rep, q)}-{self.suffix}"

    def stop_writer(self) -> None:
        if self.writer is not None:
            self.writer.stop()
            self.writer = None

    def start_writer(self) -> None:
        if self.writer is None:
            self.writer = self._writer_type(self.side).start()

    def close(self) -> None:
        self.stop_writer()
        self.executor.shutdown()
        self.server.close()
        self.agent.close()

    def counters(self) -> dict[str, int]:
        errors = 0 if self.writer is None else self.writer.errors
        return {
            "rejected_notifs": self.side.writer.rejected_notifs + self.side.worker.rejected_notifs,
            "failed_transfers": self.side.failed_transfers,
            "writer_errors": errors,
        }

    def deadline(self) -> float:
        return time.monotonic() + self.cfg.timeout_s


class _Prefill(_Side):
    def __init__(self, cfg: PushBenchConfig, role: str) -> None:
        super().__init__(cfg, role)
        # When each WRITE left the writer thread: the phases of a rep, for the report.
        self.posted: list[float] = []
        write_blocks = self.transport.write_blocks

        def timed_write_blocks(*args: Any, **kwargs: Any) -> Any:
            handle = write_blocks(*args, **kwargs)
            self.posted.append(time.monotonic())
            return handle

        self.transport.write_blocks = timed_write_blocks  # type: ignore[method-assign]

    def prepare(self, rep: int) -> None:
        self.kv.fill(rep)
        self.sync()
        emit("prepared", rep=rep)

    def go(self, rep: int) -> None:
        side = self.side
        todo = [(self.request_id(rep, q), blocks) for q, blocks in enumerate(self.kv.blocks)]
        pending = {rid for rid, _ in todo}
        per_step = self.cfg.finish_per_step or len(todo)
        deadline = self.deadline()
        self.posted.clear()
        t_step = 0.0
        t_first = time.monotonic()
        while pending and time.monotonic() < deadline:
            for rid, blocks in todo[:per_step]:
                side.request_finished(rid, blocks, {"do_remote_decode": True})
            todo = todo[per_step:]
            output = self.step()
            t_step = t_step or time.monotonic()
            pending -= output.finished_sending
            if pending:
                self.idle()
        emit(
            "pushed",
            rep=rep,
            t_first=t_first,
            t_sent=time.monotonic(),
            t_step=t_step,
            t_post_first=min(self.posted, default=None),
            t_post_last=max(self.posted, default=None),
            unsent=len(pending),
            **self.counters(),
        )

    def baseline_prepare(self, rep: int, remote_addr: int, nbytes: int) -> None:
        self.stop_writer()
        self.baseline.copy_(baseline_pattern(nbytes // 8, rep, self.device))
        self.sync()
        if self._baseline_descs is None:
            mem = self.transport.mem
            peer = self.transport.peer("bench-decode")
            if peer is None:
                raise RuntimeError("the baseline runs after a framework rep connected P to D")
            local = self.agent.prep_local_blocks(
                [(self.baseline.data_ptr(), nbytes, 1)],
                mem,  # type: ignore[arg-type]
            )
            remote = self.agent.prep_remote_blocks(
                peer.agent_name,
                [(remote_addr, nbytes, 1)],
                mem,  # type: ignore[arg-type]
            )
            self._baseline_descs = (local, remote)
        emit("baseline_prepared", rep=rep)

    def baseline_go(self, rep: int) -> None:
        assert self._baseline_descs is not None
        local, remote = self._baseline_descs
        agent = self.agent
        deadline = self.deadline()
        t0 = time.monotonic()
        handle = agent.write(local, [0], remote, [0], f"{BASELINE_NOTIF}{rep}".encode())
        while agent.poll(handle) == "PROC" and time.monotonic() < deadline:
            pass
        t_done = time.monotonic()
        agent.release(handle)
        self.start_writer()
        emit("baseline_sent", rep=rep, t0=t0, t_done=t_done, state=handle.xfer_status)

    def raw_go(self, rep: int, per_request: bool) -> None:
        """Diagnostic, no framework: the framework's block descriptors in raw WRITEs, either
        one WRITE per request (each with a notif) or every request's in a single WRITE."""
        transport = self.transport
        peer = transport._peer("bench-decode")  # the bench looks inside on purpose
        local_layout, remote_layout = transport._local.layout, peer.prepped.layout
        pairs = list(zip(self.kv.blocks, request_blocks(self.cfg, "decode"), strict=True))
        if not per_request:
            pairs = [([b for p, _ in pairs for b in p], [b for _, d in pairs for b in d])]
        self.stop_writer()
        agent = self.agent
        deadline = self.deadline()
        t0 = time.monotonic()
        handles = []
        for q, (local_ids, remote_ids) in enumerate(pairs):
            local_idx = local_layout.indices_for_blocks(local_ids)
            remote_idx = remote_layout.indices_for_blocks(remote_ids, regions=peer.route.regions)
            notif = f"{RAW_NOTIF}{rep}:{q}".encode()
            local = transport._local
            handles.append(agent.write(local, local_idx, peer.prepped, remote_idx, notif))
        states = set()
        for handle in handles:
            while agent.poll(handle) == "PROC" and time.monotonic() < deadline:
                pass
            states.add(handle.xfer_status)
            agent.release(handle)
        t_done = time.monotonic()
        self.start_writer()
        state = states.pop() if len(states) == 1 else "ERR"
        emit("raw_sent", rep=rep, t0=t0, t_done=t_done, state=state, writes=len(handles))


class _Decode(_Side):
    def __init__(self, cfg: PushBenchConfig, role: str, prefill_port: int) -> None:
        super().__init__(cfg, role)
        self.prefill_port = prefill_port
        # When D's writer first saw notifs after arming: the phases of a rep, for the report.
        self.t_notif_first: float | None = None
        self.watch_notifs = False
        get_new_notifs = self.transport.get_new_notifs

        def timed_get_new_notifs() -> list[tuple[str, bytes]]:
            notifs = get_new_notifs()
            if notifs and self.watch_notifs and self.t_notif_first is None:
                self.t_notif_first = time.monotonic()
            return notifs

        self.transport.get_new_notifs = timed_get_new_notifs  # type: ignore[method-assign]

    def arm(self, rep: int) -> None:
        from kvhandoff.machines.push.d_registration import D_REGISTRATION
        from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg

        side = self.side
        self.kv.poison()
        self.sync()
        prefill = PrefillCoordinates("bench-prefill", "127.0.0.1", self.prefill_port, 1)
        rids = []
        for q, blocks in enumerate(self.kv.blocks):
            rid = self.request_id(rep, q)
            leg = decode_leg({"request_id": self.client_id(rep, q)}, prefill)
            side.update_state_after_alloc(rid, blocks, leg["kv_transfer_params"])
            rids.append(rid)
        deadline = self.deadline()
        bus = side.bus
        pending = set(rids)
        failed: dict[str, str] = {}
        received_before_armed = 0
        while time.monotonic() < deadline:  # until every PUSH_REG has left
            output = self.step()
            received_before_armed += len(output.finished_recving)
            pending -= output.finished_recving
            failed.update(output.failed_recving)
            pending -= set(output.failed_recving)
            if not any(bus.has_tag(D_REGISTRATION, rid, "reg_unsent") for rid in pending):
                break
            self.idle()
        self.t_notif_first = None
        self.watch_notifs = True
        emit("armed", rep=rep)
        t_last = time.monotonic()
        t_recv_first = None
        while pending and time.monotonic() < deadline:
            output = self.step()
            if output.finished_recving or output.failed_recving:
                t_last = time.monotonic()
                t_recv_first = t_recv_first or t_last
                pending -= output.finished_recving
                failed.update(output.failed_recving)
                pending -= set(output.failed_recving)
            if pending:
                self.idle()
        self.watch_notifs = False
        self.sync()
        verified = not pending and not failed and self.kv.verify(rep)
        emit(
            "received",
            rep=rep,
            t_last=t_last,
            t_recv_first=t_recv_first,
            t_notif_first=self.t_notif_first,
            unresolved=len(pending),
            failed=len(failed),
            early=received_before_armed,
            verified=verified,
            reasons=sorted(set(failed.values()))[:3],
            **self.counters(),
        )

    def baseline_arm(self, rep: int, nbytes: int) -> None:
        self.stop_writer()  # this loop is the only consumer of notifs until it is done
        self.baseline.fill_(-1)
        self.sync()
        emit("baseline_armed", rep=rep)
        t_end = self._wait_notif(f"{BASELINE_NOTIF}{rep}".encode())
        self.sync()
        pattern = baseline_pattern(nbytes // 8, rep, self.device)
        verified = t_end is not None and bool(
            self.torch.equal(self.baseline[: nbytes // 8], pattern)
        )
        self.start_writer()
        emit("baseline_received", rep=rep, t_end=t_end, verified=verified)

    def raw_arm(self, rep: int, writes: int) -> None:
        """Diagnostic: wait for P's raw WRITEs of the framework's blocks, then check the KV."""
        self.stop_writer()
        self.kv.poison()
        self.sync()
        emit("raw_armed", rep=rep)
        t_end = self._wait_notifs({f"{RAW_NOTIF}{rep}:{q}".encode() for q in range(writes)})
        self.sync()
        verified = t_end is not None and self.kv.verify(rep)
        self.start_writer()
        emit("raw_received", rep=rep, t_end=t_end, verified=verified)

    def _wait_notif(self, want: bytes) -> float | None:
        return self._wait_notifs({want})

    def _wait_notifs(self, want: set[bytes]) -> float | None:
        """Poll NIXL notifs (the writer thread is stopped) until all of `want` arrived."""
        agent = self.agent
        deadline = self.deadline()
        missing = set(want)
        while time.monotonic() < deadline:
            for _peer, message in agent.get_new_notifs():
                missing.discard(message)
            if not missing:
                return time.monotonic()
        return None


IDLE_STEP_S = 0.001


def _commands(side: _Side) -> Iterator[dict[str, Any]]:
    """Commands from stdin, one JSON object a line; between them the engine keeps stepping.

    An idle engine still runs its connector every step (here every `IDLE_STEP_S`), so
    its writer consumes what peers send meanwhile (D's PUSH_REGs reach P's writer while P
    "prefills", as in a real deployment).
    """
    fd = sys.stdin.fileno()
    pending = b""
    while True:
        while b"\n" not in pending:
            ready, _, _ = select.select([fd], [], [], IDLE_STEP_S)
            if not ready:
                if side.writer is not None:
                    side.step()
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        if line.strip():
            yield json.loads(line)


def child_main(argv: list[str]) -> int:
    """`python -m kvhandoff.bench.push ROLE CONFIG_JSON [PREFILL_PORT]`; commands on stdin."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    role, raw = argv[0], json.loads(argv[1])
    cfg = PushBenchConfig(**raw)
    if cfg.ucx_sgl:
        os.environ["NIXL_UCX_SGL_ENABLE"] = "1"  # read when the UCX backend is created
    side: _Prefill | _Decode = (
        _Prefill(cfg, role) if role == "prefill" else _Decode(cfg, role, int(argv[2]))
    )
    device = side.torch.cuda.get_device_name(0) if cfg.device == "cuda" else "cpu"
    emit(
        "ready",
        port=side.server.port,
        baseline_addr=side.baseline.data_ptr(),
        device=device,
    )
    try:
        for cmd in _commands(side):
            op = cmd.pop("op")
            if op == "quit":
                break
            getattr(side, op)(**cmd)
    except Exception as exc:
        emit("error", detail=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        side.close()
    return 0


# -- the parent --------------------------------------------------------------------------


@dataclass
class _Child:
    role: RoleProcess

    def send(self, op: str, **fields: Any) -> None:
        stdin = self.role.proc.stdin
        assert stdin is not None
        stdin.write(json.dumps({"op": op, **fields}) + "\n")
        stdin.flush()

    def expect(self, event: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while (got := self.role.next_event(deadline)) is not None:
            if got["event"] == event:
                return got
            if got["event"] in ("exit", "error"):
                break
        tail = "\n".join(self.role.stderr_tail[-15:])
        raise RuntimeError(f"bench {self.role.name}: no {event!r} event:\n{tail}")


def _start(role: str, cfg: PushBenchConfig, *extra: str) -> _Child:
    env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"))
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvhandoff.bench.push", role, json.dumps(asdict(cfg)), *extra],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    handle = RoleProcess(role, proc)
    assert proc.stdout is not None and proc.stderr is not None
    threading.Thread(target=_pump_events, args=(proc.stdout, handle), daemon=True).start()
    threading.Thread(target=_pump_stderr, args=(proc.stderr, handle), daemon=True).start()
    return _Child(handle)


@dataclass
class _Samples:
    seconds: dict[str, list[float]] = field(default_factory=dict)
    verified: dict[str, list[bool]] = field(default_factory=dict)
    phases_ms: list[dict[str, float | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, what: str, seconds: float, ok: bool, timed: bool) -> None:
        self.verified.setdefault(what, []).append(ok)
        if timed:
            self.seconds.setdefault(what, []).append(seconds)


def _phases(pushed: dict[str, Any], received: dict[str, Any]) -> dict[str, float | None]:
    """Milestones of a framework rep in ms after P's first request_finished."""
    start = pushed["t_first"]
    marks = {
        "first_step_done": pushed["t_step"],
        "first_write_posted": pushed["t_post_first"],
        "last_write_posted": pushed["t_post_last"],
        "first_notif_at_d": received["t_notif_first"],
        "first_finished_recving": received["t_recv_first"],
        "last_finished_recving": received["t_last"],
        "all_finished_sending": pushed["t_sent"],
    }
    return {k: None if t is None else round((t - start) * 1e3, 3) for k, t in marks.items()}


def _framework_rep(
    p: _Child, d: _Child, rep: int, timeout: float, phases: list[dict[str, float | None]]
) -> tuple[float, bool, str]:
    p.send("prepare", rep=rep)
    p.expect("prepared", timeout)
    d.send("arm", rep=rep)
    d.expect("armed", timeout)
    p.send("go", rep=rep)
    pushed = p.expect("pushed", timeout)
    received = d.expect("received", timeout)
    ok = bool(received["verified"]) and pushed["unsent"] == 0
    phases.append(_phases(pushed, received))
    return received["t_last"] - pushed["t_first"], ok, f"P {pushed}, D {received}"


def _baseline_rep(
    p: _Child, d: _Child, rep: int, timeout: float, remote_addr: int, nbytes: int
) -> tuple[float, bool, str]:
    p.send("baseline_prepare", rep=rep, remote_addr=remote_addr, nbytes=nbytes)
    p.expect("baseline_prepared", timeout)
    d.send("baseline_arm", rep=rep, nbytes=nbytes)
    d.expect("baseline_armed", timeout)
    p.send("baseline_go", rep=rep)
    sent = p.expect("baseline_sent", timeout)
    got = d.expect("baseline_received", timeout)
    if got["t_end"] is None:
        return float("nan"), False, f"P {sent}, D {got}"
    ok = bool(got["verified"]) and sent["state"] == "DONE"
    return got["t_end"] - sent["t0"], ok, f"P {sent}, D {got}"


def _raw_rep(
    p: _Child, d: _Child, rep: int, timeout: float, writes: int
) -> tuple[float, bool, str]:
    """Diagnostic; P's KV still holds the pattern of this rep's framework push."""
    d.send("raw_arm", rep=rep, writes=writes)
    d.expect("raw_armed", timeout)
    p.send("raw_go", rep=rep, per_request=writes > 1)
    sent = p.expect("raw_sent", timeout)
    got = d.expect("raw_received", timeout)
    if got["t_end"] is None:
        return float("nan"), False, f"P {sent}, D {got}"
    ok = bool(got["verified"]) and sent["state"] == "DONE"
    return got["t_end"] - sent["t0"], ok, f"P {sent}, D {got}"


def run_push_bench(
    cfg: PushBenchConfig, progress: Callable[[str], None] = lambda _: None
) -> dict[str, Any]:
    """Run both measurements in one pair of processes; returns the result dict."""
    cfg.check()
    prefill = _start("prefill", cfg)
    children = [prefill]
    try:
        ready_p = prefill.expect("ready", 120.0)
        decode = _start("decode", cfg, str(ready_p["port"]))
        children.append(decode)
        ready_d = decode.expect("ready", 120.0)
        samples = _Samples()
        nbytes = cfg.pushed_bytes
        timeout = cfg.timeout_s + 30.0
        for i in range(cfg.warmup + cfg.reps):
            timed = i >= cfg.warmup
            label = f"rep {i - cfg.warmup + 1}/{cfg.reps}" if timed else "warm-up"
            runs = {
                "framework": _framework_rep(prefill, decode, i, timeout, samples.phases_ms),
                "baseline": _baseline_rep(
                    prefill, decode, i, timeout, ready_d["baseline_addr"], nbytes
                ),
            }
            if cfg.diagnose:
                runs["raw_per_request"] = _raw_rep(prefill, decode, i, timeout, cfg.requests)
                runs["raw_one_write"] = _raw_rep(prefill, decode, i, timeout, 1)
            line = []
            for what, (seconds, ok, detail) in runs.items():
                samples.add(what, seconds, ok, timed)
                if not ok:
                    samples.notes.append(f"{what} {label}: {detail}")
                flag = "" if ok else " (NOT VERIFIED)"
                line.append(f"{what} {nbytes / seconds / 1e9:.2f} GB/s{flag}")
            progress(f"push {label}: " + ", ".join(line))
        for child in children:
            child.send("quit")
        for child in children:
            child.role.proc.wait(timeout=30)
    finally:
        stop_all([c.role for c in children])
    return _result(cfg, samples, ready_p["device"])


def _result(cfg: PushBenchConfig, samples: _Samples, device: str) -> dict[str, Any]:
    nbytes = cfg.pushed_bytes
    gbps = {w: nbytes / statistics.median(t) / 1e9 for w, t in samples.seconds.items()}
    result: dict[str, Any] = {
        "framework_gbps": round(gbps["framework"], 3),
        "baseline_gbps": round(gbps["baseline"], 3),
        "ratio": round(gbps["framework"] / gbps["baseline"], 3),
        "device": device,
        "statistic": "median",
        "bytes": nbytes,
        "requests": cfg.requests,
        "regions": cfg.regions,
        "blocks_per_request": cfg.blocks_per_request,
        "block_len": cfg.block_len,
        "kv_layout": cfg.kv_layout,
        "descriptors_per_request": cfg.descriptors_per_request,
        "framework_verified": all(samples.verified["framework"]),
        "baseline_verified": all(samples.verified["baseline"]),
    }
    for what in ("raw_per_request", "raw_one_write"):
        if what in gbps:
            result[f"{what}_gbps"] = round(gbps[what], 3)
            result[f"{what}_verified"] = all(samples.verified[what])
    for what, seconds in samples.seconds.items():
        result[f"{what}_samples_gbps"] = [round(nbytes / s / 1e9, 3) for s in seconds]
    result["framework_phases_ms"] = samples.phases_ms[cfg.warmup :]
    result["notes"] = samples.notes
    result["config"] = asdict(cfg)
    return result


def config_for(device: Device, quick: bool) -> PushBenchConfig:
    """The CLI's configuration. On CUDA, NIXL's UCX scatter-gather WRITE is switched on: it
    posts a request's many block descriptors as one batched copy (see bench/RESULTS.md)."""
    return replace(QUICK if quick else PushBenchConfig(), device=device, ucx_sgl=device == "cuda")


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
