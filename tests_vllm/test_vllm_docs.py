"""docs/vllm.md, the vLLM user guide, checked against vLLM 0.33 and kvhandoff (C-05, R-P01):
every command in its `sh` blocks is one this test knows how to check, and checks it:

- `vllm serve MODEL ...`: vLLM's own serve argument parser takes it; its
  `--kv-transfer-config` / `--ec-transfer-config` become vLLM's `KVTransferConfig` /
  `ECTransferConfig`; vLLM's connector factories load kvhandoff's classes from them; and
  kvhandoff's parsers accept them (every KV extra key is one kvhandoff reads, the EC extra
  config parses, unknown keys refused);
- `kvhandoff proxy ...`: kvhandoff's CLI parses it into a proxy, and in push mode the P
  coordinates it names are those of a P serve line in the same section;
- `curl ... -d BODY`: BODY is a JSON request the proxy builds both legs from;
- `pip install ...`: vLLM 0.33.0, the wheel `python -m build` makes (this version's file
  name) or the checkout with `[gpu]` (the wheel itself is tried by `make wheel-check`);
- `python -m build`: `build` is in the test extra, `make wheel-check` runs it;
- `make TARGET`: a target of the Makefile.

The README's quick start is held to the same checks.

And the reference tables name every `PushConfig` field, every encoder-cache extra key and
every metric kvhandoff registers."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import fields
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "vllm.md"
KV_KEYS = {"transfer_mode", "side_channel_host", "side_channel_port"}  # beside PushConfig's


def sections(path: Path = GUIDE) -> list[tuple[str, list[list[str]]]]:
    """(heading, commands) per `## ` section; a command is its argv, continuation lines
    joined, environment assignments in front kept as argv items."""
    out: list[tuple[str, list[list[str]]]] = []
    heading = ""
    in_block = False
    lines: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:]
            out.append((heading, []))
        elif line.strip() == "```sh":
            in_block, lines = True, []
        elif in_block and line.strip() == "```":
            in_block = False
            text = "\n".join(lines).replace("\\\n", " ")
            for command in text.splitlines():
                if command.strip() and not command.lstrip().startswith("#"):
                    out[-1][1].append(shlex.split(command))
        elif in_block:
            lines.append(line)
    return out


def commands(path: Path = GUIDE) -> list[tuple[str, list[str]]]:
    return [(heading, argv) for heading, cmds in sections(path) for argv in cmds]


def _env_and_argv(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    env: dict[str, str] = {}
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):
        name, _, value = argv[0].partition("=")
        env[name] = value
        argv = argv[1:]
    return env, argv


def _serve_args(argv: list[str]) -> Any:
    """vLLM's own `vllm serve` parser over the line (the model as `--model`)."""
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    assert argv[:2] == ["vllm", "serve"], argv
    model, rest = argv[2], argv[3:]
    assert not model.startswith("-"), "the model comes first, as `vllm serve MODEL`"
    return make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model, *rest])


def _check_kv(transfer: Any, args: Any) -> dict[str, Any]:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvhandoff.integrations.vllm import KVHandoffConnector
    from kvhandoff.integrations.vllm.connector import _config, _engine, transfer_mode
    from kvhandoff.protocol.push_config import PushConfig

    assert KVConnectorFactory.get_connector_class(transfer) is KVHandoffConnector
    extra = dict(transfer.kv_connector_extra_config or {})
    known = {f.name for f in fields(PushConfig)} - {"tp_size", "pp_size"} | KV_KEYS
    assert set(extra) <= known, f"keys kvhandoff would ignore: {set(extra) - known}"
    parallel = SimpleNamespace(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
    )
    config = SimpleNamespace(kv_transfer_config=transfer, parallel_config=parallel)
    push = _config(config)  # PushConfig validates every value
    engine = _engine(config)
    return {
        "role": transfer.kv_role,
        "mode": transfer_mode(config),
        "engine_id": engine.engine_id,
        "side_channel": (engine.host, engine.port),
        "tp": push.tp_size,
    }


