"""Configuration of the encoder-cache connector: transfer config, extra config, layout."""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol.ec_config import (
    EC_ROLES,
    EXTRA_CONFIG_KEYS,
    SIDE_CHANNEL_HOST_ENV,
    SIDE_CHANNEL_HOST_ENV_ALIAS,
    SIDE_CHANNEL_PORT_ENV,
    SIDE_CHANNEL_PORT_ENV_ALIAS,
    TRANSFER_CONFIG_KEYS,
    ECExtraConfig,
    ECLayout,
    ECRole,
    ECTransferConfig,
    parse_ec_extra_config,
    parse_ec_transfer_config,
)
from kvhandoff.protocol.errors import LocalProtocolError

GIB = 1 << 30


def extra(**overrides: Any) -> ECExtraConfig:
    role: ECRole = overrides.pop("ec_role", "ec_both")
    env: dict[str, str] | None = overrides.pop("env", None)
    config: dict[str, Any] = {"ec_cpu_bytes": GIB}
    config.update(overrides)
    return parse_ec_extra_config(config, ec_role=role, env=env)


# -- ec_transfer_config (R-E01) ----------------------------------------------------------

SEED_LOCAL = """{
  "ec_connector": "ECCPUConnector",
  "ec_role": "ec_both",
  "ec_connector_extra_config": {"ec_cpu_bytes": 1073741824}
}"""
SEED_PRODUCER = """{
  "ec_connector": "ECCPUConnector",
  "ec_role": "ec_producer",
  "ec_connector_extra_config": {"ec_enable_nixl": true, "ec_cpu_bytes": 1073741824}
}"""
SEED_CONSUMER = SEED_PRODUCER.replace("ec_producer", "ec_consumer")


def test_R_E01_seed_examples_parse() -> None:
    local = parse_ec_transfer_config(SEED_LOCAL)
    assert (local.ec_connector, local.ec_role) == ("ECCPUConnector", "ec_both")
    assert local.extra_config() == ECExtraConfig(ec_cpu_bytes=GIB)
    producer = parse_ec_transfer_config(SEED_PRODUCER).extra_config({})
    assert producer.ec_enable_nixl is True
    consumer = parse_ec_transfer_config(SEED_CONSUMER)
    assert consumer.ec_role == "ec_consumer"
    assert consumer.extra_config().ec_enable_nixl is True


def test_R_E01_defaults() -> None:
    config = ECTransferConfig()
    assert config.ec_connector is None
    assert config.ec_role is None
    assert dict(config.ec_connector_extra_config) == {}
    assert config.ec_connector_module_path is None


def test_R_E01_engine_id_defaults_to_a_random_uuid4() -> None:
    a = parse_ec_transfer_config(SEED_LOCAL)
    b = parse_ec_transfer_config(SEED_LOCAL)
    assert uuid.UUID(a.engine_id).version == 4
    assert a.engine_id != b.engine_id
    assert ECTransferConfig().engine_id != ECTransferConfig().engine_id
    fixed = parse_ec_transfer_config(SEED_LOCAL, engine_id_factory=lambda: "engine-7")
    assert fixed.engine_id == "engine-7"
    given_id = parse_ec_transfer_config({**json.loads(SEED_LOCAL), "engine_id": "e-1"})
    assert given_id.engine_id == "e-1"


def test_R_E01_role_is_required_when_a_connector_is_set() -> None:
    with pytest.raises(LocalProtocolError, match=r"ec_role is required.*ec_producer"):
        parse_ec_transfer_config({"ec_connector": "ECCPUConnector"})
    assert parse_ec_transfer_config({"ec_role": "ec_both"}).ec_connector is None


@pytest.mark.parametrize("role", ["producer", "EC_PRODUCER", 1, ["ec_both"]])
def test_R_E01_invalid_role_names_the_accepted_values(role: Any) -> None:
    with pytest.raises(
        LocalProtocolError, match=r"ec_role must be one of ec_producer, ec_consumer"
    ):
        parse_ec_transfer_config({"ec_connector": "ECCPUConnector", "ec_role": role})


def test_R_E01_unknown_top_level_keys_are_named() -> None:
    with pytest.raises(LocalProtocolError, match=r"'ec_rol'.*accepted keys: ec_connector"):
        parse_ec_transfer_config({"ec_connector": "ECCPUConnector", "ec_rol": "ec_both"})


