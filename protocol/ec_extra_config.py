"""The CPU connector's `ec_connector_extra_config`, and the vocabulary both EC configs share.

Part of the local tier: imports no nixl, zmq or msgspec (R-E02), and reads no environment
itself: the side-channel variables come in as an explicit `env` mapping.

- `ECRole`, `EC_ROLES` and the defaults of every timeout (R-E12), ZMQ heartbeat and side
  channel setting (R-E09);
- `ECExtraConfig` / `parse_ec_extra_config`: the extra config typed and defaulted.

Every rejection names the offending key and what is accepted. Bad values raise
`LocalProtocolError`; an unset `ec_cpu_bytes` raises `ValueError`, as the seed requires.
`ec_config` re-exports all of it beside the transfer config.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, TypeGuard

from kvhandoff.protocol.errors import LocalProtocolError

__all__ = [
    "CONSUMER_ROLES",
    "DEFAULT_CONSUMER_ACK_TIMEOUT_S",
    "DEFAULT_NIXL_BACKEND",
    "DEFAULT_NIXL_READ_TIMEOUT_S",
    "DEFAULT_NOT_READY_TIMEOUT_S",
    "DEFAULT_PIN_LEASE_S",
    "DEFAULT_PUBLISH_PIN_S",
    "DEFAULT_READ_QUARANTINE_S",
    "DEFAULT_SIDE_CHANNEL_HOST",
    "DEFAULT_SIDE_CHANNEL_PORT",
    "DEFAULT_ZMQ_HEARTBEAT_INTERVAL_S",
    "DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_ZMQ_HEARTBEAT_TTL_S",
    "EC_ROLES",
    "ENABLE_NIXL_STRINGS",
    "EXTRA_CONFIG_KEYS",
    "PRODUCER_ROLES",
    "SIDE_CHANNEL_HOST_ENV",
    "SIDE_CHANNEL_HOST_ENV_ALIAS",
    "SIDE_CHANNEL_PORT_ENV",
    "SIDE_CHANNEL_PORT_ENV_ALIAS",
    "ECExtraConfig",
    "ECRole",
    "describe",
    "is_int",
    "parse_ec_extra_config",
    "reject_unknown",
]

ECRole = Literal["ec_producer", "ec_consumer", "ec_both"]
EC_ROLES: Final[tuple[ECRole, ...]] = ("ec_producer", "ec_consumer", "ec_both")
PRODUCER_ROLES: Final[frozenset[str]] = frozenset({"ec_producer", "ec_both"})
CONSUMER_ROLES: Final[frozenset[str]] = frozenset({"ec_consumer", "ec_both"})

DEFAULT_CONSUMER_ACK_TIMEOUT_S: Final[float] = 2.0
DEFAULT_NIXL_READ_TIMEOUT_S: Final[float] = 20.0
DEFAULT_READ_QUARANTINE_S: Final[float] = 60.0
DEFAULT_PIN_LEASE_S: Final[float] = 30.0
DEFAULT_PUBLISH_PIN_S: Final[float] = 5.0
DEFAULT_NOT_READY_TIMEOUT_S: Final[float] = 60.0
DEFAULT_ZMQ_HEARTBEAT_INTERVAL_S: Final[float] = 2.0
DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S: Final[float] = 4.0
DEFAULT_ZMQ_HEARTBEAT_TTL_S: Final[float] = 8.0
DEFAULT_NIXL_BACKEND: Final[str] = "UCX"
DEFAULT_SIDE_CHANNEL_HOST: Final[str] = "localhost"
DEFAULT_SIDE_CHANNEL_PORT: Final[int] = 5601

SIDE_CHANNEL_HOST_ENV: Final[str] = "VLLM_EC_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV: Final[str] = "VLLM_EC_SIDE_CHANNEL_PORT"
SIDE_CHANNEL_HOST_ENV_ALIAS: Final[str] = "KVHANDOFF_EC_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV_ALIAS: Final[str] = "KVHANDOFF_EC_SIDE_CHANNEL_PORT"

ENABLE_NIXL_STRINGS: Final[frozenset[str]] = frozenset({"true", "1", "yes"})
"""String values of `ec_enable_nixl` that enable P2P, compared after `strip().lower()`."""

TIMEOUT_KEYS: Final[dict[str, float]] = {
    "consumer_ack_timeout_s": DEFAULT_CONSUMER_ACK_TIMEOUT_S,
    "nixl_read_timeout_s": DEFAULT_NIXL_READ_TIMEOUT_S,
    "read_quarantine_s": DEFAULT_READ_QUARANTINE_S,
    "pin_lease_s": DEFAULT_PIN_LEASE_S,
    "producer_publish_pin_s": DEFAULT_PUBLISH_PIN_S,
    "consumer_not_ready_timeout_s": DEFAULT_NOT_READY_TIMEOUT_S,
    "zmq_heartbeat_interval_s": DEFAULT_ZMQ_HEARTBEAT_INTERVAL_S,
    "zmq_heartbeat_timeout_s": DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S,
    "zmq_heartbeat_ttl_s": DEFAULT_ZMQ_HEARTBEAT_TTL_S,
}

EXTRA_CONFIG_KEYS: Final[tuple[str, ...]] = (
    "ec_cpu_bytes",
    "ec_enable_nixl",
    "nixl_backend",
    *TIMEOUT_KEYS,
)


def describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def reject_unknown(given: Mapping[str, Any], accepted: tuple[str, ...], where: str) -> None:
    unknown = sorted(repr(k) for k in given if k not in accepted)
    if unknown:
        raise LocalProtocolError(
            f"unknown {where} key(s) {', '.join(unknown)}; accepted keys: {', '.join(accepted)}"
        )


@dataclass(frozen=True, slots=True)
class ECExtraConfig:
    """`ec_connector_extra_config` of the CPU connector, typed and defaulted."""

    ec_cpu_bytes: int
    """Size in bytes of the shared CPU mmap region (required)."""
    ec_enable_nixl: bool = False
    """P2P transfer over NIXL in addition to the local tier."""
    nixl_backend: str = DEFAULT_NIXL_BACKEND
    """NIXL backend of the data plane (B-03)."""
    consumer_ack_timeout_s: float = DEFAULT_CONSUMER_ACK_TIMEOUT_S
    """How long a consumer waits for an `XferAck` (R-E12)."""
    nixl_read_timeout_s: float = DEFAULT_NIXL_READ_TIMEOUT_S
    """How long a consumer waits for a NIXL READ to complete (R-E12)."""
    read_quarantine_s: float = DEFAULT_READ_QUARANTINE_S
    """How long a timed-out READ's destination stays quarantined, unevicted (R-E12)."""
    pin_lease_s: float = DEFAULT_PIN_LEASE_S
    """How long a producer keeps an unclaimed grant pinned (R-E12)."""
    producer_publish_pin_s: float = DEFAULT_PUBLISH_PIN_S
    """How long at most a producer keeps a just-published encoding pinned, until its first
    READ completes, so a consumer that asks promptly is served before FIFO eviction can
    take it (R-E06, B-01; `ec.publication_hold`)."""
    consumer_not_ready_timeout_s: float = DEFAULT_NOT_READY_TIMEOUT_S
    """For how long after its first `XferReq` a read retries `NACK_NOT_READY` (R-E08; the
    count is bounded too, by the machine config `consumer_max_not_ready_retries`)."""
    zmq_heartbeat_interval_s: float = DEFAULT_ZMQ_HEARTBEAT_INTERVAL_S
    zmq_heartbeat_timeout_s: float = DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S
    zmq_heartbeat_ttl_s: float = DEFAULT_ZMQ_HEARTBEAT_TTL_S
    side_channel_host: str = DEFAULT_SIDE_CHANNEL_HOST
    """Where a P2P producer binds its ZMQ ROUTER; read from the environment only there."""
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT


