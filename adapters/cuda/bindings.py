"""NVIDIA's cuda-python (the `gpu` extra), loaded lazily and shared by every CUDA adapter:
the IPC runtime (`ipc_runtime`), the encoder-cache copy engine's runtime calls
(`runtime`) and its row kernel (`row_kernel`, through `cuda.core`).

Nothing here imports `cuda.bindings` or `cuda.core` at module import time: `available()`
says whether they load, and each caller gets the modules through `runtime()`,
`driver()` or `core()`, so the CPU-only install and CI never touch CUDA. `call` turns
cuda.bindings' `(error, *values)` results into values or the caller's error type (a
`KvHandoffError`), never a crash.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from types import ModuleType
from typing import cast

from kvhandoff.protocol.errors import KvHandoffError

MISSING = "needs cuda-python: pip install 'kvhandoff[gpu]'"


class CudaError(KvHandoffError):
    """A call through cuda-python failed (or cuda-python is missing)."""


@cache
def modules() -> tuple[ModuleType, ModuleType] | None:
    """`cuda.bindings.runtime` and `cuda.bindings.driver`, or None where they do not load."""
    try:
        runtime = importlib.import_module("cuda.bindings.runtime")
        driver = importlib.import_module("cuda.bindings.driver")
    except ImportError:
        return None
    return runtime, driver


def available() -> bool:
    """Whether `cuda.bindings` imports (not whether a GPU is present)."""
    return modules() is not None


def runtime(error: type[KvHandoffError] = CudaError) -> ModuleType:
    mods = modules()
    if mods is None:
        raise error(f"CUDA {MISSING}")
    return mods[0]


def driver(error: type[KvHandoffError] = CudaError) -> ModuleType:
    mods = modules()
    if mods is None:
        raise error(f"CUDA {MISSING}")
    return mods[1]


@cache
def core() -> ModuleType | None:
    """`cuda.core` (its `Program`, `ProgramOptions`, `ObjectCode`), from the top-level
    package where this version exports it, else from `cuda.core.experimental`."""
    for name in ("cuda.core", "cuda.core.experimental"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "Program"):
            return module
    return None


def is_success(err: object) -> bool:
    """Whether a cuda.bindings error value (an enum member or an int) means success."""
    return int(cast(int, getattr(err, "value", err))) == 0


def check(name: str, result: object, error: type[KvHandoffError] = CudaError) -> tuple[object, ...]:
    """cuda.bindings returns (error, *values); raise `error` on a failure, return the values."""
    values = result if isinstance(result, tuple) else (result,)
    err = values[0]
    if not is_success(err):
        raise error(f"{name} failed: {err!r}")
    return values[1:]


def call(
    module: ModuleType, name: str, *args: object, error: type[KvHandoffError] = CudaError
) -> tuple[object, ...]:
    """`module.name(*args)`, checked (a binding that changed shape is an `error` too)."""
    fn = cast(Callable[..., object], getattr(module, name))
    try:
        result = fn(*args)
    except (TypeError, ValueError, AttributeError) as exc:
        raise error(f"{name}: {exc}") from exc
    return check(name, result, error)


def as_int(value: object) -> int:
    """An int from a plain int or a cuda.bindings pointer/handle object."""
    if isinstance(value, int):
        return value
    return int(cast(int, value))  # CUdeviceptr and friends implement __int__
