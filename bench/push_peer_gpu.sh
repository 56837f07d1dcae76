#!/usr/bin/env bash
# Issue 29 on a GPU machine: P on GPU 0 pushes into D on another GPU of the same host
# (B-12 across devices). Run from the repository root with torch, Triton and cuda-python
# importable by python3, wheels for nixl, nixl-cu13, pyzmq, msgspec and transitions in
# .whl/ (carried), and OUT naming a folder for the results. Every bench run leaves its
# JSON line in $OUT/<name>.json (stderr in $OUT/<name>.err) and a summary line in
# $OUT/peer.jsonl.
#   One GPU (the dry run: two processes sharing GPU 0, same code path):
#     1. the two-GPU tests (they skip, printing why) and the CPU config tests;
#     2. bench push --device cuda --peer-device 0, at 32 x 32 MiB and --push-requests 8.
#   Two or more GPUs:
#     1. the same tests (run for real);
#     2. bench push --device cuda --peer-device 1, at 32 x 32 MiB and 8 x 128 MiB
#        (transport auto = CUDA IPC), then at 8 x 128 MiB with --transport nixl.
# T_TEST, T_RUN bound the tests and each bench run in seconds (0 skips the tests).
# PEER overrides the peer GPU.
set -u
OUT=${OUT:-/tmp/kvhandoff-peer}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/new . || exit 1
export PYTHONPATH=/tmp/new:/tmp/site
date -u +"%Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -n 6
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
if [ "$GPUS" -ge 2 ]; then PEER=${PEER:-1}; else PEER=${PEER:-0}; fi
echo "== GPUs: $GPUS, D on GPU $PEER"
if [ "${T_TEST:-300}" != 0 ]; then
  echo "== 1. tests: two GPUs (skip with the reason on one) and the CPU config tests"
  timeout "${T_TEST:-300}" python3 -m pytest -q -rs -p no:cacheprovider -o pythonpath=tests \
    tests/test_push_ipc_peer_gpu.py tests/test_push_peer_device_config.py 2>&1 | tail -n 30
fi
summarise() {
  python3 - "$1" "$2" <<'PY'
import json, sys
path, name = sys.argv[1:]
try:
    r = json.loads(open(path).read().strip().splitlines()[-1])
except Exception as exc:
    print(json.dumps({"run": name, "error": str(exc)})); sys.exit()
keep = {k: r.get(k) for k in ("peer_device", "device", "peer_device_name", "requests",
        "bytes", "transport", "path", "route", "framework_gbps", "baseline_gbps", "ratio",
        "peer_copy_gbps", "ratio_vs_peer_copy", "baseline_ratio_vs_peer_copy",
        "peer_copy_method", "peer_copy_p2p", "framework_verified", "baseline_verified",
        "peer_copy_verified", "ratio_vs_raw_per_request", "latency_ms")}
keep["ipc_kernel"] = r.get("p_counters", {}).get("ipc_kernel")
keep["peer_copy_samples_gbps"] = r.get("peer_copy_samples_gbps")
print(json.dumps({"run": name, **keep}))
PY
}
bench() {  # NAME ARGS...
  name=$1; shift
  echo "== 2. bench push --json --device cuda --peer-device $PEER $*"
  timeout "${T_RUN:-240}" python3 -m kvhandoff bench push --json --device cuda \
    --peer-device "$PEER" "$@" >"$OUT/$name.json" 2>"$OUT/$name.err"
  echo "rc=$?"; tail -n 4 "$OUT/$name.err"
  summarise "$OUT/$name.json" "$name" | tee -a "$OUT/peer.jsonl" | head -c 1500; echo
}
bench "peer${PEER}_32x32"
bench "peer${PEER}_8x128" --push-requests 8
if [ "$GPUS" -ge 2 ]; then
  bench "peer${PEER}_8x128_nixl" --push-requests 8 --transport nixl
fi
