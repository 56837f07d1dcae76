"""`kvhandoff run producer|consumer`: one encoder-cache P2P instance with an engine-like loop.

The producer "encodes" (fills an encoder output with an `mm_hash`-specific pattern),
saves it into its `/dev/shm` region and publishes its `ec_transfer_params` from
`request_finished`. The consumer takes each request with the producer's publications
(relayed on stdin by an orchestrator, or built from the seeded list and `--peer`), pulls
the encodings over ZMQ + NIXL READ, loads them into its encoder cache and verifies every
byte; an encoding it cannot pull it encodes locally, and verifies that too.

Both derive the same request list from `--seed`. Two requests play the protocol's
detours when there are at least two:

- request 0 is published and then evicted by the producer (an unpublished encoding
  needs the room), which announces it (`evicted`, B-01); an orchestrator that relays
  the stale publication anyway gets a `NACK_MISSING`, and the consumer encodes locally;
- request 1 is published before its save has landed (a slow save): the producer holds
  its end event until it has answered `NACK_NOT_READY` for it (or `HOLD_MAX_S` passed),
  so the consumer retries and then reads it.

Events go to stdout as `@@ <json>` lines. Lines on stdin: `go` (with `--wait-go`),
`stop`, and JSON objects: a consumer leg `{"client", "mm_hash", "tokens", "params"}`
(also a producer's `finished` event line as it printed it), or producer commands
`{"op": "encode", "client", "mm_hash", "tokens", "hold", "publish"}` (`hold`: true, or
the most seconds to hold the save back waiting for a NACK_NOT_READY),
`{"op": "release"}` (held saves land), `{"op": "status"}`, `{"op": "stop"}`. A role ends
at `stop`, at the end of stdin, or at `--deadline`; it settles first (held saves land,
grants end with their XferDone or pin lease, reads with their quarantine) and its summary
counts what is left (`ec_audit`), with its resident memory.

For soaks: `--step-ms` paces each engine step, `--faults` with `--fault-seed` injects
seeded faults (`adapters/ec_fault_injection.py`), and `ec_cpu_bytes` in `--config` sizes
the tier (a small one evicts under pressure).

The requests and encodings live in `ec_requests`, the loops in `ec_producer` and
`ec_consumer`, what they share in `ec_loop`; this module wires a role and runs it.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch

from kvhandoff.adapters.ec_copy_cpu import CpuCopyEngine
from kvhandoff.adapters.ec_fault_injection import ECFaultPlan, ECFaults, FaultyECSide
from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.adapters.trace import apply_trace_config
from kvhandoff.demo.ec_audit import audit
from kvhandoff.demo.ec_consumer import ConsumerLoop
from kvhandoff.demo.ec_loop import ECRoleOptions, SaveGate, Stdin, transfer_config
from kvhandoff.demo.ec_producer import ProducerLoop
from kvhandoff.demo.ec_requests import BLOCK_BYTES, COMPAT, HIDDEN, ec_demo_requests, region_blocks
from kvhandoff.demo.push_role import emit, rss_mb
from kvhandoff.protocol.ec_config import EXTRA_CONFIG_KEYS, ECLayout

__all__ = ["ECRoleOptions", "main_from_args", "run_ec_role"]


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)  # unwinds through `close()`: the region is unlinked


def _side_class(opts: ECRoleOptions) -> tuple[Callable[..., ECSide], ECFaults]:
    faults = ECFaults(ECFaultPlan.parse(opts.faults), opts.fault_seed)
    if not faults.plan.any:
        return ECSide, faults
    return functools.partial(FaultyECSide, faults=faults), faults


def run_ec_role(opts: ECRoleOptions) -> int:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    torch.set_num_threads(1)
    signal.signal(signal.SIGTERM, _on_sigterm)
    requests = ec_demo_requests(opts.requests, opts.seed)
    num_blocks = region_blocks(requests, opts.extra)
    layout = ECLayout(HIDDEN, 2, num_blocks * BLOCK_BYTES)
    stdin = Stdin()
    gate = SaveGate()
    loop: ProducerLoop | ConsumerLoop
    side_class, faults = _side_class(opts)
    side = side_class(
        transfer_config(opts, num_blocks),
        layout,
        compat_hash=COMPAT,
        listen=(opts.listen_host, opts.listen_port) if opts.role == "producer" else None,
        advertise_host=opts.advertise_host,
        machine_config=opts.machine,
        copy_engine_factory=lambda region, size: CpuCopyEngine(region, size, release=gate.may_land),
    )
    try:
        emit(
            "ready",
            role=opts.role,
            engine_id=opts.engine_id,
            port=side.publish_port,
            region=side.region_path,
            reaped=side.reaped,
            pid=os.getpid(),
        )
        deadline = time.monotonic() + opts.deadline_s
        if opts.wait_go and not stdin.wait_go(deadline):
            emit("summary", role=opts.role, unresolved=0, stopped_before_go=True)
            return 0
        if opts.role == "producer":
            loop = ProducerLoop(side, opts, requests, stdin, deadline, gate, faults)
        else:
            loop = ConsumerLoop(side, opts, requests, stdin, deadline)
        summary = loop.run()
        summary.update(audit(side), counters=side.counters(), injected=dict(faults.injected))
    finally:
        side.close()
    emit("summary", **summary, rss_mb_start=loop.rss_start, rss_mb=rss_mb())
    return 0 if summary.get("unresolved", 0) == 0 else 1


def _split(address: str | None, default_host: str) -> tuple[str, int]:
    host, _, port = (address or ":0").rpartition(":")
    return (host.strip("[]") or default_host), int(port or 0)


def main_from_args(args: Any) -> int:
    """`kvhandoff run producer|consumer`; ends the process when the role is done."""
    listen_host, listen_port = _split(args.listen, "127.0.0.1")
    peer_host, peer_port = _split(args.peer, "127.0.0.1")
    overrides = json.loads(args.config)
    if not isinstance(overrides, dict):
        print("--config must be a JSON object", file=sys.stderr)
        return 2
    overrides = apply_trace_config(overrides)  # trace, trace_max_bytes, trace_backups
    extra = {k: v for k, v in overrides.items() if k in EXTRA_CONFIG_KEYS}
    machine = {k: float(v) for k, v in overrides.items() if k not in EXTRA_CONFIG_KEYS}
    relay = bool(getattr(args, "relay", False))
    if args.role == "consumer" and not relay and not peer_port:
        print(
            "kvhandoff run consumer needs --peer HOST:PORT (the producer's side channel), "
            "or --relay to take publications on stdin",
            file=sys.stderr,
        )
        return 2
    opts = ECRoleOptions(
        role=args.role,
        engine_id=args.engine_id or f"{args.role}-{secrets.token_hex(4)}",
        listen_host=listen_host,
        listen_port=listen_port,
        advertise_host=getattr(args, "advertise_host", None),
        peer_host=peer_host,
        peer_port=peer_port,
        requests=args.requests,
        seed=args.seed,
        backend=args.backend,
        deadline_s=args.deadline,
        per_step=args.per_step,
        extra=extra,
        machine=machine,
        wait_go=args.wait_go,
        relay=relay,
        step_ms=float(getattr(args, "step_ms", 0.0)),
        faults=getattr(args, "faults", ""),
        fault_seed=int(getattr(args, "fault_seed", 0)),
    )
    code = run_ec_role(opts)
    # Everything was closed explicitly (the region unlinked, the agent and sockets closed);
    # skip the interpreter teardown, which takes about a second with torch loaded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