def _enable_nixl(value: object) -> bool:
    """`ec_enable_nixl` without type coercion.

    bool: itself. str: True when `value.strip().lower()` is one of `"true"`, `"1"`,
    `"yes"` (so `"TRUE"` and `" Yes "` enable), False for any other string. Unset or null:
    False. Any other type is rejected rather than guessed.
    """
    if value is None:
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        return value.strip().lower() in ENABLE_NIXL_STRINGS
    raise LocalProtocolError(
        f"ec_enable_nixl must be a bool or a string ({', '.join(sorted(ENABLE_NIXL_STRINGS))} "
        f"enable), got {describe(value)}"
    )


def _seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LocalProtocolError(
            f"{key} must be a positive number of seconds, got {describe(value)}"
        )
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise LocalProtocolError(f"{key} must be a positive finite number of seconds, got {value}")
    return seconds


def _cpu_bytes(value: object) -> int:
    if value is None:
        raise ValueError("ec_cpu_bytes is required in ec_connector_extra_config (a positive int)")
    if not is_int(value) or value <= 0:
        raise LocalProtocolError(f"ec_cpu_bytes must be a positive int, got {describe(value)}")
    return value


def _backend(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise LocalProtocolError(
            f"nixl_backend must be a non-empty string (default {DEFAULT_NIXL_BACKEND!r}), "
            f"got {describe(value)}"
        )
    return value.strip()


def _env_value(env: Mapping[str, str], name: str, alias: str) -> tuple[str, str] | None:
    primary, secondary = env.get(name), env.get(alias)
    if primary is not None and secondary is not None and primary != secondary:
        raise LocalProtocolError(
            f"{name}={primary!r} and {alias}={secondary!r} disagree; set one of them"
        )
    if primary is not None:
        return name, primary
    if secondary is not None:
        return alias, secondary
    return None


def _side_channel(env: Mapping[str, str]) -> tuple[str, int]:
    host, port = DEFAULT_SIDE_CHANNEL_HOST, DEFAULT_SIDE_CHANNEL_PORT
    found = _env_value(env, SIDE_CHANNEL_HOST_ENV, SIDE_CHANNEL_HOST_ENV_ALIAS)
    if found is not None:
        name, text = found
        host = text.strip()
        if not host or any(c.isspace() for c in host):
            raise LocalProtocolError(f"{name} must be a host name or address, got {text!r}")
    found = _env_value(env, SIDE_CHANNEL_PORT_ENV, SIDE_CHANNEL_PORT_ENV_ALIAS)
    if found is not None:
        name, text = found
        digits = text.strip()
        if not (digits.isascii() and digits.isdigit() and 0 < int(digits) <= 65535):
            raise LocalProtocolError(f"{name} must be a port number in 1..65535, got {text!r}")
        port = int(digits)
    return host, port


def parse_ec_extra_config(
    extra: Mapping[str, Any],
    *,
    ec_role: ECRole,
    env: Mapping[str, str] | None = None,
) -> ECExtraConfig:
    """Parse the CPU connector's `ec_connector_extra_config` (R-E01, R-E09, R-E12).

    Values are not type-coerced. Unknown keys are rejected. The side-channel address is
    read from `env` (`VLLM_EC_SIDE_CHANNEL_HOST`/`_PORT`, or the `KVHANDOFF_EC_...`
    aliases, which must agree when both are set) only for a producer (`ec_producer`,
    `ec_both`) with `ec_enable_nixl`; otherwise the defaults stand, unused.
    """
    if not isinstance(extra, Mapping):
        raise LocalProtocolError(
            f"ec_connector_extra_config must be an object, got {describe(extra)}"
        )
    if ec_role not in EC_ROLES:
        raise LocalProtocolError(f"ec_role must be one of {', '.join(EC_ROLES)}, got {ec_role!r}")
    reject_unknown(extra, EXTRA_CONFIG_KEYS, "ec_connector_extra_config")
    cpu_bytes = _cpu_bytes(extra.get("ec_cpu_bytes"))
    enable = _enable_nixl(extra.get("ec_enable_nixl"))
    backend = _backend(extra.get("nixl_backend", DEFAULT_NIXL_BACKEND))
    timeouts = {
        key: _seconds(key, extra.get(key, default)) for key, default in TIMEOUT_KEYS.items()
    }
    host, port = DEFAULT_SIDE_CHANNEL_HOST, DEFAULT_SIDE_CHANNEL_PORT
    if enable and ec_role in PRODUCER_ROLES:
        host, port = _side_channel({} if env is None else env)
    return ECExtraConfig(
        ec_cpu_bytes=cpu_bytes,
        ec_enable_nixl=enable,
        nixl_backend=backend,
        side_channel_host=host,
        side_channel_port=port,
        **timeouts,
    )
