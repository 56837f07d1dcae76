#!/usr/bin/env bash
# Issue 18 on a GPU machine (see bench/RESULTS.md, "Push over CUDA IPC"). Run from the
# repository root with kvhandoff, nixl-cu13, pyzmq, msgspec, transitions, torch, Triton and
# cuda-python importable by python3, and OUT naming a folder for the results:
#   1. the IPC GPU tests (bytes verified, D killed while P holds its handles, fallback,
#      the whole push path over CUDA IPC);
#   2. `kvhandoff bench push --json --device cuda` (default transport: CUDA IPC, falling
#      back to NIXL), framework against one raw 1 GiB NIXL WRITE in the same run;
#   3. the same with `--transport nixl` (the NIXL-only path, for comparison).
# T_TEST, T_IPC, T_NIXL bound each step in seconds (0 skips it).
set -u
OUT=${OUT:-/tmp/kvhandoff-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
date -u +"%Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== 1. IPC GPU tests"
[ "${T_TEST:-180}" = 0 ] || timeout "${T_TEST:-180}" python3 -m pytest -q -rs -p no:cacheprovider \
  tests/test_push_ipc_gpu.py 2>&1 | tail -n 30
echo "== 2. bench push --device cuda (transport auto = cuda_ipc)"
[ "${T_IPC:-150}" = 0 ] || timeout "${T_IPC:-150}" python3 -m kvhandoff bench push --json --device cuda \
  >"$OUT/push_ipc.json" 2>"$OUT/push_ipc.err"
echo "rc=$?"; tail -n 8 "$OUT/push_ipc.err"; tail -n 1 "$OUT/push_ipc.json" | head -c 1500; echo
echo "== 3. bench push --device cuda --transport nixl"
[ "${T_NIXL:-150}" = 0 ] || timeout "${T_NIXL:-150}" python3 -m kvhandoff bench push --json --device cuda \
  --transport nixl >"$OUT/push_nixl.json" 2>"$OUT/push_nixl.err"
echo "rc=$?"; tail -n 8 "$OUT/push_nixl.err"; tail -n 1 "$OUT/push_nixl.json" | head -c 1500; echo
