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
the defaults); on `--device cuda` these are CUDA tensors registered with NIXL as VRAM and
both processes share the one GPU. P writes a pattern derived from (rep, request, region,
block ordinal) into its blocks before each rep; D poisons its blocks before registering
them and checks every word after the timed window. The result reports the median of the
timed reps (after `warmup` untimed ones) of each measurement, and every sample.

Both processes read `time.monotonic()`, one system-wide clock on Linux.
"""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from kvhandoff.demo.launcher import RoleProcess, _pump_events, _pump_stderr, stop_all
from kvhandoff.demo.push_role import MARK

if TYPE_CHECKING:
    import torch

    from kvhandoff.adapters.nixl_agent import NixlAgent, PreppedBlocks
    from kvhandoff.adapters.push_side import PushSide
    from kvhandoff.adapters.push_writer_thread import PushWriterThread
    from kvhandoff.machines.push_scheduler import PushConnectorOutput

Device = Literal["cpu", "cuda"]

BASELINE_NOTIF = "kvhandoff-bench-baseline:"


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
    progress_thread: bool = True
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
    def pushed_bytes(self) -> int:
        return self.regions * self.requests * self.blocks_per_request * self.block_len

    def check(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if min(self.layers, self.requests, self.reps) < 1 or self.warmup < 0:
            raise ValueError("layers, requests and reps must be positive, warmup not negative")
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
    """One side's KV regions: a bf16 tensor per layer, `[2, blocks, tokens, heads, dim]`."""

    def __init__(self, cfg: PushBenchConfig, role: str, device: torch.device) -> None:
        import torch

        self.cfg = cfg
        self.torch = torch
        shape = (2, cfg.blocks, cfg.block_tokens, cfg.kv_heads, cfg.head_dim)
        self.layers = [torch.empty(shape, dtype=torch.bfloat16, device=device) for _ in range(cfg.layers)]
        self.words = cfg.block_len // 8
        self.views = [t.view(torch.int64).view(2, cfg.blocks, self.words) for t in self.layers]
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

    def regions(self) -> list[Any]:
        from kvhandoff.protocol.member_routing import LocalRegion

        return [
            LocalRegion(
                int(t[kv].data_ptr()),
                (f"model.layers.{layer}.self_attn.{'kv'[kv]}_cache",),
                self.cfg.block_len,
                self.cfg.blocks,
            )
            for layer, t in enumerate(self.layers)
            for kv in (0, 1)
        ]

    def expected(self, rep: int, region: int) -> torch.Tensor:
        """`[blocks, words]`: the words of every block of `region` in `rep`."""
        base = (((rep * 1009 + self.owner) * 257 + region) * 65537 + self.ordinal) << 13
        return base[:, None] + self.word_index[None, :]

    def fill(self, rep: int) -> None:
        for layer, view in enumerate(self.views):
            for kv in (0, 1):
                view[kv].copy_(self.expected(rep, 2 * layer + kv))

    def poison(self) -> None:
        for view in self.views:
            view.fill_(-1)

    def verify(self, rep: int) -> bool:
        torch = self.torch
        used = self.used
        for layer, view in enumerate(self.views):
            for kv in (0, 1):
                want = self.expected(rep, 2 * layer + kv)
                if not torch.equal(view[kv][used], want[used]):
                    return False
        return True


def baseline_pattern(torch_mod: Any, words: int, rep: int, device: torch.device) -> torch.Tensor:
    return torch_mod.arange(words, dtype=torch_mod.int64, device=device) + ((rep + 1) << 40)


# -- one side, in its own process -----------------------------------------------------------


def emit(event: str, **fields: Any) -> None:
    print(MARK + json.dumps({"event": event, **fields}), flush=True)


