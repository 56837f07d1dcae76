"""Pack what the GPU tier (`bench/vllm_gpu.sh`) needs from `.venv-vllm` into `.carry/`,
within the device machine's 64 MiB a call (the repo tree included).

    .venv-vllm/bin/python tools/pack_vllm_py.py [--trace] [--nixl-wheel .whl/nixl_cu13-*.whl]

- `.carry/vllm-py.tar.xz`: vLLM 0.33.0's `.py` files that the tier imports (traced: the
  tiny CPU run of `tests_vllm/vllm_gpu_bench.py` under `PYTHONPROFILEIMPORTTIME`, every
  process; plus whole subpackages the CUDA run may reach: kv_transfer, platforms, config,
  v1/core), and the other distributions it imports that the device image lacks: pure ones
  from `.venv-vllm` (`.py` and data files), compiled ones from cp312 wheels in `.whl/`
  (the packer names any it misses, with the `pip download` line that fetches it).
- `.carry/nixl-cu13.tar.xz`: the nixl-cu13 wheel's contents, recompressed (when smaller).

Prints one JSON line: each archive's size, the files and the distributions in it.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(sysconfig.get_paths()["purelib"])
# vLLM subpackages carried whole, whatever the trace saw (the CUDA run's paths)
WHOLE = (
    "vllm/distributed/kv_transfer",
    "vllm/platforms",
    "vllm/config",
    "vllm/v1/core",
)
# The device image's Python packages (/work/.library/device/KINDS.md, 2026-11-17).
IMAGE = set(
    [
        "absl-py",
        "accelerate",
        "aiofiles",
        "aiohappyeyeballs",
        "aiohttp",
        "aiosignal",
        "annotated-doc",
        "anyio",
        "attrs",
        "botorch",
        "build",
        "certifi",
        "charset-normalizer",
        "chex",
        "click",
        "cloudpickle",
        "cmake",
        "colorama",
        "contourpy",
        "coverage",
        "cuda-bindings",
        "cuda-core",
        "cuda-pathfinder",
        "cuda-toolkit",
        "cupy-cuda13x",
        "cycler",
        "cython",
        "diffrax",
        "e3nn",
        "einops",
        "equinox",
        "etils",
        "execnet",
        "filelock",
        "flatbuffers",
        "flax",
        "fonttools",
        "formulaic",
        "frozenlist",
        "fsspec",
        "gpytorch",
        "grpcio",
        "h11",
        "h5py",
        "hf-xet",
        "httpcore",
        "httpx",
        "huggingface-hub",
        "humanize",
        "hypothesis",
        "idna",
        "imageio",
        "iniconfig",
        "interface-meta",
        "jax",
        "jaxlib",
        "jaxtyping",
        "jinja2",
        "joblib",
        "kiwisolver",
        "lazy-loader",
        "lightning",
        "lightning-utilities",
        "linear-operator",
        "lineax",
        "llvmlite",
        "lxml",
        "markdown",
        "markdown-it-py",
        "markupsafe",
        "matplotlib",
        "mdurl",
        "meson",
        "ml-dtypes",
        "mpi4py",
        "mpmath",
        "msgpack",
        "multidict",
        "multipledispatch",
        "mypy-extensions",
        "nanobind",
        "narwhals",
        "networkx",
        "ninja",
        "numba",
        "numba-cuda",
        "numpy",
        "numpyro",
        "nvidia-ml-py",
        "onnx",
        "onnxruntime",
        "opencv-python-headless",
        "optax",
        "packaging",
        "pandas",
        "pathspec",
        "patsy",
        "peft",
        "pillow",
        "pip",
        "pluggy",
        "portalocker",
        "prometheus-client",
        "propcache",
        "protobuf",
        "psutil",
        "pyarrow",
        "pybind11",
        "py-cpuinfo",
        "pygments",
        "pyparsing",
        "pytest",
        "python-dateutil",
        "pytorch-lightning",
        "pyyaml",
        "regex",
        "requests",
        "rich",
        "safetensors",
        "scikit-learn",
        "scipy",
        "seaborn",
        "sentencepiece",
        "sentence-transformers",
        "setuptools",
        "shellingham",
        "simplejson",
        "six",
        "sortedcontainers",
        "statsmodels",
        "sympy",
        "tabulate",
        "tensorboard",
        "threadpoolctl",
        "tifffile",
        "tiktoken",
        "timm",
        "tokenizers",
        "toolz",
        "torch",
        "torchaudio",
        "torchvision",
        "tqdm",
        "transformers",
        "treescope",
        "triton",
        "typer",
        "typing-extensions",
        "typing-inspect",
        "urllib3",
        "uvloop",
        "werkzeug",
        "wheel",
        "wrapt",
        "xarray",
        "xxhash",
        "yarl",
        "zipp",
    ]
)
NEVER = {"kvhandoff", "nixl-cu12", "nixl-cu13", "pytest", "pytest-timeout", "torch"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def traced_modules() -> set[str]:
    """Every module any process of the tiny CPU bench imported."""
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1", PYTHONPATH=str(ROOT / "tests_vllm"))
    run = subprocess.run(
        [sys.executable, "tests_vllm/vllm_gpu_bench.py", "--device", "cpu", "--tiny"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if run.returncode != 0:
        raise SystemExit(f"the traced run failed:\n{run.stderr[-4000:]}")
    names = set()
    for line in run.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def module_file(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    path = Path(spec.origin)
    return path if path.is_relative_to(SITE) else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--modules", type=Path, help="a saved module list (skips the trace)")
    parser.add_argument("--save-modules", type=Path)
    parser.add_argument("--nixl-wheel", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=ROOT / ".carry")
    opts = parser.parse_args()
    names = set(opts.modules.read_text().split()) if opts.modules else traced_modules()
    if opts.save_modules:
        opts.save_modules.write_text("\n".join(sorted(names)))
    dists = md.packages_distributions()
    files: dict[str, Path] = {}  # archive name -> source
    wanted: set[str] = set()
    for name in names:
        path = module_file(name)
        if path is None:
            continue
        top = name.split(".")[0]
        dist = norm((dists.get(top) or [top])[0])
        if dist == "vllm":
            rel = path.relative_to(SITE)
            if rel.suffix == ".py":
                files[str(rel)] = path
        elif dist not in IMAGE and dist not in NEVER:
            try:
                md.distribution(dist)
            except md.PackageNotFoundError:  # a module of no distribution: its file alone
                if path.suffix == ".py":
                    files[str(path.relative_to(SITE))] = path
                continue
            wanted.add(dist)
    for sub in WHOLE:
        for path in (SITE / sub).rglob("*.py"):
            files[str(path.relative_to(SITE))] = path
    wheels, missing, pure = [], [], []
    for dist in sorted(wanted):
        record = md.distribution(dist).files or []
        compiled = any(str(f).endswith((".so", ".pyd")) for f in record)
        if compiled:
            version = md.version(dist)
            found = sorted((ROOT / ".whl").glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
            found += sorted((ROOT / ".whl").glob(f"{dist}-{version}-*.whl"))
            if found:
                wheels.append(found[0])
            else:
                missing.append(f"{dist}=={version}")
            continue
        pure.append(dist)
        for f in record:
            src = Path(str(f.locate()))
            if ".dist-info" in str(f) or "__pycache__" in str(f) or not src.is_file():
                continue
            if src.is_relative_to(SITE):
                files[str(src.relative_to(SITE))] = src
    if missing:
        plat = " ".join(
            f"--platform {p}"
            for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
        )
        raise SystemExit(
            "compiled distributions without a cp312 wheel in .whl/:\n  python3 -m pip download"
            " --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "
            f"{plat} -d .whl {' '.join(missing)}"
        )
    opts.out.mkdir(exist_ok=True)
    out = opts.out / "vllm-py.tar.xz"
    with tarfile.open(out, "w:xz", preset=9) as tar:
        for rel in sorted(files):
            tar.add(files[rel], arcname=rel)
        for wheel in wheels:
            _add_wheel(tar, wheel)
    result = {
        "vllm_py": {
            "path": str(out.relative_to(ROOT)),
            "bytes": out.stat().st_size,
            "files": len(files),
            "pure": pure,
            "wheels": [w.name for w in wheels],
        },
    }
    if opts.nixl_wheel:
        nixl = opts.out / "nixl-cu13.tar.xz"
        with tarfile.open(nixl, "w:xz", preset=9) as tar:
            _add_wheel(tar, opts.nixl_wheel)
        result["nixl_cu13"] = {
            "path": str(nixl.relative_to(ROOT)),
            "bytes": nixl.stat().st_size,
            "wheel_bytes": opts.nixl_wheel.stat().st_size,
        }
    print(json.dumps(result))


def _add_wheel(tar: tarfile.TarFile, wheel: Path) -> None:
    """A wheel's files as `pip install --target` lays them out (purelib and platlib)."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            if info.is_dir():
                continue
            name = info.filename
            if ".data/" in name.split("/", 1)[0] + "/":
                parts = name.split("/", 2)
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                name = parts[2]
            entry = tarfile.TarInfo(name)
            entry.size = info.file_size
            entry.mode = (info.external_attr >> 16) & 0o777 or 0o644
            tar.addfile(entry, io.BytesIO(zf.read(info)))


if __name__ == "__main__":
    main()
