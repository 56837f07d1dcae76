"""Command-line entry point: `kvhandoff <command>`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _cmd_diagrams(args: argparse.Namespace) -> int:
    from kvhandoff.specs import stale_specs, write_specs

    out = Path(args.out)
    if args.check:
        stale = stale_specs(out)
        for name in stale:
            print(f"stale: {out / name} (run `kvhandoff diagrams`)")
        return 1 if stale else 0
    for name in write_specs(out):
        print(f"wrote {out / name}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "dispatch":
        from kvhandoff.bench_dispatch import run_dispatch_bench

        result = run_dispatch_bench(_progress, quick=args.quick)
        if not args.json:
            for name, value in result["per_event_ns"].items():
                print(f"{name:>12}: {value:8.1f} ns/event")
            for name, value in result["ratios"].items():
                print(f"{name:>28}: {value}")
            print(f"bytes per live instance: {result['bytes_per_instance']}")
        print(json.dumps(result) if args.json else "")
        return 0
    raise SystemExit(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvhandoff", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    diagrams = sub.add_parser("diagrams", help="write specs/ from the machine declarations")
    diagrams.add_argument("--out", default="specs")
    diagrams.add_argument("--check", action="store_true", help="fail naming stale files")
    diagrams.set_defaults(func=_cmd_diagrams)

    bench = sub.add_parser("bench", help="benchmarks, as ratios against same-run baselines")
    bench.add_argument("what", choices=["dispatch"])
    bench.add_argument("--json", action="store_true")
    bench.add_argument("--quick", action="store_true", help="fewer passes (for smoke tests)")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
