"""Reading transition traces: files of several processes, parsed, ordered and merged.

Each line is located by file and line number (`Ref`), so every finding can quote the
lines that prove it. Lines may carry a prefix (a logging handler's timestamp): the JSON
object starts at the first `{`. Lines of a stream keep their written order (`seq`);
streams are merged by time, mapped to wall-clock time through each file's header when
the traces come from several hosts or clocks.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvhandoff.adapters.trace import FORMAT, VERSION

MAX_QUOTE = 400
"""A quoted line is cut to this many characters."""


@dataclass(frozen=True, slots=True)
class Ref:
    """Where a line is: its file, its 1-based number, and its text."""

    path: str
    line: int
    text: str

    def quote(self) -> str:
        text = self.text if len(self.text) <= MAX_QUOTE else self.text[:MAX_QUOTE] + "..."
        return f"{self.path}:{self.line}: {text}"


@dataclass(slots=True)
class Record:
    """One create or transition line."""

    ref: Ref
    data: dict[str, Any]
    writer: str
    stream: str  # unique across writers: "<writer>/<stream>"
    seq: int
    run: str = ""  # the run its writer belongs to (P and D are compared within a run)
    tm: float = 0.0  # merged time

    @property
    def type(self) -> str:
        return str(self.data.get("type", ""))

    @property
    def kind(self) -> str:
        return str(self.data.get("kind", ""))

    @property
    def key(self) -> Any:
        return self.data.get("key")

    @property
    def event(self) -> str:
        return str(self.data.get("event", ""))

    @property
    def t(self) -> float:
        return float(self.data.get("t", 0.0))

    def instance(self) -> tuple[str, str, str]:
        """(stream, kind, key): one lifecycle's identity within its bus."""
        return (self.stream, self.kind, json.dumps(self.key, sort_keys=True))


@dataclass(slots=True)
class Stream:
    """One traced bus: its process identity and the timeouts its machines were compiled with."""

    id: str
    writer: str
    proc: str = "?"
    role: str = ""
    bus: str = "main"
    timeouts: dict[str, dict[str, float]] = field(default_factory=dict)  # kind -> state -> s
    records: list[Record] = field(default_factory=list)


@dataclass(slots=True)
class Writer:
    """One trace writer (a process, or a simulated world): its files' headers."""

    id: str
    host: str = ""
    clock: str = "monotonic"
    t0: float = 0.0
    wall0: float = 0.0
    run: str = ""
    first_seq: int = 0
    complete: bool = False  # its part 0 (with seq 1) was read
    seqs: list[tuple[int, Ref]] = field(default_factory=list)


@dataclass(slots=True)
class TraceSet:
    """Every line read, by stream, plus the problems found while reading."""

    writers: dict[str, Writer] = field(default_factory=dict)
    streams: dict[str, Stream] = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)  # merged by time
    problems: list[tuple[str, list[Ref]]] = field(default_factory=list)
    files: int = 0
    lines: int = 0


def load(paths: Sequence[str | Path]) -> TraceSet:
    """Read every file of `paths` (directories: their `*.jsonl`), then merge by time."""
    trace = TraceSet()
    for path in _expand(paths):
        _read_file(trace, path)
    _check_sequences(trace)
    _merge(trace)
    return trace


def _expand(paths: Sequence[str | Path]) -> list[Path]:
    out: list[Path] = []
    for raw in paths:
        path = Path(raw)
        out.extend(sorted(path.glob("*.jsonl")) if path.is_dir() else [path])
    return out


def _read_file(trace: TraceSet, path: Path) -> None:
    trace.files += 1
    writer: Writer | None = None
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, raw in enumerate(handle, start=1):
            text = raw.rstrip("\n")
            start = text.find("{")
            if start < 0:
                continue  # not a trace line (a logging handler's other output)
            ref = Ref(str(path), number, text[start:])
            try:
                data = json.loads(text[start:])
            except json.JSONDecodeError:
                trace.problems.append(("unreadable line", [ref]))
                continue
            if not isinstance(data, dict) or "seq" not in data or "v" not in data:
                continue
            trace.lines += 1
            if data["v"] != VERSION:
                trace.problems.append(
                    (f"trace format version {data['v']!r} is not {VERSION}", [ref])
                )
                continue
            if data.get("type") == "header":
                writer = _header(trace, data, ref)
                continue
            if writer is None:
                trace.problems.append(("line before any header", [ref]))
                continue
            _line(trace, writer, data, ref)


