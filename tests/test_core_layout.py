"""Framework core: import direction, generated specs, CLI (issue 2, items 7, 10, 11)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from kvhandoff.specs import expected_specs, stale_specs, write_specs

ROOT = Path(__file__).resolve().parents[1]
_SIM_AND_TOOLS = ("kvhandoff.sim", "kvhandoff.bench", "kvhandoff.demo", "kvhandoff.soak")
_NOT_BELOW_RANK = ("kvhandoff.machines.ec", "kvhandoff.machines.rank")
FORBIDDEN = {
    # Dependencies point one way: adapters -> machines -> protocol. Production code never
    # imports the simulation, the benchmarks or the demo.
    "protocol": ("kvhandoff.machines", "kvhandoff.adapters", *_SIM_AND_TOOLS),
    "machines": ("kvhandoff.adapters", *_SIM_AND_TOOLS),
    "adapters": _SIM_AND_TOOLS,
    # Inside machines/, the runtime knows no protocol; the protocols do not know each other.
    "machines/runtime": (
        "kvhandoff.machines.push",
        "kvhandoff.machines.pull",
        "kvhandoff.machines.ec",
    ),
    "machines/ec": (
        "kvhandoff.machines.push",
        "kvhandoff.machines.pull",
        "kvhandoff.machines.kv",
        "kvhandoff.machines.rank",
    ),
    # Push and pull share the base (`machines/kv`: the events and effects of both modes)
    # and never import each other; the rank's main-thread half, which runs either mode,
    # sits above both, and nothing below imports it.
    "machines/kv": (
        "kvhandoff.machines.push",
        "kvhandoff.machines.pull",
        "kvhandoff.machines.rank",
        "kvhandoff.machines.ec",
    ),
    "machines/push": (*_NOT_BELOW_RANK, "kvhandoff.machines.pull"),
    "machines/pull": (*_NOT_BELOW_RANK, "kvhandoff.machines.push"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_core_import_direction_adapters_machines_protocol() -> None:
    violations = [
        f"{path.relative_to(ROOT)} imports {name}"
        for folder, banned in FORBIDDEN.items()
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name in _imports(path)
        if name.startswith(banned)
    ]
    assert violations == []


def test_core_import_direction_checker_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from kvhandoff.adapters.nixl.agent import NixlAgent\n")
    assert any(n.startswith(FORBIDDEN["protocol"]) for n in _imports(bad))


def test_core_specs_are_fresh() -> None:
    assert stale_specs(ROOT / "specs") == [], "run `kvhandoff diagrams` and commit specs/"


def test_core_specs_check_names_stale_files(tmp_path: Path) -> None:
    write_specs(tmp_path)
    assert stale_specs(tmp_path) == []
    if expected_specs():
        victim = sorted(tmp_path.glob("*.md"))[0]
        victim.write_text(victim.read_text() + "edited\n")
        assert stale_specs(tmp_path) == [victim.name]
    result = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "diagrams", "--check", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == (1 if expected_specs() else 0), result.stdout


def test_core_bench_dispatch_json_shape() -> None:
    """The benchmark runs and reports every field; its numbers are never asserted."""
    result = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "bench", "dispatch", "--json", "--quick"],
        capture_output=True,
        text=True,
        check=True,
    )
    last = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(last["per_event_ns"]) == {"kvhandoff", "transitions", "handwritten"}
    assert set(last["per_event_ns_at"]) == {"1000", "100000"}
    assert set(last["guarded_per_event_ns"]) == {"generated", "general"}
    assert last["bytes_per_instance"] > 0
