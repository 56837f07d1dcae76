"""Checks an installed kvhandoff wheel from outside the source tree (`make wheel-check`).

Usage: python wheel_check.py DIST_DIR [VLLM_SITE_PACKAGES]

Run by the fresh environment's interpreter the wheel was installed into. Fails (exit 1,
each problem on its own line) unless: kvhandoff is imported from that environment, not
from the tree; the wheel and the sdist hold every package pyproject.toml names, `py.typed`
and the README; the metadata names the `kvhandoff` console script and the `[gpu]` extra;
every module imports (those that need vLLM, with vLLM's site-packages on the path when
given); and every name `kvhandoff.integrations.vllm` exports resolves under vLLM.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import pkgutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDS_VLLM = "vllm"
# Modules that need an extra import only with it: the top-level module they lack -> extra.
EXTRAS = {"triton": "gpu", "cuda": "gpu", "hypothesis": "testing"}


def extra_for(why: str) -> str | None:
    """The extra a failed import needs, when it failed only for a missing extra's module."""
    for module, extra in EXTRAS.items():
        if f"No module named '{module}'" in why or f"No module named '{module}." in why:
            return extra
    return None


def fail(problems: list[str], text: str) -> None:
    problems.append(text)
    print(f"wheel-check: FAIL {text}", file=sys.stderr)


def packages() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["setuptools"]["packages"])


def check_archives(dist: Path, problems: list[str]) -> None:
    wheels = sorted(dist.glob("kvhandoff-*.whl"))
    sdists = sorted(dist.glob("kvhandoff-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        fail(problems, f"expected one wheel and one sdist in {dist}: {wheels + sdists}")
        return
    names = set(zipfile.ZipFile(wheels[0]).namelist())
    for package in packages():
        init = package.replace(".", "/") + "/__init__.py"
        if init not in names:
            fail(problems, f"the wheel lacks {init}")
    if "kvhandoff/py.typed" not in names:
        fail(problems, "the wheel lacks kvhandoff/py.typed")
    with tarfile.open(sdists[0]) as sdist:
        members = {m.name.split("/", 1)[-1] for m in sdist.getmembers()}
    for needed in ("pyproject.toml", "README.md", "src/kvhandoff/py.typed"):
        if needed not in members:
            fail(problems, f"the sdist lacks {needed}")
    for folder in ("protocol", "machines", "adapters", "sim", "bench"):
        if f"{folder}/__init__.py" not in members:
            fail(problems, f"the sdist lacks {folder}/__init__.py")


def check_metadata(problems: list[str]) -> None:
    scripts = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group="console_scripts")
        if ep.name == "kvhandoff"
    }
    if scripts != {"kvhandoff": "kvhandoff.cli:main"}:
        fail(problems, f"console script kvhandoff -> kvhandoff.cli:main missing: {scripts}")
    requires = importlib.metadata.requires("kvhandoff") or []
    gpu = sorted(r.split(";")[0].strip() for r in requires if 'extra == "gpu"' in r)
    if not gpu or not all(r.startswith(("cuda-python", "cuda-core", "triton")) for r in gpu):
        fail(problems, f"the [gpu] extra is not declared as expected: {gpu}")
    testing = [r for r in requires if 'extra == "testing"' in r]
    if not any(r.startswith("hypothesis") for r in testing):
        fail(problems, f"the [testing] extra does not name hypothesis: {testing}")
    script = Path(sys.prefix) / "bin" / "kvhandoff"
    run = subprocess.run([str(script), "--help"], capture_output=True, text=True, check=False)
    if run.returncode != 0 or "demo" not in run.stdout:
        fail(problems, f"`kvhandoff --help` failed ({run.returncode}): {run.stderr[-500:]}")


def import_all() -> dict[str, str]:
    """Import every kvhandoff module; return those that failed, with why."""
    import kvhandoff

    failed: dict[str, str] = {}
    for info in pkgutil.walk_packages(kvhandoff.__path__, "kvhandoff."):
        if info.name.endswith(".__main__"):
            continue  # runs the CLI on import; the console script is checked instead
        try:
            importlib.import_module(info.name)
        except Exception as exc:  # reported, not raised: every module is tried
            failed[info.name] = f"{type(exc).__name__}: {exc}"
    return failed


def lazy_names() -> dict[str, str]:
    """Every exported name of `kvhandoff.integrations.vllm`, resolved (needs vLLM)."""
    package = importlib.import_module("kvhandoff.integrations.vllm")
    failed: dict[str, str] = {}
    for name in package.__all__:
        try:
            getattr(package, name)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


def main() -> int:
    if len(sys.argv) == 2 and sys.argv[1] == "--under-vllm":
        import kvhandoff

        report = {"imports": import_all(), "lazy": lazy_names(), "from": kvhandoff.__file__}
        print(json.dumps(report))
        return 0
    dist = Path(sys.argv[1])
    vllm_site = Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] else None
    problems: list[str] = []
    import kvhandoff

    where = Path(kvhandoff.__file__).resolve()
    if not where.is_relative_to(Path(sys.prefix).resolve()):
        fail(problems, f"kvhandoff was imported from {where}, not from {sys.prefix}")
    check_archives(dist, problems)
    check_metadata(problems)
    failed = import_all()
    optional = {name: extra_for(why) for name, why in failed.items() if extra_for(why)}
    for name, why in sorted(failed.items()):
        if f"No module named '{NEEDS_VLLM}" not in why and name not in optional:
            fail(problems, f"{name} does not import: {why}")
    needs_vllm = sorted(n for n, why in failed.items() if f"No module named '{NEEDS_VLLM}" in why)
    if vllm_site is not None and vllm_site.is_dir():
        env = {**os.environ, "PYTHONPATH": str(vllm_site), "VLLM_TARGET_DEVICE": "cpu"}
        run = subprocess.run(
            [sys.executable, __file__, "--under-vllm"],
            capture_output=True,
            text=True,
            env=env,
            check=False,
        )
        if run.returncode != 0:
            fail(problems, f"the vLLM import check did not run: {run.stderr[-2000:]}")
        else:
            result = json.loads(run.stdout.strip().splitlines()[-1])
            if Path(result["from"]).resolve() != where:
                fail(problems, f"under vLLM kvhandoff came from {result['from']}")
            for name, why in sorted(result["imports"].items()):
                if extra_for(why) is None:
                    fail(problems, f"{name} does not import under vLLM: {why}")
            for name, why in sorted(result["lazy"].items()):
                fail(problems, f"kvhandoff.integrations.vllm.{name} does not resolve: {why}")
        vllm_note = f"{len(needs_vllm)} of them again with vLLM on the path"
    else:
        vllm_note = f"{len(needs_vllm)} needing vLLM skipped: no vLLM site-packages given"
    modules = sum(1 for _ in pkgutil.walk_packages(kvhandoff.__path__, "kvhandoff."))
    if problems:
        return 1
    extras = ", ".join(f"{n} [{e}]" for n, e in sorted(optional.items())) or "none"
    print(f"wheel-check: ok, {modules} modules import from {sys.prefix} ({vllm_note})")
    print(f"wheel-check: modules that need an extra not installed here: {extras}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
