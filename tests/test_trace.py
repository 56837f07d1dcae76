"""The transition trace (issue 19, item 1) and check-trace (item 2) on a small machine.

Traces are produced here, by a bus over `tests/core_example.py`'s lease, not read from
committed files.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from kvhandoff.adapters.trace import (
    ENV,
    TraceConfig,
    TraceWriter,
    apply_trace_config,
    split_trace_config,
    trace_settings,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import VirtualClock
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.tracecheck.check import Report, check
from kvhandoff.tracecheck.read import load

from core_example import LEASE, Heartbeat, LeaseCtx, StartWrite, WriteDone


def _traced_bus(writer: TraceWriter, proc: str = "p") -> EventBus:
    bus = EventBus()
    bus.register(LEASE)
    writer.attach(bus, proc=proc, role="prefill", bus_name="main")
    return bus


def _run(bus: EventBus, key: str, t: float, *, write: bool = True) -> None:
    bus.create(LEASE, LeaseCtx(key, [1, 2]), t)
    bus.dispatch(LEASE, key, Heartbeat(), t + 1)
    if write:
        bus.dispatch(LEASE, key, StartWrite(), t + 2)
        bus.dispatch(LEASE, key, WriteDone(), t + 3)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _check(*paths: Path) -> Report:
    return check(load([str(p) for p in paths]), [LEASE], rules=())


def test_trace_is_off_by_default() -> None:
    assert not TraceConfig.from_env({}).enabled
    assert not trace_settings(None, VirtualClock(0.0)).enabled
    config, rest = split_trace_config({"trace": "/tmp/x.jsonl", "kv_lease_duration": 3}, env={})
    assert config.target == "/tmp/x.jsonl" and rest == {"kv_lease_duration": 3}
    with pytest.raises(LocalProtocolError):
        TraceConfig("x.jsonl", max_bytes=10)


def test_trace_lines_are_versioned_and_carry_identity(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    writer = TraceWriter(TraceConfig(str(path)), clock=lambda: 5.0)
    _run(_traced_bus(writer), "r1", 10.0)
    writer.close()
    lines = _lines(path)
    assert [line["seq"] for line in lines] == list(range(1, len(lines) + 1))
    assert {line["v"] for line in lines} == {1}
    assert [line["type"] for line in lines[:4]] == ["header", "stream", "kind", "create"]
    assert lines[0]["format"] == "kvhandoff-trace" and lines[0]["t0"] == 5.0
    assert lines[2]["timeouts"] == {"finished": 30.0, "writing": 5.0}
    heartbeat = lines[4]
    assert heartbeat["event"] == "heartbeat" and heartbeat["from"] == heartbeat["to"] == "finished"
    assert heartbeat["effects"] == [{"effect": "ExtendDeadline", "seconds": 20.0}]
    assert heartbeat["proc"] == "p" and heartbeat["bus"] == "main" and heartbeat["t"] == 11.0
    assert _check(path).findings == []


def test_trace_rotates_by_size_and_check_trace_adopts_what_was_rotated_away(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.jsonl"
    writer = TraceWriter(TraceConfig(str(path), max_bytes=4096, backups=2))
    bus = _traced_bus(writer)
    for i in range(60):
        _run(bus, f"r{i}", 100.0 + i, write=i % 7 != 0)
    writer.close()
    parts = sorted(tmp_path.glob("*.jsonl"))
    assert [p.name for p in parts] == [f"p.{n}.jsonl" for n in sorted(_parts(parts))] + ["p.jsonl"]
    assert len(parts) == 3, "two rotated parts kept, older ones deleted"
    for part in parts:
        head = _lines(part)[:3]
        assert [line["type"] for line in head] == ["header", "stream", "kind"]
    assert _check(*parts).findings == [], "instances first seen mid-life are adopted"


def _parts(paths: list[Path]) -> list[int]:
    return [int(p.name.split(".")[1]) for p in paths if p.name != "p.jsonl"]


def test_trace_to_a_logging_handler_is_read_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvhandoff.trace.test")
    writer = TraceWriter(TraceConfig("log:kvhandoff.trace.test"))
    _run(_traced_bus(writer), "r1", 1.0)
    log_file = tmp_path / "service.log"
    log_file.write_text("".join(f"2026-12-01 INFO {r.getMessage()}\n" for r in caplog.records))
    report = _check(log_file)
    assert report.findings == [] and report.transitions == 3


def test_apply_trace_config_sets_this_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    rest = apply_trace_config({"trace": "/tmp/t", "trace_backups": 1, "nixl_backend": "UCX"})
    assert rest == {"nixl_backend": "UCX"}
    assert TraceConfig.from_env().target == "/tmp/t" and TraceConfig.from_env().backups == 1


def test_check_trace_reports_a_stuck_instance_and_an_uncreated_one(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    writer = TraceWriter(TraceConfig(str(path)))
    bus = _traced_bus(writer)
    _run(bus, "done", 0.0)
    bus.create(LEASE, LeaseCtx("stuck", [1]), 1.0)
    bus.dispatch(LEASE, "stuck", StartWrite(), 2.0)  # writing: times out at 7.0
    writer.close()
    lines = path.read_text().splitlines()
    # The bus went on to t=100 without firing the timeout: as if its timer were lost.
    late = json.loads(lines[-1]) | {"seq": len(lines) + 1, "t": 100.0, "key": "other"}
    late.update({"type": "create", "state": "finished"})
    for field in ("event", "fields", "from", "to", "effects"):
        late.pop(field)
    path.write_text("\n".join([*lines, json.dumps(late)]) + "\n")
    findings = _check(path).findings
    assert [(f.what, "stuck" in f.message) for f in findings] == [("stuck", True)]
    assert "'writing' past its timeout" in findings[0].message
    assert findings[0].refs[0].line == len(lines), "it quotes the instance's last line"


def test_a_bus_attached_late_writes_its_live_instances_first(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    bus = EventBus()
    bus.register(LEASE)
    bus.create(LEASE, LeaseCtx("early", [1]), 1.0)
    bus.dispatch(LEASE, "early", StartWrite(), 2.0)
    writer = TraceWriter(TraceConfig(str(path)))
    writer.attach(bus, proc="p", role="prefill", bus_name="main")
    bus.dispatch(LEASE, "early", WriteDone(), 3.0)
    writer.close()
    live = [line for line in _lines(path) if line["type"] == "live"]
    assert [(line["key"], line["state"], line["t"]) for line in live] == [("early", "writing", 2.0)]
    assert _check(path).findings == []


def test_attach_tree_finds_every_bus_of_an_assembly_once(tmp_path: Path) -> None:
    class Rank:
        def __init__(self) -> None:
            self.bus = EventBus()
            self.writer_bus = EventBus()

    class Side:
        def __init__(self) -> None:
            self.scheduler = Rank()
            self.bus = self.scheduler.bus  # the same bus twice: attached once
            self.ranks = [Rank(), Rank()]

    writer = TraceWriter(TraceConfig(str(tmp_path / "p.jsonl")))
    names = writer.attach_tree(Side(), proc="p", role="prefill")
    writer.close()
    assert names == [
        "scheduler",
        "scheduler.writer",
        "ranks0",
        "ranks0.writer",
        "ranks1",
        "ranks1.writer",
    ]


def test_check_trace_catches_a_transition_the_declaration_does_not_have(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    writer = TraceWriter(TraceConfig(str(path)))
    _run(_traced_bus(writer), "r1", 0.0)
    writer.close()
    text = path.read_text().replace('"event":"write_done"', '"event":"heartbeat"')
    path.write_text(text)
    findings = _check(path).findings
    assert [f.what for f in findings] == ["undeclared"]
    assert "writing --heartbeat--> sent is not a declared transition" in findings[0].message
    assert '"event":"heartbeat"' in findings[0].refs[0].text