def _header(trace: TraceSet, data: dict[str, Any], ref: Ref) -> Writer | None:
    if data.get("format") != FORMAT:
        trace.problems.append((f"not a {FORMAT} header", [ref]))
        return None
    writer_id = str(data.get("writer"))
    writer = trace.writers.get(writer_id)
    if writer is None:
        writer = trace.writers[writer_id] = Writer(
            writer_id,
            host=str(data.get("host", "")),
            clock=str(data.get("clock", "monotonic")),
            t0=float(data.get("t0", 0.0)),
            wall0=float(data.get("wall0", 0.0)),
            run=str(data.get("run", "")),
        )
    if data.get("part") == 0:
        writer.complete = True
    writer.seqs.append((int(data["seq"]), ref))
    return writer


def _line(trace: TraceSet, writer: Writer, data: dict[str, Any], ref: Ref) -> None:
    writer.seqs.append((int(data["seq"]), ref))
    kind = data.get("type")
    stream_id = f"{writer.id}/{data.get('stream')}"
    stream = trace.streams.get(stream_id)
    if stream is None:
        stream = trace.streams[stream_id] = Stream(stream_id, writer.id)
    if kind == "stream":
        stream.proc = str(data.get("proc", "?"))
        stream.role = str(data.get("role", ""))
        stream.bus = str(data.get("bus", "main"))
    elif kind == "kind":
        timeouts = data.get("timeouts") or {}
        stream.timeouts[str(data.get("kind"))] = {str(k): float(v) for k, v in timeouts.items()}
    elif kind in ("create", "transition", "live"):
        record = Record(ref, data, writer.id, stream_id, int(data["seq"]), writer.run)
        stream.records.append(record)
        trace.records.append(record)


def _check_sequences(trace: TraceSet) -> None:
    """A writer numbers its lines 1, 2, 3...: a gap is a lost line; preamble lines
    repeated after a rotation carry fresh numbers, so every number appears once."""
    for writer in trace.writers.values():
        seen: dict[int, Ref] = {}
        for seq, ref in writer.seqs:
            if seq in seen:
                if seen[seq].text != ref.text:
                    trace.problems.append((f"two different lines numbered {seq}", [seen[seq], ref]))
                continue
            seen[seq] = ref
        ordered = sorted(seen)
        writer.first_seq = ordered[0] if ordered else 0
        if writer.complete and writer.first_seq != 1:
            writer.complete = False
        for before, after in itertools.pairwise(ordered):
            if after != before + 1:
                trace.problems.append(
                    (
                        f"lines {before + 1}..{after - 1} of this writer are missing "
                        "(a dropped line, or a part not given)",
                        [seen[before], seen[after]],
                    )
                )
        for stream in trace.streams.values():
            if stream.writer == writer.id:
                _check_order(trace, stream)


def _check_order(trace: TraceSet, stream: Stream) -> None:
    for before, after in itertools.pairwise(stream.records):
        if after.seq < before.seq and after.ref.path == before.ref.path:
            trace.problems.append(("lines out of order", [before.ref, after.ref]))


def _merge(trace: TraceSet) -> None:
    hosts = {(w.host, w.clock) for w in trace.writers.values()}
    shared_clock = len(hosts) <= 1
    offset = {w.id: 0.0 if shared_clock else w.wall0 - w.t0 for w in trace.writers.values()}
    for stream in trace.streams.values():
        stream.records.sort(key=lambda r: r.seq)
        for record in stream.records:
            record.tm = record.t + offset[record.writer]
    trace.records.sort(key=lambda r: (r.tm, r.writer, r.seq))


def iter_streams(trace: TraceSet) -> Iterable[Stream]:
    return sorted(trace.streams.values(), key=lambda s: (s.proc, s.bus, s.id))
