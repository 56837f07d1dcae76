"""Push bench variants on a GPU machine, alternated in one call so they meet the same
machine: `python bench/push_variants_gpu.py OUT ROUNDS VARIANT...`, each VARIANT a JSON
object of `PushBenchConfig` fields over the CLI's `--device cuda` configuration (for
example `{"requests": 8, "ipc_launch_every": 1}`). Appends one JSON line per run to
OUT/variants.jsonl as it goes (ratio to one raw 1 GiB WRITE, GB/s, latency, P's counters
and the median rep's phases), so a call cut short still returns what ran.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvhandoff.bench.push import config_for, run_push_bench


def _summary(variant: dict[str, Any], result: dict[str, Any], seconds: float) -> dict[str, Any]:
    phases = result.get("framework_phases_ms") or []
    keep = (
        "ratio",
        "framework_gbps",
        "baseline_gbps",
        "path",
        "latency_ms",
        "p_counters",
        "framework_verified",
        "baseline_verified",
    )
    return {
        "variant": variant,
        **{key: result.get(key) for key in keep},
        "phases": phases[len(phases) // 2] if phases else None,
        "wall_s": round(seconds, 1),
    }


def main(argv: list[str]) -> int:
    out, rounds, variants = Path(argv[0]), int(argv[1]), [json.loads(v) for v in argv[2:]]
    out.mkdir(parents=True, exist_ok=True)
    base = config_for("cuda", quick=False)
    with (out / "variants.jsonl").open("a") as sink:
        for round_ in range(rounds):
            for variant in variants:
                start = time.monotonic()
                try:
                    result = run_push_bench(replace(base, **variant), lambda line: None)
                    line = _summary(variant, result, time.monotonic() - start)
                except Exception as exc:  # one failed variant does not end the call
                    line = {"variant": variant, "error": f"{type(exc).__name__}: {exc}"}
                line["round"] = round_ + 1
                print(json.dumps(line)[:700], flush=True)
                sink.write(json.dumps(line) + "\n")
                sink.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
