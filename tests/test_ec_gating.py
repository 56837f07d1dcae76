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
    "kvhandoff.protocol.ec_extra_config",
    "kvhandoff.protocol.ec_layout",
    "kvhandoff.protocol.ec_publication",
    "kvhandoff.machines.ec.pool",
    "kvhandoff.machines.ec.events",
    "kvhandoff.machines.ec.cache_entry",
    "kvhandoff.machines.ec.cache",
    "kvhandoff.machines.ec.copy_batch",
    "kvhandoff.machines.ec.notices",
    "kvhandoff.machines.ec.meta",
    "kvhandoff.machines.ec.request",
    "kvhandoff.machines.ec.settlement",
    "kvhandoff.machines.ec.transfer",
    "kvhandoff.machines.ec.reports",
    "kvhandoff.protocol.msgpack_limits",
    "kvhandoff.machines.ec.worker_region",
    "kvhandoff.machines.ec.nixl_gate",
    "kvhandoff.machines.ec.scheduler",
    "kvhandoff.machines.ec.worker",
    "kvhandoff.machines.ec.connector",
    "kvhandoff.adapters.ec_copy_cpu",
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


def test_R_E02_local_connector_halves_built_without_p2p_stack(tmp_path: Path) -> None:
    # Building (not only importing) a local-tier scheduler and worker stays off the P2P stack.
    code = _PROBE.format(forbidden=FORBIDDEN_PACKAGES).replace(
        "forbidden = ",
        "from kvhandoff.machines.ec.connector import ECCPUConnector\n"
        "from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig\n"
        "c = ECTransferConfig(ec_connector='ECCPUConnector', ec_role='ec_both',\n"
        "    ec_connector_extra_config={'ec_cpu_bytes': 4096})\n"
        "ECCPUConnector.scheduler(c, ECLayout(8, 2, 4096))\n"
        "ECCPUConnector.worker(c, ECLayout(8, 2, 4096)).register_region(0, None, 0.0)\n"
        "forbidden = ",
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_R_E02_p2p_halves_are_separate_modules(tmp_path: Path) -> None:
    # Control: the P2P modules do load msgspec, so they must stay out of the list above.
    for module in ("kvhandoff.machines.ec.p2p", "kvhandoff.machines.ec.consumer_read"):
        assert "msgspec" in _forbidden_loaded((module,), tmp_path)
