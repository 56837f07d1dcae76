"""check-trace and journeys over real traces (issue 19, items 2 and 3).

`kvhandoff demo --trace DIR` runs push, pull and the encoder cache as real processes over
NIXL and ZMQ, each writing its transition trace; those traces must pass, and traces with
planted corruption (a dropped line, a swapped event, lines swapped, a lease freed twice,
a cause deleted on the other side) must be caught with the lines that prove it. Every
corruption is chosen from the traces and the current declarations, so the tests follow
the protocols as they change.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from kvhandoff.machines.catalog import DECLARATIONS
from kvhandoff.tracecheck.check import Report, check
from kvhandoff.tracecheck.journey import journey
from kvhandoff.tracecheck.read import load
from kvhandoff.tracecheck.relations import RULES, Once, Requires, correlate, inactive, matches

DECLS = {d.name: d for d in DECLARATIONS}
Line = dict[str, Any]


@pytest.fixture(scope="module")
def demo_traces(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("traces")
    result = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "demo", "--requests", "8", "--trace", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _check(directory: Path) -> Report:
    return check(load(sorted(str(p) for p in directory.glob("*.jsonl"))), DECLARATIONS)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _read(path: Path) -> list[Line]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _write(path: Path, lines: list[Line], renumber: bool = False) -> None:
    if renumber:
        for seq, line in enumerate(lines, start=1):
            line["seq"] = seq
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _instances(lines: list[Line]) -> dict[tuple[str, str, str], list[int]]:
    """(stream, kind, key) -> indexes of its create/transition lines."""
    out: dict[tuple[str, str, str], list[int]] = {}
    for i, line in enumerate(lines):
        if line.get("type") in ("create", "transition"):
            ident = (line["stream"], line["kind"], json.dumps(line["key"]))
            out.setdefault(ident, []).append(i)
    return out


def _long_lived(directory: Path) -> tuple[Path, list[Line], list[int]]:
    """A file and an instance with a creation and at least three transitions, the second
    of which changes its state (dropping a self-loop leaves the chain of states whole)."""
    for path in sorted(directory.glob("*.jsonl")):
        lines = _read(path)
        for indexes in _instances(lines).values():
            if len(indexes) >= 4 and lines[indexes[0]]["type"] == "create":
                second = lines[indexes[2]]
                if second["from"] != second["to"]:
                    return path, lines, indexes
    raise AssertionError("no instance with three transitions in the demo's traces")


def test_demo_traces_pass_check_trace(demo_traces: Path) -> None:
    files = sorted(str(p) for p in demo_traces.glob("*.jsonl"))
    roles = Counter(p.split("/")[-1].split("-")[0] for p in files)
    assert roles["prefill"] == 2 and roles["decode"] == 2, "push and pull, P and D"
    assert roles["producer"] == 1 and roles["consumer"] == 1
    result = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "check-trace", *files],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout[-4000:]
    assert "0 findings" in result.stdout
    report = _check(demo_traces)
    assert report.rules_checked >= 1, f"no P/D rule applied: {report.notes}"


def test_dropped_line_is_caught(demo_traces: Path, tmp_path: Path) -> None:
    directory = _copy(demo_traces, tmp_path / "t")
    path, lines, indexes = _long_lived(directory)
    after = lines[indexes[3]]  # the instance's next line, which no longer follows on
    _write(path, [line for i, line in enumerate(lines) if i != indexes[2]])
    report = _check(directory)
    kinds = {f.what for f in report.findings}
    assert {"integrity", "sequence"} <= kinds, report.findings
    sequence = next(f for f in report.findings if f.what == "sequence")
    assert "a line lost" in sequence.message
    assert any(f'"seq": {after["seq"]}' in ref.text for ref in sequence.refs), sequence.refs


def test_dropped_line_is_caught_even_with_the_numbering_repaired(
    demo_traces: Path, tmp_path: Path
) -> None:
    directory = _copy(demo_traces, tmp_path / "t")
    path, lines, indexes = _long_lived(directory)
    _write(path, [line for i, line in enumerate(lines) if i != indexes[2]], renumber=True)
    report = _check(directory)
    assert [f.what for f in report.findings] == ["sequence"], report.findings
    assert str(path) in report.findings[0].refs[0].quote()


def test_swapped_event_is_caught(demo_traces: Path, tmp_path: Path) -> None:
    directory = _copy(demo_traces, tmp_path / "t")
    path, lines, indexes = _long_lived(directory)
    line = lines[indexes[1]]
    decl = DECLS[line["kind"]]
    wrong = sorted(t for t in decl.triggers if (line["from"], t, line["to"]) not in decl.edges())[0]
    line["event"] = wrong
    _write(path, lines)
    findings = _check(directory).findings
    assert [f.what for f in findings] == ["undeclared"], findings
    assert f"--{wrong}-->" in findings[0].message
    assert f'"event": "{wrong}"' in findings[0].refs[0].text


def test_swapped_lines_are_caught(demo_traces: Path, tmp_path: Path) -> None:
    directory = _copy(demo_traces, tmp_path / "t")
    path, lines, indexes = _long_lived(directory)
    a, b = indexes[1], indexes[2]
    lines[a], lines[b] = lines[b], lines[a]
    _write(path, lines)
    assert "lines out of order" in {f.message for f in _check(directory).findings}


def test_lease_freed_twice_is_caught(demo_traces: Path, tmp_path: Path) -> None:
    directory = _copy(demo_traces, tmp_path / "t")
    kinds = [r.kind for r in RULES if isinstance(r, Once) and inactive(r, DECLS) is None]
    for path in sorted(directory.glob("*.jsonl")):
        lines = _read(path)
        finals = [
            line
            for line in lines
            if line.get("kind") in kinds
            and line.get("type") == "transition"
            and line["to"] in DECLS[line["kind"]].final_states
        ]
        if finals:
            break
    else:
        pytest.skip("no lifecycle a `Once` rule covers ended in the demo")
    _write(path, [*lines, dict(finals[0])], renumber=True)
    findings = _check(directory).findings
    messages = " / ".join(f.message for f in findings)
    assert "after the instance ended" in messages
    assert "ended 2 times" in messages
    twice = next(f for f in findings if "ended 2 times" in f.message)
    assert len(twice.refs) == 2 and twice.refs[0].text == twice.refs[1].text.replace(
        f'"seq": {len(lines) + 1}', f'"seq": {finals[0]["seq"]}'
    )


def test_the_other_side_disagreeing_is_caught(demo_traces: Path, tmp_path: Path) -> None:
    """Delete, on one side, the step that causes a step on the other: D received what P
    never sent (or the first rule of `relations.py` the demo exercises)."""
    directory = _copy(demo_traces, tmp_path / "t")
    trace = load(sorted(str(p) for p in directory.glob("*.jsonl")))
    rule, corr = _exercised_rule(trace.records)
    for path in sorted(directory.glob("*.jsonl")):
        kept = [
            line
            for line in _read(path)
            if not (
                matches(rule.cause, line, DECLS[rule.cause.kind])
                and correlate(rule.cause.corr, line) == corr
            )
        ]
        _write(path, kept, renumber=True)
    findings = _check(directory).findings
    disagree = [f for f in findings if f.what == "disagree"]
    assert disagree and disagree[0].message.startswith(rule.name), findings
    assert corr in disagree[0].message


def _exercised_rule(records: list[Any]) -> tuple[Requires, str]:
    for rule in RULES:
        if not isinstance(rule, Requires) or inactive(rule, DECLS) is not None:
            continue
        for record in records:
            if matches(rule.effect, record.data, DECLS[rule.effect.kind]):
                corr = correlate(rule.effect.corr, record.data)
                if corr is not None:
                    return rule, corr
    raise AssertionError("the demo exercised no P/D rule")


def test_journey_of_one_request_crosses_p_and_d(demo_traces: Path) -> None:
    trace = load(sorted(str(p) for p in demo_traces.glob("*.jsonl")))
    _rule, corr = _exercised_rule(trace.records)
    text = journey(trace, corr)
    assert text is not None and text.startswith("sequenceDiagram\n")
    participants = [line for line in text.splitlines() if line.strip().startswith("participant")]
    assert len({p.split(" as ")[1].split()[0] for p in participants}) >= 2, participants
    assert "-)" in text, "an arrow from a cause on one side to its effect on the other"
    assert journey(trace, "no-such-request") is None
    files = [str(p) for p in demo_traces.glob("*.jsonl")]
    result = subprocess.run(
        [sys.executable, "-m", "kvhandoff", "diagrams", "--journey", *files, "--request", corr],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0 and result.stdout == text
