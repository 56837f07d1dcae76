#!/usr/bin/env bash
# A/B of the push bench on a GPU machine (issue 18): an older tree ($OLD, a `git archive`
# of an earlier commit) against this one, both installed with `pip --target`, run
# alternately in one call so both meet the same machine. Wheels for nixl, nixl-cu13,
# pyzmq, msgspec and transitions in .whl/ (see the device README). Results: one JSON line
# per run in $OUT/ab.jsonl (ratio, GB/s, latency, P's counters, the median rep's phases).
#   ROUNDS    rounds of (new, old) per variant (default 2)
#   VARIANTS  space-separated bench argument sets, commas for spaces
#             (default: "--device,cuda --device,cuda,--transport,nixl")
#   T_RUN     timeout of one bench run in seconds (default 150)
#   TESTS     pytest arguments run first with the new tree ("" skips)
set -u
OUT=${OUT:-/tmp/kvhandoff-ab}
OLD=${OLD:-.old}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/new . || exit 1
if [ -d "$OLD" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old "$OLD" || exit 1
fi
date -u +"%Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -n "${TESTS:-}" ]; then
  echo "== tests: $TESTS"
  PYTHONPATH=/tmp/new:/tmp/site timeout "${T_TEST:-300}" python3 -m pytest -q -rs \
    -p no:cacheprovider -o pythonpath=tests $TESTS 2>&1 | tail -n 25
fi
summarise() {
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
path, side, args = sys.argv[1:]
try:
    r = json.loads(open(path).read().strip().splitlines()[-1])
except Exception as exc:
    print(json.dumps({"side": side, "args": args, "error": str(exc)})); sys.exit()
phases = r.get("framework_phases_ms", [])
keep = {k: r.get(k) for k in ("ratio", "framework_gbps", "baseline_gbps", "path",
        "ratio_vs_raw_per_request", "raw_per_request_gbps", "latency_ms", "p_counters",
        "framework_verified", "baseline_verified")}
keep["phases"] = phases[len(phases) // 2] if phases else None
print(json.dumps({"side": side, "args": args, **keep}))
PY
}
for variant in ${VARIANTS:-"--device,cuda --device,cuda,--transport,nixl"}; do
  args=${variant//,/ }
  for round in $(seq "${ROUNDS:-2}"); do
    for side in new old; do
      [ -d "/tmp/$side" ] || continue
      log="$OUT/run.json"
      PYTHONPATH=/tmp/$side:/tmp/site timeout "${T_RUN:-150}" python3 -m kvhandoff bench push \
        --json $args >"$log" 2>"$OUT/run.err"
      echo "rc=$? $side round $round: $args"
      summarise "$log" "$side" "$args" | tee -a "$OUT/ab.jsonl" | head -c 900; echo
    done
  done
done
rm -f "$OUT/run.json"
