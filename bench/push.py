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
- peer copy (`--device cuda` only): the physical limit, a raw device-to-device copy of
  the same bytes from P's GPU to D's, in P's process, timed with CUDA events
  (`push_peer.py`; `peer_copy_gbps`, `ratio_vs_peer_copy`).

On CUDA, P's process uses GPU 0 and D's `peer_device` (issue 29: 0 shares P's GPU; N
puts D's KV and baseline buffer on GPU N, so every measurement crosses GPUs).

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
the framework's cost from NIXL's per-descriptor and per-WRITE costs; the CLI always adds
the first on the NIXL path (`ratio_vs_raw_per_request`).

Between commands both processes keep stepping their connector like an idle engine, so
D's PUSH_REGs reach P's writer before P finishes its requests, as in a deployment where D
registers while P computes the prefill; P finishes the rep's requests only once its writer
holds a registration for each of them (the wait is not timed). Both processes read
`time.monotonic()`, one system-wide clock on Linux.

This module is the parent; the measured configuration and KV are in `push_kv.py`, one
side's process in `push_node.py` and `push_child.py`.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvhandoff.bench.push_kv import (
    QUICK,
    Device,
    KVLayout,
    PushBenchConfig,
    TransportPath,
    check_peer_device,
)
from kvhandoff.demo.launcher import RoleProcess, _pump_events, _pump_stderr, stop_all

__all__ = ["QUICK", "Device", "KVLayout", "PushBenchConfig", "config_for", "run_push_bench"]


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


CHILD_MODULE = "kvhandoff.bench.push_child"


def _start(role: str, cfg: PushBenchConfig, child_module: str, *extra: str) -> _Child:
    env = dict(os.environ, NIXL_LOG_LEVEL=os.environ.get("NIXL_LOG_LEVEL", "WARN"))
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", child_module, role, json.dumps(asdict(cfg)), *extra],
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
    latencies_ms: list[float] = field(default_factory=list)
    counters: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    peer_copy: dict[str, Any] = field(default_factory=dict)

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
    for extra in ("t_notifs_first", "t_notifs_last"):  # a probe's child may add these
        if extra in pushed:
            marks[extra[2:]] = pushed[extra]
    return {k: None if t is None else round((t - start) * 1e3, 3) for k, t in marks.items()}


def _framework_rep(
    p: _Child, d: _Child, rep: int, timeout: float, samples: _Samples, timed: bool
) -> tuple[float, bool, str]:
    p.send("prepare", rep=rep)
    p.expect("prepared", timeout)
    d.send("arm", rep=rep)
    d.expect("armed", timeout)
    # D registers while P computes the prefill: P finishes once its writer holds them.
    p.send("await_registrations", rep=rep)
    p.expect("registrations_held", timeout)
    p.send("go", rep=rep)
    pushed = p.expect("pushed", timeout)
    received = d.expect("received", timeout)
    ok = bool(received["verified"]) and pushed["unsent"] == 0
    samples.phases_ms.append(_phases(pushed, received))
    if timed:
        # Per request: P's request_finished -> D's step that reported it finished_recving.
        for t_fin, t_recv in zip(pushed["t_finished"], received["t_received"], strict=False):
            if t_recv is not None:
                samples.latencies_ms.append((t_recv - t_fin) * 1e3)
    samples.counters = {
        k: v for k, v in pushed.items() if k.startswith(("ipc_", "nixl_", "failed_"))
    }
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


def _peer_copy_rep(p: _Child, rep: int, timeout: float, samples: _Samples, timed: bool) -> None:
    """The raw device-to-device copy, P's GPU to D's (`push_peer.py`), several per rep."""
    p.send("peer_copy", rep=rep)
    got = p.expect("peer_copied", timeout)
    for seconds in got["seconds"]:
        samples.add("peer_copy", seconds, bool(got["verified"]), timed)
    samples.peer_copy = {"method": got["method"], "p2p": got["p2p"]}
    if not got["verified"]:
        samples.notes.append(f"peer copy rep {rep}: the bytes on D's GPU differ ({got})")