class _Side:
    """P or D: KV regions, a NIXL agent, the push side, its writer thread."""

    def __init__(self, cfg: PushBenchConfig, role: str) -> None:
        import torch

        from kvhandoff.adapters.nixl_agent import NixlAgent
        from kvhandoff.adapters.nixl_push_transport import NixlPushTransport
        from kvhandoff.adapters.push_side import PushSide
        from kvhandoff.adapters.push_writer_thread import HandshakeExecutor, PushWriterThread
        from kvhandoff.machines.push_scheduler import LocalEngine
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
        sched = self.side.scheduler
        meta = sched.build_connector_meta()
        self.side.worker.start_load_kv(meta)
        output = self.side.get_finished()
        sched.update_connector_output(output)
        return output

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
    def prepare(self, rep: int) -> None:
        self.kv.fill(rep)
        self.sync()
        emit("prepared", rep=rep)

    def go(self, rep: int) -> None:
        sched = self.side.scheduler
        todo = [(self.request_id(rep, q), blocks) for q, blocks in enumerate(self.kv.blocks)]
        pending = {rid for rid, _ in todo}
        per_step = self.cfg.finish_per_step or len(todo)
        deadline = self.deadline()
        t_first = time.monotonic()
        while pending and time.monotonic() < deadline:
            for rid, blocks in todo[:per_step]:
                sched.request_finished(rid, blocks, {"do_remote_decode": True})
            todo = todo[per_step:]
            output = self.step()
            pending -= output.finished_sending
            if pending:
                self.idle()
        emit(
            "pushed",
            rep=rep,
            t_first=t_first,
            t_sent=time.monotonic(),
            unsent=len(pending),
            **self.counters(),
        )

    def baseline_prepare(self, rep: int, remote_addr: int, nbytes: int) -> None:
        self.stop_writer()
        self.baseline.copy_(baseline_pattern(self.torch, nbytes // 8, rep, self.device))
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
        emit("baseline_sent", rep=rep, t0=t0, t_done=t_done, state=handle.state)


class _Decode(_Side):
    def __init__(self, cfg: PushBenchConfig, role: str, prefill_port: int) -> None:
        super().__init__(cfg, role)
        self.prefill_port = prefill_port

    def arm(self, rep: int) -> None:
        from kvhandoff.machines.push_d_registration import KIND as D_KIND
        from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg

        sched = self.side.scheduler
        self.kv.poison()
        self.sync()
        prefill = PrefillCoordinates("bench-prefill", "127.0.0.1", self.prefill_port, 1)
        rids = []
        for q, blocks in enumerate(self.kv.blocks):
            rid = self.request_id(rep, q)
            leg = decode_leg({"request_id": self.client_id(rep, q)}, prefill)
            sched.update_state_after_alloc(rid, blocks, leg["kv_transfer_params"])
            rids.append(rid)
        deadline = self.deadline()
        bus = self.side.bus
        pending = set(rids)
        failed: dict[str, str] = {}
        received_before_armed = 0
        while time.monotonic() < deadline:  # until every PUSH_REG has left
            output = self.step()
            received_before_armed += len(output.finished_recving)
            pending -= output.finished_recving
            failed.update(output.failed_recving)
            pending -= set(output.failed_recving)
            if not any(_unsent(bus.get(D_KIND, rid)) for rid in pending):
                break
            self.idle()
        emit("armed", rep=rep)
        t_last = time.monotonic()
        while pending and time.monotonic() < deadline:
            output = self.step()
            if output.finished_recving or output.failed_recving:
                t_last = time.monotonic()
                pending -= output.finished_recving
                failed.update(output.failed_recving)
                pending -= set(output.failed_recving)
            if pending:
                self.idle()
        self.sync()
        verified = not pending and not failed and self.kv.verify(rep)
        emit(
            "received",
            rep=rep,
            t_last=t_last,
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
        want = f"{BASELINE_NOTIF}{rep}".encode()
        emit("baseline_armed", rep=rep)
        agent = self.agent
        deadline = self.deadline()
        t_end = None
        while t_end is None and time.monotonic() < deadline:
            for _peer, message in agent.get_new_notifs():
                if message == want:
                    t_end = time.monotonic()
        self.sync()
        pattern = baseline_pattern(self.torch, nbytes // 8, rep, self.device)
        verified = t_end is not None and bool(self.torch.equal(self.baseline[: nbytes // 8], pattern))
        self.start_writer()
        emit("baseline_received", rep=rep, t_end=t_end, verified=verified)


_UNSENT = frozenset({"stashed", "in_meta", "queued", "awaiting_handshake"})


def _unsent(inst: Any) -> bool:
    """True while a D registration's PUSH_REG has not left yet."""
    return inst is not None and inst.state in _UNSENT


def child_main(argv: list[str]) -> int:
    """`python -m kvhandoff.bench_push ROLE CONFIG_JSON [PREFILL_PORT]`; commands on stdin."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    role, raw = argv[0], json.loads(argv[1])
    cfg = PushBenchConfig(**raw)
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
        for line in sys.stdin:
            cmd = json.loads(line)
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
        [sys.executable, "-m", "kvhandoff.bench_push", role, json.dumps(asdict(cfg)), *extra],
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
    framework_s: list[float] = field(default_factory=list)
    baseline_s: list[float] = field(default_factory=list)
    framework_ok: list[bool] = field(default_factory=list)
    baseline_ok: list[bool] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


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
            # framework
            prefill.send("prepare", rep=i)
            prefill.expect("prepared", timeout)
            decode.send("arm", rep=i)
            decode.expect("armed", timeout)
            prefill.send("go", rep=i)
            pushed = prefill.expect("pushed", timeout)
            received = decode.expect("received", timeout)
            fw_s = received["t_last"] - pushed["t_first"]
            fw_ok = bool(received["verified"]) and pushed["unsent"] == 0
            if not fw_ok:
                samples.notes.append(f"framework {label}: P {pushed}, D {received}")
            # baseline
            prefill.send("baseline_prepare", rep=i, remote_addr=ready_d["baseline_addr"], nbytes=nbytes)
            prefill.expect("baseline_prepared", timeout)
            decode.send("baseline_arm", rep=i, nbytes=nbytes)
            decode.expect("baseline_armed", timeout)
            prefill.send("baseline_go", rep=i)
            sent = prefill.expect("baseline_sent", timeout)
            got = decode.expect("baseline_received", timeout)
            bl_ok = bool(got["verified"]) and sent["state"] == "DONE" and got["t_end"] is not None
            bl_s = (got["t_end"] - sent["t0"]) if got["t_end"] is not None else float("nan")
            if not bl_ok:
                samples.notes.append(f"baseline {label}: P {sent}, D {got}")
            progress(
                f"push {label}: framework {nbytes / fw_s / 1e9:.2f} GB/s"
                f"{'' if fw_ok else ' (NOT VERIFIED)'}, baseline {nbytes / bl_s / 1e9:.2f} GB/s"
                f"{'' if bl_ok else ' (NOT VERIFIED)'}"
            )
            samples.framework_ok.append(fw_ok)
            samples.baseline_ok.append(bl_ok)
            if timed:
                samples.framework_s.append(fw_s)
                samples.baseline_s.append(bl_s)
        for child in children:
            child.send("quit")
        for child in children:
            child.role.proc.wait(timeout=30)
    finally:
        stop_all([c.role for c in children])
    return _result(cfg, samples, ready_p["device"])


def _result(cfg: PushBenchConfig, samples: _Samples, device: str) -> dict[str, Any]:
    nbytes = cfg.pushed_bytes
    fw_s = statistics.median(samples.framework_s)
    bl_s = statistics.median(samples.baseline_s)
    framework_gbps = nbytes / fw_s / 1e9
    baseline_gbps = nbytes / bl_s / 1e9
    return {
        "framework_gbps": round(framework_gbps, 3),
        "baseline_gbps": round(baseline_gbps, 3),
        "ratio": round(framework_gbps / baseline_gbps, 3),
        "device": device,
        "statistic": "median",
        "bytes": nbytes,
        "requests": cfg.requests,
        "regions": cfg.regions,
        "blocks_per_request": cfg.blocks_per_request,
        "block_len": cfg.block_len,
        "framework_verified": all(samples.framework_ok),
        "baseline_verified": all(samples.baseline_ok),
        "framework_samples_gbps": [round(nbytes / s / 1e9, 3) for s in samples.framework_s],
        "baseline_samples_gbps": [round(nbytes / s / 1e9, 3) for s in samples.baseline_s],
        "notes": samples.notes,
        "config": asdict(cfg),
    }


def config_for(device: Device, quick: bool) -> PushBenchConfig:
    return replace(QUICK if quick else PushBenchConfig(), device=device)


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
