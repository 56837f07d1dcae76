"""R-E02: the local encoder-cache tier imports no nixl, zmq or msgspec.

Each check runs in a fresh interpreter, so modules imported by other tests cannot hide
or fake a leak. Extend `LOCAL_TIER_MODULES` when a new local-tier module is added.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

LOCAL_TIER_MODULES: tuple[str, ...] = (
    "kvhandoff.protocol.ec_status",
    "kvhandoff.protocol.ec_config",
    "kvhandoff.protocol.ec_publication",
)
"""Every module the local (no `ec_enable_nixl`) tier may import."""

FORBIDDEN_PACKAGES: tuple[str, ...] = ("nixl", "zmq", "msgspec")
"""Top-level packages the local tier must not load; `nixl_cu12`-style builds count as nixl."""

_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
forbidden = {forbidden!r}
loaded = sorted(
    m for m in sys.modules
    if any(m.split(".")[0] == f or m.split(".")[0].startswith(f + "_") for f in forbidden)
)
print(json.dumps(loaded))
"""


def _forbidden_loaded(modules: tuple[str, ...], cwd: Path) -> list[str]:
    code = _PROBE.format(forbidden=FORBIDDEN_PACKAGES)
    proc = subprocess.run(
        [sys.executable, "-c", code, *modules],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    loaded: list[str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return loaded


@pytest.mark.parametrize("module", LOCAL_TIER_MODULES)
def test_R_E02_local_tier_module_imports_no_p2p_stack(module: str, tmp_path: Path) -> None:
    assert _forbidden_loaded((module,), tmp_path) == []


def test_R_E02_whole_local_tier_imports_no_p2p_stack(tmp_path: Path) -> None:
    assert _forbidden_loaded(LOCAL_TIER_MODULES, tmp_path) == []


def test_R_E02_probe_detects_msgspec_from_the_p2p_wire_module(tmp_path: Path) -> None:
    # Control: the probe must see a forbidden import when one happens.
    assert "msgspec" in _forbidden_loaded(("kvhandoff.protocol.ec_wire",), tmp_path)
