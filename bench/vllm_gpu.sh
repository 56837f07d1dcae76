#!/usr/bin/env bash
# Issue 28's GPU tier: P -> D through kvhandoff's KVHandoffConnector and through vLLM
# 0.33.0's own NixlPushConnector, the same requests and KV layout, under vLLM's real
# Schedulers, each engine's worker in its own process (tests_vllm/vllm_gpu_bench.py says
# what is measured and what differs from a CUDA engine). Prints one JSON line.
#
# On the GPU machine, from the repository root, with .carry/ built here first by
#   .venv-vllm/bin/python tools/pack_vllm_py.py --nixl-wheel .whl/nixl_cu13-1.5.1-*.whl
# and carried (carry: [".carry"]):
#   bash bench/vllm_gpu.sh [--requests N --prompt TOKENS --layers L --heads H --head-dim D]
#   bash bench/vllm_gpu.sh ec [--encodings N]   (the encoder-cache connector, CUDA cache)
# Here, on CPU, with the vLLM tier's environment (no unpacking, DRAM tensors):
#   bash bench/vllm_gpu.sh --device cpu --tiny
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
device=cuda
for ((i = 1; i <= $#; i++)); do
  if [ "${!i}" = --device ]; then j=$((i + 1)); device=${!j}; fi
done
export PYTHONUNBUFFERED=1 NIXL_LOG_LEVEL=${NIXL_LOG_LEVEL:-WARN}
export VLLM_TARGET_DEVICE=cpu VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
if [ "$device" = cpu ]; then
  PY=${PY:-$ROOT/.venv-vllm/bin/python}
  export PYTHONPATH=$ROOT/tests_vllm${PYTHONPATH:+:$PYTHONPATH}
else
  PY=${PY:-python3}
  SITE=${KVH_SITE:-/tmp/kvh-vllm-site}
  CARRY=${CARRY:-$ROOT/.carry}
  if [ ! -e "$SITE/.unpacked" ]; then
    mkdir -p "$SITE/py" "$SITE/kvh"
    for archive in "$CARRY"/vllm-py.tar.xz "$CARRY"/nixl-cu13.tar.xz; do
      [ -f "$archive" ] || { echo "missing $archive: run tools/pack_vllm_py.py and carry .carry" >&2; exit 2; }
      # Console scripts of wheels sit outside site-packages ("../../../bin"): skip them.
      tar -xJf "$archive" -C "$SITE/py" --exclude="../*"
    done
    # The carried packages' metadata (importlib.metadata.version asks for some), if packed.
    [ ! -f "$CARRY"/dist-info.tar.xz ] || tar -xJf "$CARRY"/dist-info.tar.xz -C "$SITE/py"
    # Every .py of vLLM, if packed (what the trace missed: the model registry's subprocess).
    [ ! -f "$CARRY"/vllm-full.tar.xz ] || tar -xJf "$CARRY"/vllm-full.tar.xz -C "$SITE/py"
    # kvhandoff itself, built from this tree (setuptools is in the image; no index)
    "$PY" -m pip install -q --no-deps --no-index --no-build-isolation --no-compile \
      --target "$SITE/kvh" "$ROOT" >&2
    touch "$SITE/.unpacked"
  fi
  export PYTHONPATH=$SITE/kvh:$SITE/py:$ROOT/tests_vllm
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >&2 || true
  "$PY" -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" >&2
fi
cd "$ROOT/tests_vllm"
if [ "${1:-}" = ec ]; then  # the encoder-cache connector on a CUDA encoder cache
  shift
  exec "$PY" vllm_gpu_ec.py "$@"
fi
exec "$PY" vllm_gpu_bench.py "$@"
