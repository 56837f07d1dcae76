"""Settings of the transition trace (`kvhandoff.adapters.trace`): where it goes and how
large a file may grow, from the environment or a config mapping. Off by default."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvhandoff.adapters.clock import real_clock
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = [
    "CONFIG_KEYS",
    "ENV",
    "ENV_BACKUPS",
    "ENV_MAX_BYTES",
    "ENV_RUN",
    "TraceConfig",
    "apply_trace_config",
    "split_trace_config",
    "trace_settings",
]

ENV = "KVHANDOFF_TRACE"
ENV_MAX_BYTES = "KVHANDOFF_TRACE_MAX_BYTES"
ENV_BACKUPS = "KVHANDOFF_TRACE_BACKUPS"
ENV_RUN = "KVHANDOFF_TRACE_RUN"
"""Names the run the processes belong to (`check-trace` compares P and D within a run)."""
CONFIG_KEYS = ("trace", "trace_max_bytes", "trace_backups")
DEFAULT_MAX_BYTES = 64 * 2**20
DEFAULT_BACKUPS = 4


@dataclass(frozen=True, slots=True)
class TraceConfig:
    """Where the trace goes (`target`; empty: off) and how large a file may grow."""

    target: str = ""
    max_bytes: int = DEFAULT_MAX_BYTES
    backups: int = DEFAULT_BACKUPS

    def __post_init__(self) -> None:
        if not isinstance(self.target, str):
            raise LocalProtocolError(f"trace must be a path or 'log', got {self.target!r}")
        for name in ("max_bytes", "backups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LocalProtocolError(f"trace_{name} must be a non-negative int, got {value!r}")
        if self.max_bytes < 4096:
            raise LocalProtocolError(f"trace_max_bytes must be at least 4096, got {self.max_bytes}")

    @property
    def enabled(self) -> bool:
        return bool(self.target)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TraceConfig:
        """`KVHANDOFF_TRACE`, `KVHANDOFF_TRACE_MAX_BYTES`, `KVHANDOFF_TRACE_BACKUPS`."""
        env = os.environ if env is None else env
        return cls(
            env.get(ENV, "").strip(),
            _int(env.get(ENV_MAX_BYTES), DEFAULT_MAX_BYTES, ENV_MAX_BYTES),
            _int(env.get(ENV_BACKUPS), DEFAULT_BACKUPS, ENV_BACKUPS),
        )

    @classmethod
    def from_mapping(
        cls, raw: Mapping[str, Any], env: Mapping[str, str] | None = None
    ) -> TraceConfig:
        """The config keys `trace`, `trace_max_bytes`, `trace_backups`, over the
        environment's settings."""
        base = cls.from_env(env)
        return cls(
            str(raw.get("trace", base.target)),
            raw.get("trace_max_bytes", base.max_bytes),
            raw.get("trace_backups", base.backups),
        )


def trace_settings(given: TraceConfig | None, clock: Callable[[], float]) -> TraceConfig:
    """`given`, else the environment's settings for a side on the production clock (a side
    on a virtual clock is a simulation or a test: its simulator traces it, if anything)."""
    if given is not None:
        return given
    return TraceConfig.from_env() if clock is real_clock else TraceConfig()


def split_trace_config(
    raw: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> tuple[TraceConfig, dict[str, Any]]:
    """The trace settings of a config mapping (over the environment's) and the rest."""
    rest = {k: v for k, v in raw.items() if k not in CONFIG_KEYS}
    return TraceConfig.from_mapping(raw, env), rest


def apply_trace_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """For a role process: the trace keys of a config mapping become this process's
    trace settings (its environment, which every side built later reads); the rest is
    returned for the protocol's own config."""
    config, rest = split_trace_config(raw)
    if any(key in raw for key in CONFIG_KEYS):
        os.environ[ENV] = config.target
        os.environ[ENV_MAX_BYTES] = str(config.max_bytes)
        os.environ[ENV_BACKUPS] = str(config.backups)
    return rest


def _int(text: str | None, default: int, name: str) -> int:
    if text is None or not text.strip():
        return default
    try:
        return int(text)
    except ValueError:
        raise LocalProtocolError(f"{name} must be an integer, got {text!r}") from None