def _check_ec(transfer: Any, env: dict[str, str]) -> None:
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from kvhandoff.integrations.vllm import KVHandoffECConnector
    from kvhandoff.integrations.vllm.ec_connector import ec_transfer_config

    assert ECConnectorFactory.get_connector_class(transfer) is KVHandoffECConnector
    config = ec_transfer_config(SimpleNamespace(ec_transfer_config=transfer))
    extra = config.extra_config(env)  # refuses unknown keys, checks every value
    assert extra.ec_enable_nixl, "KVHandoffECConnector is the P2P tier"
    if transfer.ec_role == "ec_producer":
        assert (extra.side_channel_host, str(extra.side_channel_port)) == (
            env["VLLM_EC_SIDE_CHANNEL_HOST"],
            env["VLLM_EC_SIDE_CHANNEL_PORT"],
        ), "a producer's bind address is given on its line"


def _check_proxy(argv: list[str], serves: list[dict[str, Any]]) -> None:
    from kvhandoff.cli import build_parser, proxy_from_args

    args = build_parser().parse_args(argv[1:])
    proxy = proxy_from_args(args)
    try:
        producers = [s for s in serves if s["role"] == "kv_producer"]
        assert producers, "a proxy line follows P's serve line in its section"
        p = producers[-1]
        assert p["mode"] == args.mode
        assert proxy.prefill.port == p["port"]
        if args.mode == "push":
            assert proxy.coordinates is not None
            assert proxy.coordinates.engine_id == p["engine_id"]
            assert (proxy.coordinates.host, proxy.coordinates.port) == p["side_channel"]
            assert proxy.coordinates.tp_size == p["tp"]
        if args.encoder:
            encoders = [s for s in serves if s.get("ec_role") == "ec_producer"]
            assert proxy.encoder is not None and encoders
            assert proxy.encoder.port == encoders[-1]["port"]
            assert p.get("ec_role") == "ec_consumer", "P reads the encodings"
        decoders = [s for s in serves if s["role"] == "kv_consumer"]
        assert decoders and proxy.decode.port == decoders[-1]["port"]
        assert decoders[-1]["mode"] == args.mode
    finally:
        proxy.close()


def check_commands(path: Path) -> dict[str, int]:
    """Check every command of `path`'s `sh` blocks; count them by tool."""
    import tomllib

    from kvhandoff.proxy import prefill_body

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    wheel = f"dist/kvhandoff-{version}-py3-none-any.whl"
    targets = set(re.findall(r"^([a-z][a-z-]*):", (ROOT / "Makefile").read_text(), re.M))
    checked: dict[str, int] = {}
    serves: list[dict[str, Any]] = []  # this section's engines
    section = ""
    for heading, argv in commands(path):
        if heading != section:
            section, serves = heading, []
        env, argv = _env_and_argv(argv)
        tool = " ".join(argv[:2])
        if tool == "vllm serve":
            args = _serve_args(argv)
            info: dict[str, Any] = {"role": None, "port": args.port}
            if args.kv_transfer_config is not None:
                info.update(_check_kv(args.kv_transfer_config, args))
            if args.ec_transfer_config is not None:
                _check_ec(args.ec_transfer_config, env)
                info["ec_role"] = args.ec_transfer_config.ec_role
            assert args.kv_transfer_config or args.ec_transfer_config, argv
            serves.append(info)
        elif tool == "kvhandoff proxy":
            _check_proxy(argv, serves)
        elif argv[0] == "curl":
            body = json.loads(argv[argv.index("-d") + 1])
            assert prefill_body(body)["max_tokens"] == 1
        elif tool == "pip install":
            assert argv[2:] in (["vllm==0.33.0"], [wheel], [".[gpu]"]), argv
        elif argv == ["python", "-m", "build"]:  # run by `make wheel-check`
            extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
            assert any(r.startswith("build") for r in extras["optional-dependencies"]["test"])
        elif argv[0] == "make":
            assert argv[1] in targets, f"no make target {argv[1]}"
        else:
            pytest.fail(f"{path.name} has a command this test does not check: {argv}")
        checked[tool] = checked.get(tool, 0) + 1
    return checked


