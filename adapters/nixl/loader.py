"""Find an importable NIXL build and return the module that holds the agent classes.

The PyPI meta package `nixl` re-exports the classes of whichever build package fits the
host (`nixl_cu13`, `nixl_cu12`); on some hosts only a build package is installed. This
module is the one place that knows the candidate names, so the rest of kvhandoff imports
NIXL lazily through `load_nixl()` and a local-only configuration never imports it (R-E02).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["NIXL_CANDIDATES", "load_nixl"]

#: Module names tried in order; each must expose `nixl_agent` and `nixl_agent_config`.
NIXL_CANDIDATES: tuple[str, ...] = ("nixl", "nixl_cu13", "nixl_cu12")

_REQUIRED = ("nixl_agent", "nixl_agent_config")


def _module_with_api(name: str) -> ModuleType | None:
    """Import `name` and return the module that defines the agent API, or None."""
    try:
        module = importlib.import_module(name)
    except ImportError:
        return None
    for candidate in (module, _submodule(name, "_api")):
        if candidate is not None and all(hasattr(candidate, attr) for attr in _REQUIRED):
            return candidate
    return None


def _submodule(package: str, sub: str) -> ModuleType | None:
    """Import `package.sub`, or None when it does not exist."""
    try:
        return importlib.import_module(f"{package}.{sub}")
    except ImportError:
        return None


def load_nixl(candidates: tuple[str, ...] = NIXL_CANDIDATES) -> ModuleType:
    """Return the first importable module providing `nixl_agent` / `nixl_agent_config`.

    Raises `RuntimeError` naming the fix when no candidate can be imported.
    """
    for name in candidates:
        module = _module_with_api(name)
        if module is not None:
            return module
    tried = ", ".join(candidates)
    raise RuntimeError(
        f"NIXL is not importable (tried {tried}). Install it with `pip install nixl` "
        "(or the build for your CUDA: `pip install nixl-cu13` / `nixl-cu12`), or disable "
        "peer-to-peer transfer (leave ec_enable_nixl unset) to run the local tier only."
    )
