#!/usr/bin/env bash
# The push half of issue 6 on a GPU machine (see bench/RESULTS.md, "## Push").
# Run from the repository root, with kvhandoff and its dependencies importable by
# python3 and OUT naming a folder for the results:
#   1. the VRAM push test (bytes verified after a push into CUDA tensors);
#   2. `kvhandoff bench push --json --device cuda` (the headline number);
#   3. `kvhandoff bench push --json` (DRAM, the CPU copy path, same machine);
#   4. kvhandoff.bench.probes.push_sweep on VRAM: which knobs move the ratio.
# Each step has its own time limit (T_TEST, T_CUDA, T_CPU, T_SWEEP seconds; 0 skips the
# step) so that one stuck step cannot eat the others' time; SWEEP_VARIANTS picks variants.
set -u
OUT=${OUT:-/tmp/kvhandoff-bench}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
date -u +"%Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
echo "== 1. VRAM push test"
[ "${T_TEST:-150}" = 0 ] || timeout "${T_TEST:-150}" python3 -m pytest -q -rs -s -p no:cacheprovider tests/test_push_gpu.py \
  2>&1 | tail -n 25
echo "== 2. bench push --device cuda"
[ "${T_CUDA:-120}" = 0 ] || timeout "${T_CUDA:-120}" python3 -m kvhandoff bench push --json --device cuda \
  >"$OUT/push_cuda.json" 2>"$OUT/push_cuda.err"
echo "rc=$?"; tail -n 8 "$OUT/push_cuda.err"; tail -n 1 "$OUT/push_cuda.json"; echo
echo "== 3. bench push --device cpu"
[ "${T_CPU:-150}" = 0 ] || timeout "${T_CPU:-150}" python3 -m kvhandoff bench push --json --device cpu \
  >"$OUT/push_cpu.json" 2>"$OUT/push_cpu.err"
echo "rc=$?"; tail -n 8 "$OUT/push_cpu.err"; tail -n 1 "$OUT/push_cpu.json"; echo
echo "== 4. sweep on VRAM"
[ "${T_SWEEP:-240}" = 0 ] || timeout "${T_SWEEP:-240}" python3 -m kvhandoff.bench.probes.push_sweep --device cuda --out "$OUT/push_sweep.jsonl" \
  ${SWEEP_VARIANTS:+--variants "$SWEEP_VARIANTS"} >"$OUT/push_sweep.log" 2>&1
echo "rc=$?"; grep -v '^\[' "$OUT/push_sweep.log" | tail -n 20
