"""Configuration of the encoder-cache (EC) connector: transfer config, extra config, layout.

Part of the local tier: imports no nixl, zmq or msgspec (R-E02), and reads no environment
itself: the side-channel variables come in as an explicit `env` mapping.

- `ECTransferConfig` / `parse_ec_transfer_config`: the `--ec-transfer-config` object (R-E01).
- `ECExtraConfig` / `parse_ec_extra_config`: `ec_connector_extra_config` of the CPU
  connector, with the timeouts (R-E12), ZMQ heartbeats and side channel (R-E09).
- `ECLayout`: block size and block count of the CPU region (R-E01).

Every rejection names the offending key and what is accepted. Bad values raise
`LocalProtocolError`; an unset `ec_cpu_bytes` raises `ValueError`, as the seed requires.
"""

from __future__ import annotations

import json
import math
import types
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeGuard

from kvhandoff.protocol.ec_status import DTYPE_SIZES, canonical_dtype_name
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = [
    "DEFAULT_CONSUMER_ACK_TIMEOUT_S",
    "DEFAULT_NIXL_BACKEND",
    "DEFAULT_NIXL_READ_TIMEOUT_S",
    "DEFAULT_PIN_LEASE_S",
    "DEFAULT_READ_QUARANTINE_S",
    "DEFAULT_SIDE_CHANNEL_HOST",
    "DEFAULT_SIDE_CHANNEL_PORT",
    "DEFAULT_ZMQ_HEARTBEAT_INTERVAL_S",
    "DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S",
    "DEFAULT_ZMQ_HEARTBEAT_TTL_S",
    "EC_ROLES",
    "ENABLE_NIXL_STRINGS",
    "EXTRA_CONFIG_KEYS",
    "SIDE_CHANNEL_HOST_ENV",
    "SIDE_CHANNEL_HOST_ENV_ALIAS",
    "SIDE_CHANNEL_PORT_ENV",
    "SIDE_CHANNEL_PORT_ENV_ALIAS",
    "TRANSFER_CONFIG_KEYS",
    "ECExtraConfig",
    "ECLayout",
    "ECRole",
    "ECTransferConfig",
    "parse_ec_extra_config",
    "parse_ec_transfer_config",
]

ECRole = Literal["ec_producer", "ec_consumer", "ec_both"]
EC_ROLES: Final[tuple[ECRole, ...]] = ("ec_producer", "ec_consumer", "ec_both")
_PRODUCER_ROLES: Final[frozenset[str]] = frozenset({"ec_producer", "ec_both"})
_CONSUMER_ROLES: Final[frozenset[str]] = frozenset({"ec_consumer", "ec_both"})

DEFAULT_CONSUMER_ACK_TIMEOUT_S: Final[float] = 2.0
DEFAULT_NIXL_READ_TIMEOUT_S: Final[float] = 20.0
DEFAULT_READ_QUARANTINE_S: Final[float] = 60.0
DEFAULT_PIN_LEASE_S: Final[float] = 30.0
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

TRANSFER_CONFIG_KEYS: Final[tuple[str, ...]] = (
    "ec_connector",
    "ec_role",
    "ec_connector_extra_config",
    "engine_id",
    "ec_connector_module_path",
)

_TIMEOUT_KEYS: Final[dict[str, float]] = {
    "consumer_ack_timeout_s": DEFAULT_CONSUMER_ACK_TIMEOUT_S,
    "nixl_read_timeout_s": DEFAULT_NIXL_READ_TIMEOUT_S,
    "read_quarantine_s": DEFAULT_READ_QUARANTINE_S,
    "pin_lease_s": DEFAULT_PIN_LEASE_S,
    "zmq_heartbeat_interval_s": DEFAULT_ZMQ_HEARTBEAT_INTERVAL_S,
    "zmq_heartbeat_timeout_s": DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S,
    "zmq_heartbeat_ttl_s": DEFAULT_ZMQ_HEARTBEAT_TTL_S,
}