@pytest.mark.parametrize(
    ("config", "key"),
    [
        ({"ec_connector": 5, "ec_role": "ec_both"}, "ec_connector"),
        ({"ec_connector": "", "ec_role": "ec_both"}, "ec_connector"),
        ({"ec_connector_extra_config": [1]}, "ec_connector_extra_config"),
        ({"engine_id": 3}, "engine_id"),
        ({"engine_id": ""}, "engine_id"),
        ({"ec_connector_module_path": 1.5}, "ec_connector_module_path"),
    ],
)
def test_R_E01_bad_values_name_their_key(config: dict[str, Any], key: str) -> None:
    with pytest.raises(LocalProtocolError, match=key):
        parse_ec_transfer_config(config)


def test_R_E01_bad_json_is_a_local_error() -> None:
    with pytest.raises(LocalProtocolError, match="not valid JSON"):
        parse_ec_transfer_config("{not json")
    with pytest.raises(LocalProtocolError, match="must be an object"):
        parse_ec_transfer_config("[1, 2]")


def test_R_E01_to_dict_round_trips_and_extra_is_a_copy() -> None:
    source: dict[str, Any] = {"ec_cpu_bytes": GIB}
    config = ECTransferConfig("ECCPUConnector", "ec_consumer", source, "e-1", "my.module")
    source["ec_cpu_bytes"] = 1
    assert config.ec_connector_extra_config["ec_cpu_bytes"] == GIB
    assert ECTransferConfig.from_dict(config.to_dict()) == config
    assert set(config.to_dict()) == set(TRANSFER_CONFIG_KEYS)


@pytest.mark.parametrize(
    ("role", "producer", "consumer", "encoder_only"),
    [
        ("ec_producer", True, False, True),
        ("ec_consumer", False, True, False),
        ("ec_both", True, True, False),
        (None, False, False, False),
    ],
)
def test_R_E13_roles(
    role: ECRole | None, producer: bool, consumer: bool, encoder_only: bool
) -> None:
    config = ECTransferConfig(ec_role=role)
    assert (config.is_producer, config.is_consumer, config.encoder_only) == (
        producer,
        consumer,
        encoder_only,
    )


def test_R_E01_extra_config_needs_a_role() -> None:
    with pytest.raises(LocalProtocolError, match="ec_role"):
        ECTransferConfig().extra_config()


# -- ec_connector_extra_config -----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "enabled"),
    [
        (True, True),
        (False, False),
        (None, False),
        ("true", True),
        ("1", True),
        ("yes", True),
        ("TRUE", True),
        (" Yes ", True),
        ("false", False),
        ("0", False),
        ("no", False),
        ("on", False),
        ("y", False),
        ("", False),
        ("truthy", False),
    ],
)
def test_R_E01_enable_nixl_is_not_type_coerced(value: Any, enabled: bool) -> None:
    assert extra(ec_enable_nixl=value).ec_enable_nixl is enabled


@pytest.mark.parametrize("value", [1, 0, 1.0, [True], {"on": True}])
def test_R_E01_enable_nixl_of_another_type_is_rejected(value: Any) -> None:
    with pytest.raises(LocalProtocolError, match=r"ec_enable_nixl must be a bool or a string"):
        extra(ec_enable_nixl=value)


def test_R_E01_enable_nixl_defaults_off() -> None:
    assert extra().ec_enable_nixl is False


@pytest.mark.parametrize("config", [{}, {"ec_cpu_bytes": None}, {"ec_enable_nixl": True}])
def test_R_E01_unset_ec_cpu_bytes_raises_value_error(config: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="ec_cpu_bytes") as info:
        parse_ec_extra_config(config, ec_role="ec_both")
    assert type(info.value) is ValueError


@pytest.mark.parametrize("value", [0, -5, True, 1.5, "1073741824"])
def test_R_E01_ec_cpu_bytes_must_be_a_positive_int(value: Any) -> None:
    with pytest.raises(LocalProtocolError, match="ec_cpu_bytes must be a positive int"):
        extra(ec_cpu_bytes=value)


def test_R_E12_default_timeouts() -> None:
    config = extra()
    assert config.consumer_ack_timeout_s == 2.0
    assert config.nixl_read_timeout_s == 20.0
    assert config.read_quarantine_s == 60.0
    assert config.pin_lease_s == 30.0


def test_R_E09_default_zmq_heartbeats_and_side_channel() -> None:
    config = extra()
    assert (
        config.zmq_heartbeat_interval_s,
        config.zmq_heartbeat_timeout_s,
        config.zmq_heartbeat_ttl_s,
    ) == (2.0, 4.0, 8.0)
    assert (config.side_channel_host, config.side_channel_port) == ("localhost", 5601)