def test_C_05_every_command_in_the_vllm_guide_is_checked() -> None:
    checked = check_commands(GUIDE)
    # The guide's three set-ups: push (P, D), pull (P, D), encoder cache (E, P, D).
    assert checked["vllm serve"] == 7 and checked["kvhandoff proxy"] == 3, checked
    assert checked["pip install"] == 3 and checked["curl -s"] == 1, checked


def test_C_05_every_command_in_the_readme_quick_start_is_checked() -> None:
    checked = check_commands(ROOT / "README.md")
    assert checked["vllm serve"] == 2 and checked["kvhandoff proxy"] == 1, checked
    assert checked["make demo"] == 1 and checked["make test"] == 1, checked


def _table_rows(title: str) -> dict[str, str]:
    """The rows of the table under the `### title` heading: first cell (unquoted) -> row."""
    text = GUIDE.read_text()
    part = text.split(f"### {title}", 1)[1].split("\n#", 1)[0]
    rows: dict[str, str] = {}
    for line in part.splitlines():
        match = re.match(r"\| `([^`]+)` \|", line)
        if match:
            rows[match.group(1)] = line
    return rows


def test_C_05_every_push_config_field_is_documented_with_its_default() -> None:
    from kvhandoff.protocol.push_config import PushConfig

    rows = _table_rows("KV connector: `kv_connector_extra_config`")
    defaults = PushConfig()
    for f in fields(PushConfig):
        assert f.name in rows, f"docs/vllm.md lacks PushConfig.{f.name}"
        cells = [c.strip() for c in rows[f.name].strip("|").split("|")]
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            assert cells[1] == f"`{str(default).lower()}`", rows[f.name]
        elif default is not None:
            assert cells[1] == f"`{default}`", rows[f.name]
        else:
            assert cells[1], f"PushConfig.{f.name} (None by default) needs its derived default"
        assert len(cells) == 4 and all(cells[2:]), rows[f.name]
    assert set(rows) >= KV_KEYS


def test_C_05_every_encoder_cache_extra_key_is_documented_with_its_default() -> None:
    from kvhandoff.protocol.ec_extra_config import EXTRA_CONFIG_KEYS, ECExtraConfig

    rows = _table_rows("Encoder-cache connector: `ec_connector_extra_config`")
    defaults = {f.name: f.default for f in fields(ECExtraConfig)}
    for key in EXTRA_CONFIG_KEYS:
        assert key in rows, f"docs/vllm.md lacks {key}"
        default = defaults[key]
        if isinstance(default, bool):
            assert f"| `{str(default).lower()}` |" in rows[key], rows[key]
        elif isinstance(default, int | float | str):
            assert f"| `{default}` |" in rows[key], rows[key]
        else:
            assert "| required |" in rows[key], rows[key]


def test_B_14_every_registered_metric_is_documented() -> None:
    import prometheus_client
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from kvhandoff.integrations.vllm import KVHandoffConnector, KVHandoffECConnector

    unregister_vllm_metrics()
    types = {c: c for c in (prometheus_client.Counter, prometheus_client.Gauge)}
    types[prometheus_client.Histogram] = prometheus_client.Histogram
    labels = ["model_name", "engine"]
    config = SimpleNamespace(kv_transfer_config=None, ec_transfer_config=None)
    KVHandoffConnector.build_prom_metrics(config, types, labels, {0: ["m", "0"]})
    KVHandoffECConnector.build_prom_metrics(config, types, labels, {0: ["m", "0"]})
    registered = set()
    for family in prometheus_client.REGISTRY.collect():
        if family.name.startswith("vllm:kvhandoff"):
            suffix = "_total" if family.type == "counter" else ""
            registered.add(family.name + suffix)
    unregister_vllm_metrics()
    documented = set(re.findall(r"\| `(vllm:kvhandoff[a-z_]*)` \|", GUIDE.read_text()))
    assert len(registered) == 13
    assert registered == documented
