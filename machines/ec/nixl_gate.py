"""The P2P gate of the encoder-cache tier (R-E02): is NIXL there, without importing it.

The local tier never imports nixl, zmq or msgspec. With `ec_enable_nixl` the connector
first checks that a NIXL build is importable (`importlib.util.find_spec`, which locates a
top-level module without running it) and raises the seed's `RuntimeError` otherwise;
only then are the P2P modules imported.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any, Final

__all__ = ["NIXL_MISSING_MESSAGE", "NIXL_MODULES", "nixl_available", "require_nixl"]

NIXL_MODULES: Final[tuple[str, ...]] = ("nixl", "nixl_cu13", "nixl_cu12")
"""Import names of NIXL: the `nixl` package, or one of its CUDA build packages alone."""

NIXL_MISSING_MESSAGE: Final[str] = (
    "ec_enable_nixl requires NIXL; install the nixl package or remove ec_enable_nixl "
    "from ec_connector_extra_config."
)

FindSpec = Callable[[str], Any]


def nixl_available(find_spec: FindSpec | None = None) -> bool:
    """True when one of `NIXL_MODULES` can be imported (none is imported here)."""
    find = importlib.util.find_spec if find_spec is None else find_spec
    for name in NIXL_MODULES:
        try:
            if find(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def require_nixl(find_spec: FindSpec | None = None) -> None:
    """Raise `RuntimeError` with the seed's message unless NIXL is importable."""
    if not nixl_available(find_spec):
        raise RuntimeError(NIXL_MISSING_MESSAGE)