def run_push_bench(
    cfg: PushBenchConfig,
    progress: Callable[[str], None] = lambda _: None,
    *,
    child_module: str = CHILD_MODULE,
) -> dict[str, Any]:
    """Run both measurements in one pair of processes; returns the result dict.
    `child_module` runs each side (a probe may substitute one built on `push_child`)."""
    cfg.check()
    prefill = _start("prefill", cfg, child_module)
    children = [prefill]
    try:
        ready_p = prefill.expect("ready", 120.0)
        decode = _start("decode", cfg, child_module, str(ready_p["port"]))
        children.append(decode)
        ready_d = decode.expect("ready", 120.0)
        samples = _Samples()
        nbytes = cfg.pushed_bytes
        timeout = cfg.timeout_s + 30.0
        for i in range(cfg.warmup + cfg.reps):
            timed = i >= cfg.warmup
            label = f"rep {i - cfg.warmup + 1}/{cfg.reps}" if timed else "warm-up"
            runs = {
                "framework": _framework_rep(prefill, decode, i, timeout, samples, timed),
                "baseline": _baseline_rep(
                    prefill, decode, i, timeout, ready_d["baseline_addr"], nbytes
                ),
            }
            if cfg.diagnose or cfg.raw_per_request:
                runs["raw_per_request"] = _raw_rep(prefill, decode, i, timeout, cfg.requests)
            if cfg.diagnose:
                runs["raw_one_write"] = _raw_rep(prefill, decode, i, timeout, 1)
            if cfg.device == "cuda":
                _peer_copy_rep(prefill, i, timeout, samples, timed)
            line = []
            for what, (seconds, ok, detail) in runs.items():
                samples.add(what, seconds, ok, timed)
                if not ok:
                    tails = [
                        f"{c.role.name}: {line}"
                        for c in children
                        for line in c.role.stderr_tail[-40:]
                    ]
                    samples.notes.append(f"{what} {label}: {detail}\n" + "\n".join(tails))
                flag = "" if ok else " (NOT VERIFIED)"
                line.append(f"{what} {nbytes / seconds / 1e9:.2f} GB/s{flag}")
            if timed and "peer_copy" in samples.seconds:
                copy_s = samples.seconds["peer_copy"][-1]
                line.append(f"peer copy {nbytes / copy_s / 1e9:.2f} GB/s")
            progress(f"push {label}: " + ", ".join(line))
        for child in children:
            child.send("quit")
        for child in children:
            child.role.proc.wait(timeout=30)
    finally:
        stop_all([c.role for c in children])
    result = _result(cfg, samples, ready_p["device"])
    result["peer_device_name"] = ready_d["device"]
    return result


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
        "transport": cfg.transport,
        "path": _path(cfg, samples.counters),
        "latency_ms": _percentiles(samples.latencies_ms),
        "p_counters": samples.counters,
        "baseline_verified": all(samples.verified["baseline"]),
    }
    for what in ("raw_per_request", "raw_one_write"):
        if what in gbps:
            result[f"{what}_gbps"] = round(gbps[what], 3)
            result[f"{what}_verified"] = all(samples.verified[what])
    result["peer_device"] = cfg.peer_device
    routes = sorted(set(samples.counters.get("ipc_routes", {}).values()))
    result["route"] = ",".join(routes) if routes else None  # the IPC route(s) opened
    if "peer_copy" in gbps:
        # The physical limit: a raw device-to-device copy of the same bytes (issue 29).
        result["peer_copy_gbps"] = round(gbps["peer_copy"], 3)
        result["ratio_vs_peer_copy"] = round(gbps["framework"] / gbps["peer_copy"], 3)
        result["baseline_ratio_vs_peer_copy"] = round(gbps["baseline"] / gbps["peer_copy"], 3)
        result["peer_copy_verified"] = all(samples.verified["peer_copy"])
        result["peer_copy_method"] = samples.peer_copy.get("method")
        result["peer_copy_p2p"] = samples.peer_copy.get("p2p")
    if "raw_per_request" in gbps:
        # The framework against raw WRITEs of its own descriptors, one per request with a
        # notif (issue 18 asks it of the NIXL-only path).
        result["ratio_vs_raw_per_request"] = round(gbps["framework"] / gbps["raw_per_request"], 3)
    for what, seconds in samples.seconds.items():
        result[f"{what}_samples_gbps"] = [round(nbytes / s / 1e9, 3) for s in seconds]
    result["framework_phases_ms"] = samples.phases_ms[cfg.warmup :]
    result["notes"] = samples.notes
    result["config"] = asdict(cfg)
    return result


def _path(cfg: PushBenchConfig, counters: dict[str, Any]) -> str:
    """The path the framework's WRITEs took in the last rep (the wrapper falls back)."""
    if cfg.transport != "cuda_ipc":
        return "nixl"
    ipc, nixl = counters.get("ipc_writes", 0), counters.get("nixl_writes", 0)
    return "cuda_ipc" if ipc and not nixl else ("mixed" if ipc else "nixl (cuda_ipc refused)")


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": at(0.50), "p99": at(0.99), "n": len(ordered)}


def config_for(
    device: Device,
    quick: bool,
    transport: str = "auto",
    requests: int | None = None,
    peer_device: int | None = None,
    device_count: Callable[[], int] | None = None,
) -> PushBenchConfig:
    """The CLI's configuration. On CUDA, NIXL's UCX scatter-gather WRITE is switched on: it
    posts a request's many block descriptors as one batched copy (see bench/RESULTS.md);
    `transport="auto"` picks the CUDA IPC wrapper on CUDA (falling back to NIXL) and NIXL
    on the CPU. `requests`: the rep's requests (its bytes are shared among them: 8 gives
    8 x 128 MiB of the default 1 GiB). `peer_device`: D's GPU (P stays on GPU 0; given, it
    needs `device="cuda"` and must be below `device_count()`, torch's count by default;
    None is GPU 0, unchecked); raises ValueError with the reason."""
    if peer_device is not None:
        if device != "cuda":
            raise ValueError("--peer-device needs --device cuda")
        check_peer_device(peer_device, (device_count or _cuda_device_count)())
    path: TransportPath = "nixl"
    if transport == "cuda_ipc" or (transport == "auto" and device == "cuda"):
        path = "cuda_ipc"
    base = QUICK if quick else PushBenchConfig()
    return replace(
        base,
        device=device,
        ucx_sgl=device == "cuda",
        transport=path,
        raw_per_request=path == "nixl",
        requests=base.requests if requests is None else requests,
        peer_device=peer_device or 0,
    )


def _cuda_device_count() -> int:
    import torch

    return int(torch.cuda.device_count())
