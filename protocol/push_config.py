"""Push-mode settings (R-P07, R-P10, R-P11, R-P15) with the seed's defaults, validated."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvhandoff.protocol.errors import LocalProtocolError


@dataclass(frozen=True, slots=True)
class PushConfig:
    """Timeouts in seconds. `push_registration_timeout` defaults to `decoder_kv_blocks_ttl`."""

    kv_lease_duration: float = 30.0
    kv_lease_extension: float = 20.0
    heartbeat_interval: float = 5.0
    decoder_kv_blocks_ttl: float = 480.0
    push_registration_timeout: float | None = None
    push_writer_poll_interval_ms: float = 1.0
    handshake_timeout: float = 10.0
    push_write_timeout: float = 30.0
    nixl_backend: str = "UCX"
    nixl_progress_thread: bool = False
    """NIXL's own progress thread spins a core; by default the writer's passes and the
    engine steps drive UCX progress instead (measured faster on small hosts)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "nixl_progress_thread":
                if not isinstance(value, bool):
                    raise LocalProtocolError(f"nixl_progress_thread must be a bool, got {value!r}")
            elif f.name == "nixl_backend":
                if not isinstance(value, str) or not value:
                    raise LocalProtocolError("nixl_backend must be a non-empty string, e.g. 'UCX'")
            elif value is not None and (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or value <= 0
            ):
                raise LocalProtocolError(
                    f"{f.name} must be a positive number of seconds, got {value!r}"
                )

    @property
    def registration_timeout(self) -> float:
        if self.push_registration_timeout is None:
            return self.decoder_kv_blocks_ttl
        return self.push_registration_timeout

    def machine_config(self) -> dict[str, float]:
        """The config keys the push machines' declared timeouts read."""
        return {
            "kv_lease_duration": self.kv_lease_duration,
            "push_registration_timeout": self.registration_timeout,
            "handshake_timeout": self.handshake_timeout,
            "push_write_timeout": self.push_write_timeout,
        }

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> PushConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise LocalProtocolError(
                f"unknown push config keys {unknown}; accepted: {sorted(known)}"
            )
        return cls(**dict(raw))
