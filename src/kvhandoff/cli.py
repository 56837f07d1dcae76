"""Command-line entry point: `kvhandoff <command>`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvhandoff.proxy import Proxy

TRACE_HELP = "write each process's transition trace into DIR (check it with check-trace)"


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cmd_diagrams(args: argparse.Namespace) -> int:
    from kvhandoff.specs import stale_specs, write_specs
    from kvhandoff.specs_svg import check_svgs, publish_svgs, stale_svgs

    out = Path(args.out)
    if args.journey:
        from kvhandoff.tracecheck.journey import journey_command

        return journey_command(args.journey, args.request)
    if args.svg:
        problems = check_svgs(Path(args.svg))
        for problem in problems:
            print(f"diagram: {problem}")
        for path in [] if problems else publish_svgs(Path(args.svg), out):
            print(f"wrote {path}")
        return 1 if problems else 0
    if args.check:
        stale = stale_specs(out)
        for name in stale:
            print(f"stale: {out / name} (run `kvhandoff diagrams`)")
        svgs = stale_svgs(out)
        for name in svgs:
            print(f"stale: {out / name} (run `make docs`)")
        return 1 if stale or svgs else 0
    for name in write_specs(out):
        print(f"wrote {out / name}")
    return 0


def _cmd_check_trace(args: argparse.Namespace) -> int:
    from kvhandoff.tracecheck.cli import run_check

    return run_check(args.files, verbose=args.verbose)


def _cmd_bench_latency(args: argparse.Namespace) -> int:
    from kvhandoff.bench.latency import run_latency_bench

    result = run_latency_bench(args.requests, 1 if args.quick else 2, _progress)
    if not args.json:
        for mode, numbers in result.items():
            print(
                f"{mode}: P finish -> D receive p50 {numbers['p50_ms']} ms, "
                f"p99 {numbers['p99_ms']} ms, {numbers['gbps']} GB/s"
            )
    print(json.dumps(result) if args.json else "")
    return 0


def _cmd_bench_ec(args: argparse.Namespace) -> int:
    from kvhandoff.bench.ec import config_for, print_summary, run_ec_bench

    result = run_ec_bench(config_for(args.device, args.quick, args.blocks), _progress)
    if not args.json:
        print_summary(result)
    print(json.dumps(result) if args.json else "")
    return 0 if result["verified"] else 1


def _cmd_bench_vllm(args: argparse.Namespace) -> int:
    from kvhandoff.integrations.vllm.bench import run_vllm_bench

    try:
        result = run_vllm_bench(
            requests=args.vllm_requests,
            steps=10 if args.quick else 200,
            rounds=1 if args.quick else 3,
            progress=_progress,
        )
    except RuntimeError as exc:
        print(f"kvhandoff bench vllm: {exc}", file=sys.stderr)
        return 2
    if not args.json:
        print(f"kvhandoff connector: {result['kvhandoff_us_per_step']} us/step")
        print(f"vLLM NixlPushConnector: {result['vllm_us_per_step']} us/step")
        print(f"ratio: {result['ratio']}")
    print(json.dumps(result) if args.json else "")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "ec":
        return _cmd_bench_ec(args)
    if args.what == "latency":
        return _cmd_bench_latency(args)
    if args.what == "dispatch":
        from kvhandoff.bench.dispatch import run_dispatch_bench

        result = run_dispatch_bench(_progress, quick=args.quick, trace=args.trace or "")
        if not args.json:
            for name, value in result["per_event_ns"].items():
                print(f"{name:>12}: {value:8.1f} ns/event")
            for name, value in result["ratios"].items():
                print(f"{name:>28}: {value}")
            print(f"bytes per live instance: {result['bytes_per_instance']}")
        print(json.dumps(result) if args.json else "")
        return 0
    if args.what == "vllm":
        return _cmd_bench_vllm(args)
    if args.what == "push":
        from kvhandoff.bench.push import config_for, run_push_bench

        try:
            config = config_for(
                args.device, args.quick, args.transport, args.push_requests, args.peer_device
            )
        except ValueError as exc:
            raise SystemExit(f"kvhandoff bench push: {exc}") from None
        push = run_push_bench(config, _progress)
        for note in push["notes"]:
            print(f"push bench: {note}", file=sys.stderr)
        ok = push["framework_verified"] and push["baseline_verified"]
        ok = ok and push.get("peer_copy_verified", True)
        if not args.json:
            print(
                f"push on {push['device']}: {push['bytes'] / 2**20:.0f} MiB as "
                f"{push['requests']} requests x {push['regions']} regions x "
                f"{push['blocks_per_request']} blocks of {push['block_len']} B"
            )
            print(f"framework: {push['framework_gbps']} GB/s (median, path {push['path']})")
            print(f" baseline: {push['baseline_gbps']} GB/s (median, one descriptor)")
            print(f"    ratio: {push['ratio']}{'' if ok else '  (bytes NOT verified)'}")
            if "peer_copy_gbps" in push:
                print(
                    f"peer copy: {push['peer_copy_gbps']} GB/s (median, GPU 0 -> GPU "
                    f"{push['peer_device']}, {push['peer_copy_method']}); ratio "
                    f"{push['ratio_vs_peer_copy']}, route {push['route']}"
                )
        print(json.dumps(push) if args.json else "")
        return 0 if ok else 1
    raise SystemExit(f"unknown benchmark {args.what!r}")


def _cmd_run(args: argparse.Namespace) -> int:
    if args.role in ("prefill", "decode"):
        from kvhandoff.demo.push_role import main_from_args

        return main_from_args(args)
    if args.role in ("producer", "consumer"):
        from kvhandoff.demo.ec_role import main_from_args as ec_main

        return ec_main(args)
    raise SystemExit(f"role {args.role!r} is not available yet")


def _trace_to(directory: str | None) -> None:
    """Every role process started from here traces into `directory` (KVHANDOFF_TRACE)."""
    if directory:
        from kvhandoff.adapters.trace import ENV, ENV_RUN

        path = Path(directory).resolve()
        path.mkdir(parents=True, exist_ok=True)
        os.environ[ENV] = str(path)
        os.environ.setdefault(ENV_RUN, f"{os.getpid()}-{os.urandom(4).hex()}")


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvhandoff.demo.push_demo import run_push_demo

    _trace_to(args.trace)
    results: dict[str, object] = {}
    ok = True
    line = []
    modes = {"all": ("push", "pull", "ec")}.get(args.what, (args.what,))
    ec_demo = None
    if "ec" in modes:  # its roles start up (torch, NIXL) while the other demos run
        from kvhandoff.demo.ec_demo import ECDemo

        ec_demo = ECDemo(args.requests, args.seed, args.backend)
    for mode in ("push", "pull"):
        if mode not in modes:
            continue
        run = run_push_demo(args.requests, args.seed, args.backend, mode=mode)
        for failure in run["failures"]:
            print(f"{mode} failure: {failure}", file=sys.stderr)
        ok &= run["verified"] == args.requests
        if not args.json:
            print(
                f"{mode}: {run['verified']}/{args.requests} verified, "
                f"P finish -> D receive p50 {run['p50_ms']} ms, p99 {run['p99_ms']} ms, "
                f"{run['gbps']} GB/s"
            )
        results[mode] = {k: run[k] for k in ("requests", "verified", "p50_ms", "p99_ms", "gbps")}
        line.append(f"{mode} {run['verified']}/{args.requests} verified")
    if ec_demo is not None:
        from kvhandoff.demo.ec_demo import EC_KEYS

        ec = ec_demo.run()
        for failure in ec["failures"]:
            print(f"ec failure: {failure}", file=sys.stderr)
        served = ec["served_p2p"] + ec["fallback_local"]
        ok &= not ec["failures"] and ec["verified"] == served == args.requests
        if not args.json:
            print(
                f"ec: {ec['verified']}/{args.requests} verified, {ec['served_p2p']} pulled "
                f"over NIXL READ ({ec['retried_not_ready']} after NACK_NOT_READY), "
                f"{ec['fallback_local']} encoded locally after a NACK"
            )
        results["ec"] = {k: ec[k] for k in EC_KEYS}
        line.append(f"ec {ec['verified']}/{args.requests} served")
    if args.json:
        print(json.dumps(results))
    elif ok:
        print("demo ok: " + ", ".join(line))
    return 0 if ok else 1


def _cmd_simulate(args: argparse.Namespace) -> int:
    from kvhandoff.sim.run import main_from_args

    _trace_to(args.trace)
    return main_from_args(args)


def _cmd_soak(args: argparse.Namespace) -> int:
    from kvhandoff.soak.run import run_soak

    _trace_to(args.trace)
    if args.hostile:
        from kvhandoff.soak.hostile import run_hostile_soak

        result = run_hostile_soak(args.seconds or 60.0, args.seed, args.attack_rate)
        print(json.dumps(result))  # one JSON line, --json or not
        return 1 if result["failed"] or result["leaked"] else 0
    result = run_soak(args.seconds or 30.0, args.faults, args.seed, args.ec_faults)
    if not args.json:
        for key, value in result.items():
            print(f"{key}: {value}")
    else:
        print(json.dumps(result))
    return 1 if result["leaked"] else 0


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def proxy_from_args(args: argparse.Namespace) -> Proxy:
    """The `kvhandoff proxy` command's routing, from its parsed arguments (ValueError when
    push mode lacks P's coordinates)."""
    from kvhandoff.protocol.legs import PrefillCoordinates
    from kvhandoff.proxy import Proxy, Upstream

    coordinates = None
    if args.mode == "push":
        if not args.prefill_engine_id or args.prefill_side_channel is None:
            raise ValueError(
                "push mode needs --prefill-engine-id and --prefill-side-channel"
                " (D registers before P answers)"
            )
        side_host, side_port = args.prefill_side_channel
        coordinates = PrefillCoordinates(
            args.prefill_engine_id, side_host, side_port, args.prefill_tp_size, args.prefill_pp_size
        )
    return Proxy(
        Upstream.parse(args.prefill),
        Upstream.parse(args.decode),
        mode=args.mode,
        coordinates=coordinates,
        encoder=Upstream.parse(args.encoder) if args.encoder else None,
    )


