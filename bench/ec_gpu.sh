#!/usr/bin/env bash
# The encoder-cache half of issue 6 on a GPU machine (see bench/RESULTS.md, "## Encoder cache").
# Run from the repository root with kvhandoff importable by python3 (torch, numpy and the
# `gpu` extra's cuda-python: cuda-bindings, cuda-core) and OUT naming a folder for the results:
#   1. the CUDA copy-engine tests and the CPU bench test (bytes verified);
#   2. `kvhandoff bench ec --json --device cuda` (headline: auto, plus row_kernel, kernel, runs);
#   3. the batched-memcpy method, in its own process (cudaMemcpyBatchAsync via cuda.bindings);
#   4. batch sizes (auto, row_kernel, kernel, runs): SIZES, default 1,024 / 4,096 / 32,768 blocks;
#   5. kvhandoff.bench.probes.ec_kernel: device-side throughput of each copy primitive (SKIP_PROBE=1);
#   6. `kvhandoff bench ec --json` (the CPU copy path, same machine); SKIP_CPU=1 skips it;
#   7. kvhandoff.bench.probes.ec_overhead: where a small batch's host time goes, and the engine
#      against an earlier one in the same process (OLD=path/to/ec_copy.py from a commit before
#      that engine was split into modules, e.g. `git show <commit>:adapters/cuda/ec_copy.py`);
#      SKIP_OVERHEAD=1 skips it.
# Each step has its own time limit so that one stuck step cannot eat the others' time.
set -u
OUT=${OUT:-/tmp/kvhandoff-ec}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
date -u +"%Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv,noheader
nproc; df -h /dev/shm | tail -n 1
python3 -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
python3 - <<'PY' 2>&1 | head -n 12
from cuda.bindings import runtime as r
print((r.cudaMemcpyBatchAsync.__doc__ or "")[:700])
PY
bench() {  # name timeout args...
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 "$@" >"$OUT/$name.json" 2>"$OUT/$name.err"
  echo "rc=$?"; grep -v '^$' "$OUT/$name.err" | tail -n 12; tail -n 1 "$OUT/$name.json"; echo
}
echo "== 1. tests"
timeout "${T_TEST:-240}" python3 -m pytest -q -rs -p no:cacheprovider -k "not batch_memcpy" \
  tests/test_ec_copy_cuda.py tests/test_bench_ec.py 2>&1 | tail -n 25
timeout 60 python3 -m pytest -q -rs -p no:cacheprovider -k batch_memcpy \
  tests/test_ec_copy_cuda.py 2>&1 | tail -n 25
echo "== 2. bench ec --device cuda"
bench ec_cuda 120 -m kvhandoff bench ec --json --device cuda
echo "== 3. batch_memcpy"
bench ec_batch 60 -m kvhandoff.bench.ec --device cuda --method batch_memcpy --sweep "" --json
echo "== 4. sizes"
for n in ${SIZES:-1024 4096 32768}; do
  bench "ec_cuda_$n" 90 -m kvhandoff.bench.ec --device cuda --blocks "$n" --json
done
if [ -z "${SKIP_PROBE:-}" ]; then
  echo "== 5. kernel probe"
  timeout 120 python3 -m kvhandoff.bench.probes.ec_kernel --json >"$OUT/ec_probe.json" 2>&1
  echo "rc=$?"; cat "$OUT/ec_probe.json"
fi
if [ -z "${SKIP_CPU:-}" ]; then
  echo "== 6. bench ec --device cpu"
  bench ec_cpu "${T_CPU:-150}" -m kvhandoff bench ec --json
fi
if [ -z "${SKIP_OVERHEAD:-}" ]; then
  echo "== 7. overhead probe"
  timeout 150 python3 -m kvhandoff.bench.probes.ec_overhead --out "$OUT/ec_overhead.json" --skip device,cpu \
    ${OLD:+--old "$OLD"} --reps 30 2>&1 | grep -v '^$' | grep -v contiguous
fi
