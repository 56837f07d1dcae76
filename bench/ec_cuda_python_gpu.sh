#!/usr/bin/env bash
# Issue 18 item 4 on a GPU machine: the encoder-cache copy engine on NVIDIA's cuda-python
# (`cuda.bindings` for the runtime calls, `cuda.core` compiling the row kernel) instead of
# hand-written ctypes bindings (see bench/RESULTS.md, "Encoder cache on cuda-python").
# Run from the repository root with kvhandoff importable by python3 (and nixl-cu13, pyzmq,
# msgspec, transitions for the push tests) and OUT naming a folder for the results:
#   1. versions: torch, cuda-bindings, cuda-core, Triton;
#   2. the CUDA tests, bytes verified: the copy engine, the cuda-python layer, the bench,
#      VRAM push over NIXL and the CUDA IPC push path;
#   3. kvhandoff.bench.probes.ec_host_calls: host µs per row-kernel launch (the engine's
#      prepared cuLaunchKernel against cuda.core.launch), per memcpy and per stream wait
#      (against the earlier runtime.py too with OLD_CUDA);
#   4. `kvhandoff bench ec --json --device cuda` (8,192 blocks) and
#      `python3 -m kvhandoff.bench.ec --device cuda --blocks 1024 --json`, ROUNDS times
#      (default 2; SIZES="8192 1024"; SWEEP=<methods> replaces the default sweep, SWEEP=-
#      measures `auto` alone). With OLD_CUDA=<dir> holding an earlier adapters/cuda (e.g.
#      the ctypes engine: `git show <commit>:adapters/cuda/<file>` for each file), a copy
#      of this tree with that folder is installed under /tmp/old and each round runs the
#      same commands against it too, alternating (OLD_FIRST=1: the old engine first), so
#      both engines meet the same machine.
# Each step has its own time limit so that one stuck step cannot eat the others' time.
# T_TEST=0 skips the tests.
set -u
OUT=${OUT:-/tmp/kvhandoff-ec}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
date -u +"%Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv,noheader
echo "== 1. versions"
python3 - <<'PY'
import importlib.metadata as md
import torch
print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))
for name in ("cuda-bindings", "cuda-core", "cuda-python", "cuda-pathfinder", "triton"):
    try:
        print(name, md.version(name))
    except md.PackageNotFoundError:
        print(name, "not installed")
from kvhandoff.adapters.cuda import bindings
print("cuda.core module:", getattr(bindings.core(), "__name__", None))
PY
old=""
if [ -n "${OLD_CUDA:-}" ]; then
  rm -rf /tmp/oldsrc /tmp/old && mkdir -p /tmp/oldsrc
  tar --exclude=./.whl --exclude=./.git --exclude=./.old --exclude=./build \
    --exclude='./.venv*' --exclude=./.cache --exclude=./.mypy_cache --exclude=./.hypothesis \
    --exclude='*.egg-info' -cf - . | tar -xf - -C /tmp/oldsrc
  rm -rf /tmp/oldsrc/adapters/cuda && cp -r "$OLD_CUDA" /tmp/oldsrc/adapters/cuda
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/old \
    /tmp/oldsrc >/dev/null 2>&1 && old=/tmp/old
  echo "old engine: ${old:-build failed}"
  [ -n "$old" ] && PYTHONPATH="$old:${PYTHONPATH:-}" python3 -c \
    "import kvhandoff.adapters.cuda.runtime as r; print('old runtime from', r.__file__)"
fi
echo "== 2. tests"
[ "${T_TEST:-300}" = 0 ] || timeout "${T_TEST:-300}" python3 -m pytest -q -rs -p no:cacheprovider --timeout 240 \
  tests/test_ec_copy_cuda.py tests/test_cuda_bindings_cpu.py tests/test_bench_ec.py \
  tests/test_push_gpu.py tests/test_push_ipc_gpu.py 2>&1 | tail -n 30
echo "== 3. host calls probe"
timeout 90 python3 -m kvhandoff.bench.probes.ec_host_calls \
  ${OLD_CUDA:+--old-runtime "$OLD_CUDA/runtime.py"} 2>&1 | tail -n 3
bench() {  # name pythonpath-prefix args...
  local name=$1 prefix=$2; shift 2
  PYTHONPATH="$prefix${PYTHONPATH:-}" timeout 150 python3 "$@" >"$OUT/$name.json" \
    2>"$OUT/$name.err"
  echo "rc=$? $name"; grep -v '^$' "$OUT/$name.err" | tail -n 4
  python3 - "$OUT/$name.json" <<'PY'
import json, sys
try:
    r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
except Exception as exc:
    print("no JSON:", exc); raise SystemExit
s, l = r["save"], r["load"]
print(f"  {r['engine']} verified={r['verified']} save {s['ratio']} ({s['framework_gbps']}/"
      f"{s['baseline_gbps']} GB/s) load {l['ratio']} ({l['framework_gbps']}/"
      f"{l['baseline_gbps']} GB/s) per-block x{r['per_block']['save']['framework_speedup']}"
      f"/x{r['per_block']['load']['framework_speedup']} contiguous "
      f"{r['contiguous']['save']['ratio']}/{r['contiguous']['load']['ratio']}")
for m, v in (r.get("methods") or {}).items():
    sc = v.get("scattered") if isinstance(v, dict) else None
    print(f"  {m}:", v if sc is None else f"{sc['save']['ratio']} / {sc['load']['ratio']}")
PY
}
one() {  # tag prefix blocks
  local args=(-m kvhandoff.bench.ec --device cuda --blocks "$3" --json)
  if [ -z "${SWEEP:-}" ] && [ "$3" = 8192 ]; then
    args=(-m kvhandoff bench ec --json --device cuda)
  elif [ -n "${SWEEP:-}" ]; then
    args+=(--sweep "${SWEEP#-}")
  fi
  bench "$1_$3_$round" "$2" "${args[@]}"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  echo "== 4. round $round"
  for n in ${SIZES:-8192 1024}; do
    if [ -n "$old" ] && [ -n "${OLD_FIRST:-}" ]; then one old "$old:" "$n"; fi
    one new "" "$n"
    if [ -n "$old" ] && [ -z "${OLD_FIRST:-}" ]; then one old "$old:" "$n"; fi
  done
done