def test_B03_nixl_backend_defaults_to_ucx_and_is_configurable() -> None:
    assert extra().nixl_backend == "UCX"
    assert extra(nixl_backend="LIBFABRIC").nixl_backend == "LIBFABRIC"
    with pytest.raises(LocalProtocolError, match="nixl_backend"):
        extra(nixl_backend=3)


def test_R_E12_timeouts_can_be_overridden() -> None:
    config = extra(consumer_ack_timeout_s=5, pin_lease_s=2.5)
    assert config.consumer_ack_timeout_s == 5.0
    assert isinstance(config.consumer_ack_timeout_s, float)
    assert config.pin_lease_s == 2.5


@pytest.mark.parametrize("value", [True, "2.0", 0, -1.0, math.nan, math.inf, None, [2]])
def test_R_E01_consumer_ack_timeout_must_be_a_positive_number(value: Any) -> None:
    with pytest.raises(LocalProtocolError, match="consumer_ack_timeout_s must be a positive"):
        extra(consumer_ack_timeout_s=value)


def test_R_E01_unknown_extra_keys_are_named() -> None:
    with pytest.raises(LocalProtocolError, match=r"'ec_enable_nixI'.*accepted keys: ec_cpu_bytes"):
        extra(ec_enable_nixI=True)


# -- side channel (R-E09) ----------------------------------------------------------------

ENV = {SIDE_CHANNEL_HOST_ENV: "10.1.2.3", SIDE_CHANNEL_PORT_ENV: "7000"}


@pytest.mark.parametrize("role", ["ec_producer", "ec_both"])
def test_R_E09_p2p_producer_reads_side_channel_env(role: ECRole) -> None:
    config = extra(ec_role=role, ec_enable_nixl=True, env=ENV)
    assert (config.side_channel_host, config.side_channel_port) == ("10.1.2.3", 7000)


@pytest.mark.parametrize(
    ("role", "nixl"), [("ec_consumer", True), ("ec_producer", False), ("ec_both", "no")]
)
def test_R_E09_side_channel_env_ignored_unless_p2p_producer(role: ECRole, nixl: Any) -> None:
    bad_env = {SIDE_CHANNEL_PORT_ENV: "not-a-port"}
    config = extra(ec_role=role, ec_enable_nixl=nixl, env={**ENV, **bad_env})
    assert (config.side_channel_host, config.side_channel_port) == ("localhost", 5601)


def test_R_E09_side_channel_aliases() -> None:
    env = {SIDE_CHANNEL_HOST_ENV_ALIAS: "node-2", SIDE_CHANNEL_PORT_ENV_ALIAS: "6001"}
    config = extra(ec_role="ec_producer", ec_enable_nixl=True, env=env)
    assert (config.side_channel_host, config.side_channel_port) == ("node-2", 6001)
    agreeing = {**env, SIDE_CHANNEL_PORT_ENV: "6001"}
    assert extra(ec_role="ec_producer", ec_enable_nixl=True, env=agreeing).side_channel_port == 6001
    clashing = {**env, SIDE_CHANNEL_PORT_ENV: "6002"}
    with pytest.raises(LocalProtocolError, match=rf"{SIDE_CHANNEL_PORT_ENV}.*disagree"):
        extra(ec_role="ec_producer", ec_enable_nixl=True, env=clashing)


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({SIDE_CHANNEL_PORT_ENV: "0"}, SIDE_CHANNEL_PORT_ENV),
        ({SIDE_CHANNEL_PORT_ENV: "65536"}, SIDE_CHANNEL_PORT_ENV),
        ({SIDE_CHANNEL_PORT_ENV: "56o1"}, SIDE_CHANNEL_PORT_ENV),
        ({SIDE_CHANNEL_PORT_ENV_ALIAS: "-1"}, SIDE_CHANNEL_PORT_ENV_ALIAS),
        ({SIDE_CHANNEL_HOST_ENV: " "}, SIDE_CHANNEL_HOST_ENV),
        ({SIDE_CHANNEL_HOST_ENV: "a b"}, SIDE_CHANNEL_HOST_ENV),
    ],
)
def test_R_E09_bad_side_channel_env_names_the_variable(env: dict[str, str], name: str) -> None:
    with pytest.raises(LocalProtocolError, match=name):
        extra(ec_role="ec_producer", ec_enable_nixl=True, env=env)


# -- layout (R-E01) ----------------------------------------------------------------------


def test_R_E01_layout_maths_with_deepstack() -> None:
    layout = ECLayout.from_model(4096, 3, "bfloat16", GIB)
    assert layout.hidden_dim == 4096 * 4
    assert layout.block_size_bytes == 4096 * 4 * 2
    assert layout.num_blocks == GIB // (4096 * 4 * 2)
    assert layout.region_bytes == layout.num_blocks * layout.block_size_bytes