EXTRA_CONFIG_KEYS: Final[tuple[str, ...]] = (
    "ec_cpu_bytes",
    "ec_enable_nixl",
    "nixl_backend",
    *_TIMEOUT_KEYS,
)


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _reject_unknown(given: Mapping[str, Any], accepted: tuple[str, ...], where: str) -> None:
    unknown = sorted(repr(k) for k in given if k not in accepted)
    if unknown:
        raise LocalProtocolError(
            f"unknown {where} key(s) {', '.join(unknown)}; accepted keys: {', '.join(accepted)}"
        )


def _optional_str(d: Mapping[str, Any], key: str) -> str | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise LocalProtocolError(
            f"{key} must be a non-empty string or null, got {_describe(value)}"
        )
    return value


# -- ec_transfer_config ------------------------------------------------------------------


def _new_engine_id() -> str:
    return str(uuid.uuid4())


@dataclass(frozen=True, slots=True)
class ECTransferConfig:
    """The `ec_transfer_config` of an engine (R-E01). Validated on construction.

    `ec_connector_extra_config` is kept as given (a read-only copy); the CPU connector
    interprets it with `extra_config`.
    """

    ec_connector: str | None = None
    """Connector class name, e.g. `"ECCPUConnector"`; None disables EC transfer."""
    ec_role: ECRole | None = None
    """Required whenever `ec_connector` is set."""
    ec_connector_extra_config: Mapping[str, Any] = field(
        default_factory=lambda: types.MappingProxyType({})
    )
    """Connector-specific settings (see `ECExtraConfig`)."""
    engine_id: str = field(default_factory=_new_engine_id)
    """Names the NIXL agent; a random UUID4 string by default."""
    ec_connector_module_path: str | None = None
    """Module to load an out-of-tree connector from."""

    def __post_init__(self) -> None:
        if self.ec_connector is not None and (
            not isinstance(self.ec_connector, str) or not self.ec_connector
        ):
            raise LocalProtocolError(
                f"ec_connector must be a non-empty string or null, got "
                f"{_describe(self.ec_connector)}"
            )
        if self.ec_role is not None and self.ec_role not in EC_ROLES:
            raise LocalProtocolError(
                f"ec_role must be one of {', '.join(EC_ROLES)} or null, got "
                f"{_describe(self.ec_role)}"
            )
        if self.ec_connector is not None and self.ec_role is None:
            raise LocalProtocolError(
                f"ec_role is required when ec_connector is set; accepted: {', '.join(EC_ROLES)}"
            )
        extra = self.ec_connector_extra_config
        if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
            raise LocalProtocolError(
                f"ec_connector_extra_config must be an object with string keys, got "
                f"{_describe(extra)}"
            )
        object.__setattr__(self, "ec_connector_extra_config", types.MappingProxyType(dict(extra)))
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise LocalProtocolError(
                f"engine_id must be a non-empty string, got {_describe(self.engine_id)}"
            )
        path = self.ec_connector_module_path
        if path is not None and (not isinstance(path, str) or not path):
            raise LocalProtocolError(
                f"ec_connector_module_path must be a non-empty string or null, got "
                f"{_describe(path)}"
            )

    @property
    def is_producer(self) -> bool:
        """True for `ec_producer` and `ec_both`: this engine saves encodings to the tier."""
        return self.ec_role in _PRODUCER_ROLES

    @property
    def is_consumer(self) -> bool:
        """True for `ec_consumer` and `ec_both`: this engine loads encodings from the tier."""
        return self.ec_role in _CONSUMER_ROLES

    @property
    def encoder_only(self) -> bool:
        """True for `ec_producer` alone: the engine runs the encoder only (R-E13)."""
        return self.ec_role == "ec_producer"

    @classmethod
    def from_dict(
        cls, d: Mapping[str, Any], *, engine_id_factory: Callable[[], str] = _new_engine_id
    ) -> ECTransferConfig:
        """Build from a decoded JSON object; unknown keys raise `LocalProtocolError`.

        A missing or null `engine_id` is drawn from `engine_id_factory`.
        """
        if not isinstance(d, Mapping):
            raise LocalProtocolError(f"ec_transfer_config must be an object, got {_describe(d)}")
        _reject_unknown(d, TRANSFER_CONFIG_KEYS, "ec_transfer_config")
        role = d.get("ec_role")
        if role is not None and role not in EC_ROLES:
            raise LocalProtocolError(
                f"ec_role must be one of {', '.join(EC_ROLES)} or null, got {_describe(role)}"
            )
        extra = d.get("ec_connector_extra_config")
        engine_id = d.get("engine_id")
        return cls(
            ec_connector=_optional_str(d, "ec_connector"),
            ec_role=role,
            ec_connector_extra_config={} if extra is None else extra,
            engine_id=engine_id_factory() if engine_id is None else engine_id,
            ec_connector_module_path=_optional_str(d, "ec_connector_module_path"),
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON-ready form that `from_dict` reads back."""
        return {
            "ec_connector": self.ec_connector,
            "ec_role": self.ec_role,
            "ec_connector_extra_config": dict(self.ec_connector_extra_config),
            "engine_id": self.engine_id,
            "ec_connector_module_path": self.ec_connector_module_path,
        }

    def extra_config(self, env: Mapping[str, str] | None = None) -> ECExtraConfig:
        """`ec_connector_extra_config` parsed for the CPU connector in this role."""
        if self.ec_role is None:
            raise LocalProtocolError(
                f"ec_role is required to parse ec_connector_extra_config; "
                f"accepted: {', '.join(EC_ROLES)}"
            )
        return parse_ec_extra_config(self.ec_connector_extra_config, ec_role=self.ec_role, env=env)


def parse_ec_transfer_config(
    config: str | bytes | Mapping[str, Any],
    *,
    engine_id_factory: Callable[[], str] = _new_engine_id,
) -> ECTransferConfig:
    """Parse `--ec-transfer-config`: a JSON text or an already-decoded object."""
    if isinstance(config, str | bytes):
        try:
            config = json.loads(config)
        except (ValueError, RecursionError) as exc:
            raise LocalProtocolError(f"ec_transfer_config is not valid JSON: {exc}") from exc
    if not isinstance(config, Mapping):
        raise LocalProtocolError(f"ec_transfer_config must be an object, got {_describe(config)}")
    return ECTransferConfig.from_dict(config, engine_id_factory=engine_id_factory)


# -- ec_connector_extra_config -----------------------------------------------------------


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
        f"enable), got {_describe(value)}"
    )


def _seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LocalProtocolError(
            f"{key} must be a positive number of seconds, got {_describe(value)}"
        )
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise LocalProtocolError(f"{key} must be a positive finite number of seconds, got {value}")
    return seconds


def _cpu_bytes(value: object) -> int:
    if value is None:
        raise ValueError("ec_cpu_bytes is required in ec_connector_extra_config (a positive int)")
    if not _is_int(value) or value <= 0:
        raise LocalProtocolError(f"ec_cpu_bytes must be a positive int, got {_describe(value)}")
    return value


def _backend(value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise LocalProtocolError(
            f"nixl_backend must be a non-empty string (default {DEFAULT_NIXL_BACKEND!r}), "
            f"got {_describe(value)}"
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
            f"ec_connector_extra_config must be an object, got {_describe(extra)}"
        )
    if ec_role not in EC_ROLES:
        raise LocalProtocolError(f"ec_role must be one of {', '.join(EC_ROLES)}, got {ec_role!r}")
    _reject_unknown(extra, EXTRA_CONFIG_KEYS, "ec_connector_extra_config")
    cpu_bytes = _cpu_bytes(extra.get("ec_cpu_bytes"))
    enable = _enable_nixl(extra.get("ec_enable_nixl"))
    backend = _backend(extra.get("nixl_backend", DEFAULT_NIXL_BACKEND))
    timeouts = {
        key: _seconds(key, extra.get(key, default)) for key, default in _TIMEOUT_KEYS.items()
    }
    host, port = DEFAULT_SIDE_CHANNEL_HOST, DEFAULT_SIDE_CHANNEL_PORT
    if enable and ec_role in _PRODUCER_ROLES:
        host, port = _side_channel({} if env is None else env)
    return ECExtraConfig(
        ec_cpu_bytes=cpu_bytes,
        ec_enable_nixl=enable,
        nixl_backend=backend,
        side_channel_host=host,
        side_channel_port=port,
        **timeouts,
    )


# -- layout ------------------------------------------------------------------------------


def _positive_int(name: str, value: object, *, minimum: int = 1) -> int:
    if not _is_int(value) or value < minimum:
        raise LocalProtocolError(f"{name} must be an int >= {minimum}, got {_describe(value)}")
    return value


@dataclass(frozen=True, slots=True)
class ECLayout:
    """Block geometry of the CPU region: one block holds one token row of the encoder output.

    `block_size_bytes = hidden_dim * dtype_size`, `num_blocks = ec_cpu_bytes //
    block_size_bytes`; `hidden_dim` counts Qwen3-VL deepstack rows (see `from_model`).
    """

    hidden_dim: int
    dtype_size: int
    ec_cpu_bytes: int

    def __post_init__(self) -> None:
        _positive_int("hidden_dim", self.hidden_dim)
        _positive_int("dtype_size", self.dtype_size)
        _positive_int("ec_cpu_bytes", self.ec_cpu_bytes)
        if self.num_blocks == 0:
            raise LocalProtocolError(
                f"ec_cpu_bytes {self.ec_cpu_bytes} holds no block of {self.block_size_bytes} "
                f"bytes; raise ec_cpu_bytes to at least {self.block_size_bytes}"
            )

    @classmethod
    def from_model(
        cls,
        out_hidden_size: int,
        num_deepstack_layers: int,
        dtype: str | int,
        ec_cpu_bytes: int,
    ) -> ECLayout:
        """Layout of a model: `hidden_dim = out_hidden_size * (1 + num_deepstack_layers)`.

        `dtype` is a name (`"bfloat16"`, `"torch.float16"`, `"half"`, ...) or an element
        size in bytes.
        """
        _positive_int("out_hidden_size", out_hidden_size)
        _positive_int("num_deepstack_layers", num_deepstack_layers, minimum=0)
        if isinstance(dtype, str):
            size = DTYPE_SIZES.get(canonical_dtype_name(dtype)) if dtype else None
            if size is None:
                raise LocalProtocolError(
                    f"unknown dtype {dtype!r}; accepted: {', '.join(DTYPE_SIZES)} "
                    f"(optionally prefixed 'torch.') or an element size in bytes"
                )
        else:
            size = _positive_int("dtype", dtype)
        return cls(
            hidden_dim=out_hidden_size * (1 + num_deepstack_layers),
            dtype_size=size,
            ec_cpu_bytes=ec_cpu_bytes,
        )

    @property
    def block_size_bytes(self) -> int:
        """Bytes of one block (one token row)."""
        return self.hidden_dim * self.dtype_size

    @property
    def num_blocks(self) -> int:
        """Whole blocks the region holds."""
        return self.ec_cpu_bytes // self.block_size_bytes

    @property
    def region_bytes(self) -> int:
        """Bytes of the region actually used by blocks (`<= ec_cpu_bytes`)."""
        return self.num_blocks * self.block_size_bytes

    def blocks_for(self, size_bytes: int) -> int:
        """Blocks needed to hold an encoding of `size_bytes` bytes (rounded up)."""
        _positive_int("size_bytes", size_bytes)
        return -(-size_bytes // self.block_size_bytes)