def _cmd_proxy(args: argparse.Namespace) -> int:
    from kvhandoff.proxy import serve

    try:
        proxy = proxy_from_args(args)
    except ValueError as exc:
        print(f"kvhandoff proxy: {exc}", file=sys.stderr)
        return 2
    host, port = args.listen
    server = serve(proxy, host, port)
    print(f"kvhandoff proxy ({args.mode}) on http://{host}:{server.server_port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        proxy.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvhandoff", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    diagrams = sub.add_parser("diagrams", help="write specs/ from the machine declarations")
    diagrams.add_argument("--out", default="specs")
    diagrams.add_argument("--check", action="store_true", help="fail naming stale files")
    diagrams.add_argument(
        "--svg", default=None, metavar="DIR", help="check rendered SVGs (make docs), publish"
    )
    diagrams.add_argument(
        "--journey", nargs="+", default=None, metavar="FILE", help="traces: draw one request"
    )
    diagrams.add_argument("--request", default=None, help="with --journey: the request id")
    diagrams.set_defaults(func=_cmd_diagrams)

    check = sub.add_parser(
        "check-trace", help="replay transition traces against the declarations and P/D rules"
    )
    check.add_argument("files", nargs="+", help="trace files (or directories of *.jsonl)")
    check.add_argument("--verbose", action="store_true", help="also list skipped rules")
    check.set_defaults(func=_cmd_check_trace)

    bench = sub.add_parser("bench", help="benchmarks, as ratios against same-run baselines")
    bench.add_argument("what", choices=["dispatch", "push", "latency", "ec", "vllm"])
    bench.add_argument("--requests", type=int, default=64, help="latency: requests per run")
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--quick", action="store_true", help="fewer passes (for smoke tests)")
    bench.add_argument(
        "--push-requests",
        type=int,
        default=None,
        help="push: requests per rep, sharing its bytes (default 32: 32 x 32 MiB)",
    )
    bench.add_argument(
        "--transport",
        choices=["auto", "nixl", "cuda_ipc"],
        default="auto",
        help="push: WRITE path (auto: CUDA IPC on --device cuda, falling back to NIXL)",
    )
    bench.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="push: where the KV lives"
    )
    bench.add_argument(
        "--peer-device",
        type=int,
        default=None,
        metavar="N",
        help="push, --device cuda: D's GPU (P stays on GPU 0; default 0, one GPU for both)",
    )
    bench.add_argument("--blocks", type=int, default=None, help="ec: blocks per batch")
    bench.add_argument(
        "--trace", default=None, metavar="PATH", help="dispatch: also time it traced into PATH"
    )
    bench.add_argument(
        "--vllm-requests",
        type=int,
        default=1000,
        help="vllm: requests in flight per side (needs vLLM: run from .venv-vllm)",
    )
    bench.set_defaults(func=_cmd_bench)

    demo = sub.add_parser("demo", help="the main job: real processes over NIXL and ZMQ")
    demo.add_argument("what", nargs="?", default="all", choices=["push", "pull", "ec", "all"])
    demo.add_argument("--requests", type=int, default=32)
    demo.add_argument("--seed", type=int, default=7)
    demo.add_argument("--backend", default="UCX", help="NIXL backend (B-03)")
    demo.add_argument("--json", action="store_true")
    demo.add_argument("--trace", default=None, metavar="DIR", help=TRACE_HELP)
    demo.set_defaults(func=_cmd_demo)

    soak = sub.add_parser("soak", help="push and encoder-cache traffic under injected faults")
    soak.add_argument("--seconds", type=float, default=None, help="30 (60 with --hostile)")
    soak.add_argument(
        "--hostile",
        action="store_true",
        help="no injected faults: attackers flood every listener while legitimate "
        "requests flow (issue 27); exits non-zero if any legitimate request failed",
    )
    soak.add_argument(
        "--attack-rate", type=float, default=1.0, help="--hostile: scales the floods' pace"
    )
    soak.add_argument(
        "--faults",
        default="write_fail=0.02,notif_drop=0.01,handshake_fail=0.05",
        help="push faults (prefill and decode)",
    )
    soak.add_argument(
        "--ec-faults",
        default="read_fail=0.02,req_drop=0.01,ack_drop=0.01,garble=0.01,slow_save=0.03",
        help="encoder-cache faults (producer and consumer)",
    )
    soak.add_argument("--seed", type=int, default=1)
    soak.add_argument("--json", action="store_true")
    soak.add_argument("--trace", default=None, metavar="DIR", help=TRACE_HELP)
    soak.set_defaults(func=_cmd_soak)

    run = sub.add_parser("run", help="run one role alone (P and D may be on different hosts)")
    run.add_argument("role", choices=["prefill", "decode", "producer", "consumer"])
    run.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT of this side channel")
    run.add_argument("--peer", default=None, help="HOST:PORT of the peer's side channel")
    run.add_argument("--engine-id", default=None)
    run.add_argument("--peer-engine-id", default="prefill-0")
    run.add_argument("--requests", type=int, default=32)
    run.add_argument("--seed", type=int, default=7)
    run.add_argument("--backend", default="UCX", help="NIXL backend (B-03)")
    run.add_argument("--deadline", type=float, default=60.0, help="seconds before giving up")
    run.add_argument("--per-step", type=int, default=4, help="requests started per engine step")
    run.add_argument("--wait-go", action="store_true", help="start after a line on stdin")
    run.add_argument(
        "--config", default="{}", help="JSON object of push (or EC extra) config overrides"
    )
    run.add_argument("--mode", choices=["push", "pull"], default="push", help="KV transfer mode")
    run.add_argument(
        "--relay", action="store_true", help="consumer: take publications on stdin (a proxy)"
    )
    run.add_argument("--advertise-host", default=None, help="producer: host to publish")
    run.add_argument("--step-ms", type=float, default=0.0, help="pace each engine step")
    run.add_argument("--warmup", action="store_true", help="run the first request alone")
    run.add_argument(
        "--faults",
        default="",
        help="seeded faults, push: write_fail=0.02,notif_drop=0.01,handshake_fail=0.05; "
        "EC: read_fail=0.02,req_drop=0.01,ack_drop=0.01,garble=0.01,slow_save=0.03",
    )
    run.add_argument("--fault-seed", type=int, default=0)
    run.set_defaults(func=_cmd_run)

    simulate = sub.add_parser(
        "simulate", help="seeded fault schedules over the in-memory planes (deterministic)"
    )
    simulate.add_argument("what", nargs="?", default="all", choices=["push", "pull", "ec", "all"])
    simulate.add_argument("--seeds", type=int, default=200, help="runs per protocol")
    simulate.add_argument("--first-seed", type=int, default=0)
    simulate.add_argument("--requests", type=int, default=16, help="client requests per run")
    simulate.add_argument(
        "--faults", default="all", help="comma list of fault names, 'all' or 'none'"
    )
    simulate.add_argument("--jobs", type=int, default=0, help="processes (0: one per CPU)")
    simulate.add_argument(
        "--variant", default=None, help="a deliberately broken variant (self-check)"
    )
    simulate.add_argument("--json", action="store_true")
    simulate.add_argument(
        "--trace", default=None, metavar="DIR", help="write one trace per run into DIR"
    )
    simulate.set_defaults(func=_cmd_simulate)

    proxy = sub.add_parser(
        "proxy", help="a reference proxy: both legs of each request to a vLLM P and D"
    )
    proxy.add_argument("--prefill", required=True, help="P's OpenAI server, http://HOST:PORT")
    proxy.add_argument("--decode", required=True, help="D's OpenAI server, http://HOST:PORT")
    proxy.add_argument(
        "--encoder", help="the encoder cache's producer, http://HOST:PORT (optional, first)"
    )
    proxy.add_argument("--listen", type=_host_port, default=("127.0.0.1", 8000))
    proxy.add_argument("--mode", choices=["push", "pull"], default="push")
    proxy.add_argument("--prefill-engine-id", help="P's kv_transfer_config engine_id (push)")
    proxy.add_argument(
        "--prefill-side-channel",
        type=_host_port,
        help="P's side channel HOST:PORT: its side_channel_host/_port (push)",
    )
    proxy.add_argument("--prefill-tp-size", type=int, default=1)
    proxy.add_argument("--prefill-pp-size", type=int, default=1)
    proxy.set_defaults(func=_cmd_proxy)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