def test_R_E01_layout_rounds_the_region_down_to_whole_blocks() -> None:
    layout = ECLayout.from_model(1000, 0, 4, 10_000)
    assert (layout.block_size_bytes, layout.num_blocks, layout.region_bytes) == (4000, 2, 8000)
    assert layout.blocks_for(1) == 1
    assert layout.blocks_for(4000) == 1
    assert layout.blocks_for(4001) == 2


@pytest.mark.parametrize(
    ("dtype", "size"), [("torch.float16", 2), ("half", 2), ("float32", 4), ("float8_e4m3fn", 1)]
)
def test_R_E01_layout_dtype_names(dtype: str, size: int) -> None:
    assert ECLayout.from_model(8, 0, dtype, 1024).dtype_size == size


def test_R_E01_layout_with_zero_blocks_is_an_error() -> None:
    with pytest.raises(LocalProtocolError, match=r"ec_cpu_bytes 100 holds no block of 8192"):
        ECLayout.from_model(4096, 0, "float16", 100)


@pytest.mark.parametrize(
    ("args", "name"),
    [
        ((0, 0, "float16", GIB), "out_hidden_size"),
        ((8, -1, "float16", GIB), "num_deepstack_layers"),
        ((8, 0, "complex32x", GIB), "unknown dtype"),
        ((8, 0, 0, GIB), "dtype"),
        ((8, 0, "float16", 0), "ec_cpu_bytes"),
        ((8, True, "float16", GIB), "num_deepstack_layers"),
    ],
)
def test_R_E01_layout_rejects_bad_inputs(args: tuple[Any, ...], name: str) -> None:
    with pytest.raises(LocalProtocolError, match=name):
        ECLayout.from_model(*args)


# -- fuzzing the parsers -----------------------------------------------------------------

json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=12)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)
transfer_keys = st.one_of(st.sampled_from(TRANSFER_CONFIG_KEYS), st.text(max_size=12))
transfer_values = st.one_of(
    json_values,
    st.sampled_from([*EC_ROLES, "ECCPUConnector"]),
    st.dictionaries(st.sampled_from(EXTRA_CONFIG_KEYS), json_values, max_size=4),
)


def _assert_names_a_key(exc: Exception, given_keys: set[str], known: tuple[str, ...]) -> None:
    """Unknown keys are rejected first, by repr; any other error names a known key."""
    message = str(exc)
    unknown = [key for key in given_keys if key not in known]
    if unknown:
        assert any(repr(key) in message for key in unknown), message
    else:
        assert any(key in message for key in known), message


@settings(max_examples=300)
@given(st.dictionaries(transfer_keys, transfer_values, max_size=6))
def test_R_E01_transfer_config_parser_raises_only_named_local_errors(d: dict[str, Any]) -> None:
    try:
        config = parse_ec_transfer_config(d)
    except LocalProtocolError as exc:
        _assert_names_a_key(exc, set(d), TRANSFER_CONFIG_KEYS)
        return
    assert config.ec_connector is None or config.ec_role in EC_ROLES


extra_keys = st.one_of(st.sampled_from(EXTRA_CONFIG_KEYS), st.text(max_size=12))
extra_values = st.one_of(
    json_values, st.integers(-3, 2**40), st.floats(-1.0, 100.0), st.sampled_from(["1", "yes"])
)
env_values = st.dictionaries(
    st.sampled_from(
        [
            SIDE_CHANNEL_HOST_ENV,
            SIDE_CHANNEL_PORT_ENV,
            SIDE_CHANNEL_HOST_ENV_ALIAS,
            SIDE_CHANNEL_PORT_ENV_ALIAS,
        ]
    ),
    st.one_of(st.text(max_size=8), st.integers(0, 70000).map(str)),
)


@settings(max_examples=300)
@given(
    d=st.dictionaries(extra_keys, extra_values, max_size=6),
    role=st.sampled_from(EC_ROLES),
    env=env_values,
)
def test_R_E01_extra_config_parser_raises_only_named_errors(
    d: dict[str, Any], role: ECRole, env: dict[str, str]
) -> None:
    try:
        config = parse_ec_extra_config(d, ec_role=role, env=env)
    except (LocalProtocolError, ValueError) as exc:
        _assert_names_a_key(exc, set(d), (*EXTRA_CONFIG_KEYS, *env))
        return
    assert config.ec_cpu_bytes > 0
    assert 0 < config.side_channel_port <= 65535
    assert math.isfinite(config.consumer_ack_timeout_s) and config.consumer_ack_timeout_s > 0
