"""Configuration of the encoder-cache (EC) connector: transfer config, extra config, layout.

Part of the local tier: imports no nixl, zmq or msgspec (R-E02), and reads no environment
itself: the side-channel variables come in as an explicit `env` mapping.

- `ECTransferConfig` / `parse_ec_transfer_config`: the `--ec-transfer-config` object (R-E01).
- `ECExtraConfig` / `parse_ec_extra_config` (in `ec_extra_config`, re-exported here):
  `ec_connector_extra_config` of the CPU connector, with the timeouts (R-E12), ZMQ
  heartbeats and side channel (R-E09).
- `ECLayout` (in `ec_layout`, re-exported here): block size and block count of the CPU
  region (R-E01).

Every rejection names the offending key and what is accepted. Bad values raise
`LocalProtocolError`; an unset `ec_cpu_bytes` raises `ValueError`, as the seed requires.
"""

from __future__ import annotations

import json
import types
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kvhandoff.protocol.ec_extra_config import (
    CONSUMER_ROLES,
    DEFAULT_CONSUMER_ACK_TIMEOUT_S,
    DEFAULT_NIXL_BACKEND,
    DEFAULT_NIXL_READ_TIMEOUT_S,
    DEFAULT_NOT_READY_TIMEOUT_S,
    DEFAULT_PIN_LEASE_S,
    DEFAULT_PUBLISH_PIN_S,
    DEFAULT_READ_QUARANTINE_S,
    DEFAULT_SIDE_CHANNEL_HOST,
    DEFAULT_SIDE_CHANNEL_PORT,
    DEFAULT_ZMQ_HEARTBEAT_INTERVAL_S,
    DEFAULT_ZMQ_HEARTBEAT_TIMEOUT_S,
    DEFAULT_ZMQ_HEARTBEAT_TTL_S,
    EC_ROLES,
    ENABLE_NIXL_STRINGS,
    EXTRA_CONFIG_KEYS,
    PRODUCER_ROLES,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_HOST_ENV_ALIAS,
    SIDE_CHANNEL_PORT_ENV,
    SIDE_CHANNEL_PORT_ENV_ALIAS,
    ECExtraConfig,
    ECRole,
    describe,
    parse_ec_extra_config,
    reject_unknown,
)
from kvhandoff.protocol.ec_layout import ECLayout
from kvhandoff.protocol.errors import LocalProtocolError

__all__ = [
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

TRANSFER_CONFIG_KEYS: Final[tuple[str, ...]] = (
    "ec_connector",
    "ec_role",
    "ec_connector_extra_config",
    "engine_id",
    "ec_connector_module_path",
)


def _optional_str(d: Mapping[str, Any], key: str) -> str | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise LocalProtocolError(f"{key} must be a non-empty string or null, got {describe(value)}")
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
                f"{describe(self.ec_connector)}"
            )
        if self.ec_role is not None and self.ec_role not in EC_ROLES:
            raise LocalProtocolError(
                f"ec_role must be one of {', '.join(EC_ROLES)} or null, got "
                f"{describe(self.ec_role)}"
            )
        if self.ec_connector is not None and self.ec_role is None:
            raise LocalProtocolError(
                f"ec_role is required when ec_connector is set; accepted: {', '.join(EC_ROLES)}"
            )
        extra = self.ec_connector_extra_config
        if not isinstance(extra, Mapping) or not all(isinstance(k, str) for k in extra):
            raise LocalProtocolError(
                f"ec_connector_extra_config must be an object with string keys, got "
                f"{describe(extra)}"
            )
        object.__setattr__(self, "ec_connector_extra_config", types.MappingProxyType(dict(extra)))
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise LocalProtocolError(
                f"engine_id must be a non-empty string, got {describe(self.engine_id)}"
            )
        path = self.ec_connector_module_path
        if path is not None and (not isinstance(path, str) or not path):
            raise LocalProtocolError(
                f"ec_connector_module_path must be a non-empty string or null, got {describe(path)}"
            )

    @property
    def is_producer(self) -> bool:
        """True for `ec_producer` and `ec_both`: this engine saves encodings to the tier."""
        return self.ec_role in PRODUCER_ROLES

    @property
    def is_consumer(self) -> bool:
        """True for `ec_consumer` and `ec_both`: this engine loads encodings from the tier."""
        return self.ec_role in CONSUMER_ROLES

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
            raise LocalProtocolError(f"ec_transfer_config must be an object, got {describe(d)}")
        reject_unknown(d, TRANSFER_CONFIG_KEYS, "ec_transfer_config")
        role = d.get("ec_role")
        if role is not None and role not in EC_ROLES:
            raise LocalProtocolError(
                f"ec_role must be one of {', '.join(EC_ROLES)} or null, got {describe(role)}"
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
        raise LocalProtocolError(f"ec_transfer_config must be an object, got {describe(config)}")
    return ECTransferConfig.from_dict(config, engine_id_factory=engine_id_factory)
