"""The transition trace: every transition of every machine of a process, as JSON lines.

Off by default. Turned on by the environment variable `KVHANDOFF_TRACE` or the config key
`trace` (in `kvhandoff run --config`), whose value names where the lines go:

- a path ending in `.jsonl`: that file;
- `log` or `log:<logger name>`: a logging handler (`kvhandoff.trace` by default), one
  INFO record per line, rotated by whatever the logging configuration says;
- anything else: a directory (created if missing) where each process writes
  `<process>-<pid>.jsonl`, so one setting serves every process of a deployment.

Files are bounded: past `trace_max_bytes` (`KVHANDOFF_TRACE_MAX_BYTES`, 64 MiB) the file
is renamed `<stem>.<part>.jsonl` and a new one is started; only the newest
`trace_backups` (`KVHANDOFF_TRACE_BACKUPS`, 4) renamed parts are kept. The format
(version 1) is documented in `docs/trace-format.md`; `kvhandoff check-trace` replays it
against the declarations, `kvhandoff diagrams --journey` draws one request from it.

`open_trace(config, name)` returns the process's writer for a target (shared by every
side of the process, thread-safe); `writer.attach(bus, proc=..., role=..., bus_name=...)`
makes a bus write into it. The lines carry the injected time each bus was given (`t`),
the stream (one per attached bus) and the process identity; the header of each file maps
`t` to wall-clock time so traces of several hosts can be merged.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.trace_config import (
    CONFIG_KEYS,
    ENV,
    ENV_RUN,
    TraceConfig,
    apply_trace_config,
    split_trace_config,
    trace_settings,
)
from kvhandoff.machines.runtime.recording import (
    RecordSink,
    effect_record,
    event_fields,
    jsonable,
)
from kvhandoff.protocol.errors import LocalProtocolError

if TYPE_CHECKING:
    from kvhandoff.machines.runtime.bus import EventBus
    from kvhandoff.machines.runtime.compiled import Instance
    from kvhandoff.machines.runtime.effects import Effect
    from kvhandoff.machines.runtime.events import Event

__all__ = [
    "CONFIG_KEYS",
    "ENV",
    "ENV_RUN",
    "FORMAT",
    "VERSION",
    "TraceConfig",
    "TraceWriter",
    "apply_trace_config",
    "open_trace",
    "split_trace_config",
    "trace_settings",
]

VERSION = 1
FORMAT = "kvhandoff-trace"
FLUSH_INTERVAL_S = 0.5
"""A file's buffer is flushed at least this often while lines arrive (and at exit)."""

log = logging.getLogger("kvhandoff.trace")
_LINE = {"v": VERSION, "seq": 0}  # every line starts with these two keys
_PREAMBLE = ("header", "stream", "kind")  # never rotated away from their part
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


class TraceWriter:
    """One process's (or one simulated world's) trace: numbered lines, thread-safe."""

    def __init__(
        self,
        config: TraceConfig,
        name: str = "process",
        *,
        clock_kind: str = "monotonic",
        clock: Callable[[], float] = real_clock,
        path: str | Path | None = None,
        run: str | None = None,
    ) -> None:
        if not config.enabled:
            raise LocalProtocolError("TraceWriter needs a trace target")
        self.config = config
        self.clock_kind = clock_kind
        self._clock = clock
        self._lock = threading.Lock()
        self._seq = 0
        self._streams = 0
        self._part = 0
        self._size = 0
        self._file: IO[bytes] | None = None
        # msgspec's JSON encoder (several times json.dumps' speed), imported only when a
        # trace is on: the local encoder-cache tier imports no msgspec (R-E02).
        import msgspec

        self._encode = msgspec.json.Encoder().encode
        self._logger: logging.Logger | None = None
        self._preamble: list[dict[str, Any]] = []  # stream and kind lines, again per part
        self._last_flush = time.monotonic()
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.writer_id = f"{self.host}:{self.pid}:{time.time_ns()}"
        self.run = os.environ.get(ENV_RUN, "") if run is None else run
        self.path: Path | None = None
        self.closed = False
        target = config.target
        if path is not None:
            self.path = Path(path)
        elif target == "log" or target.startswith("log:"):
            self._logger = logging.getLogger(target[4:] or "kvhandoff.trace")
        elif target.endswith(".jsonl"):
            self.path = Path(target)
        else:
            safe = _UNSAFE.sub("_", name) or "process"
            self.path = Path(target) / f"{safe}-{self.pid}.jsonl"
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "wb")  # noqa: SIM115 (kept open)
        with self._lock:
            self._header()

    # -- streams ---------------------------------------------------------------------------

    def attach(self, bus: EventBus, *, proc: str, role: str = "", bus_name: str = "main") -> None:
        """Record every creation and transition of `bus` into this trace; instances
        already live on it are written first as `live` lines (their state as found)."""
        sink = self.stream(proc=proc, role=role, bus_name=bus_name)
        bus.record(sink)
        for name in bus.kinds():
            for inst in list(bus.machine_named(name).index.values()):
                sink.snapshot(bus.now, inst)

    def attach_tree(self, root: object, *, proc: str, role: str = "") -> list[str]:
        """Attach every bus reachable from `root`'s attributes (three levels down, lists
        included), each once, named after where it was found: `scheduler.bus` is
        `scheduler`, `ranks[1].writer_bus` is `ranks1.writer`, a top-level `bus` is
        `main`. Returns the names, in the order found."""
        from kvhandoff.machines.runtime.bus import EventBus

        found: dict[int, str] = {}

        def walk(obj: object, path: str, depth: int) -> None:
            if isinstance(obj, EventBus):
                if id(obj) not in found:
                    name = path.removesuffix(".bus").removesuffix("_bus").replace("_bus.", ".")
                    found[id(obj)] = "main" if name == "bus" else name.replace("_bus", "")
                    self.attach(obj, proc=proc, role=role, bus_name=found[id(obj)])
                return
            if depth == 0:
                return
            if isinstance(obj, list | tuple):
                for index, item in enumerate(obj):
                    walk(item, f"{path}{index}", depth - 1)
                return
            names = getattr(obj, "__dict__", None) or {
                slot: None for slot in getattr(type(obj), "__slots__", ())
            }
            for attr in list(names):
                if not attr.startswith("_") and hasattr(obj, attr):
                    walk(getattr(obj, attr), f"{path}.{attr}" if path else attr, depth - 1)

        walk(root, "", 3)
        return list(found.values())

    def stream(self, *, proc: str, role: str = "", bus_name: str = "main") -> BusTrace:
        """A recording sink for one bus (pass it to `bus.record`)."""
        with self._lock:
            self._streams += 1
            stream = f"{self.pid}.{self._streams}"
            line = {
                **_LINE,
                "type": "stream",
                "stream": stream,
                "proc": proc,
                "role": role,
                "bus": bus_name,
                "pid": self.pid,
            }
            self._preamble.append(line)
            self._write(line)
        return BusTrace(self, stream, proc, bus_name)

    def kind(self, stream: str, inst: Instance[Any]) -> None:
        machine = inst.machine
        timeouts = {
            name: node.timeout_seconds
            for name, node in machine.nodes.items()
            if node.timeout_seconds is not None
        }
        line = {
            **_LINE,
            "type": "kind",
            "stream": stream,
            "kind": machine.name,
            "timeouts": timeouts,
            "config": dict(machine.config),
        }
        with self._lock:
            self._preamble.append(line)
            self._write(line)

    # -- lines -----------------------------------------------------------------------------

    def emit(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._write(record)

    def _write(self, record: dict[str, Any]) -> None:
        if self.closed:
            return
        self._seq += 1
        record["v"], record["seq"] = VERSION, self._seq  # first keys: see _line
        line = self._encode(record)
        if self._logger is not None:
            self._logger.info("%s", line.decode())
            return
        assert self._file is not None
        self._file.write(line + b"\n")
        self._size += len(line) + 1
        if self._size >= self.config.max_bytes and record.get("type") not in _PREAMBLE:
            self._rotate()
            return
        now = time.monotonic()
        if now - self._last_flush >= FLUSH_INTERVAL_S:
            self._file.flush()
            self._last_flush = now

    def _header(self) -> None:
        self._write(
            {
                **_LINE,
                "type": "header",
                "format": FORMAT,
                "writer": self.writer_id,
                "pid": self.pid,
                "host": self.host,
                "clock": self.clock_kind,
                "t0": self._clock(),
                "wall0": time.time(),
                "part": self._part,
                "run": self.run,
            }
        )

    def _rotate(self) -> None:
        assert self._file is not None and self.path is not None
        self._file.close()
        self._part += 1
        rolled = self.path.with_name(f"{self.path.stem}.{self._part}.jsonl")
        os.replace(self.path, rolled)
        old = self._part - self.config.backups
        if old >= 1:
            self.path.with_name(f"{self.path.stem}.{old}.jsonl").unlink(missing_ok=True)
        self._file = open(self.path, "wb")  # noqa: SIM115 (kept open)
        self._size = 0
        self._header()
        for line in self._preamble:
            self._write(line)

    def flush(self) -> None:
        with self._lock:
            if self._file is not None and not self.closed:
                self._file.flush()
                self._last_flush = time.monotonic()

    def close(self) -> None:
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self._file is not None:
                self._file.close()


class BusTrace(RecordSink):
    """The recording sink of one bus: its lines carry the stream's identity."""

    __slots__ = ("_kinds", "bus", "proc", "stream", "writer")

    def __init__(self, writer: TraceWriter, stream: str, proc: str, bus: str) -> None:
        self.writer = writer
        self.stream = stream
        self.proc = proc
        self.bus = bus
        self._kinds: set[str] = set()

    def created(self, now: float, inst: Instance[Any], what: str = "create") -> None:
        if inst.machine.name not in self._kinds:
            self._kinds.add(inst.machine.name)
            self.writer.kind(self.stream, inst)
        self.writer.emit(
            {
                **_LINE,
                "type": what,
                "stream": self.stream,
                "proc": self.proc,
                "bus": self.bus,
                "t": now,
                "kind": inst.machine.name,
                "key": jsonable(inst.key),
                "state": inst.node.name,
            }
        )

    def snapshot(self, now: float, inst: Instance[Any]) -> None:
        """An instance that was live before the bus was attached (`now`: the bus's time)."""
        self.created(now if now != float("-inf") else 0.0, inst, "live")

    def transition(
        self,
        now: float,
        inst: Instance[Any],
        event: Event,
        edge: tuple[str, str, str],
        effects: Sequence[Effect] | None,
    ) -> None:
        if inst.machine.name not in self._kinds:
            self._kinds.add(inst.machine.name)
            self.writer.kind(self.stream, inst)
        self.writer.emit(
            {
                **_LINE,
                "type": "transition",
                "stream": self.stream,
                "proc": self.proc,
                "bus": self.bus,
                "t": now,
                "kind": inst.machine.name,
                "key": jsonable(inst.key),
                "event": event.trigger,
                "fields": event_fields(event),
                "from": edge[0],
                "to": edge[2],
                "effects": [effect_record(e) for e in effects] if effects else [],
            }
        )


_open: dict[str, TraceWriter] = {}
_open_lock = threading.Lock()


def open_trace(config: TraceConfig | None, name: str) -> TraceWriter | None:
    """The process's writer for `config`'s target (None when tracing is off); the first
    caller's `name` names the file in directory mode. Closed at interpreter exit."""
    if config is None or not config.enabled:
        return None
    with _open_lock:
        writer = _open.get(config.target)
        if writer is None or writer.closed:
            writer = TraceWriter(config, name)
            _open[config.target] = writer
        return writer


@atexit.register
def _close_all() -> None:
    with _open_lock:
        writers = list(_open.values())
        _open.clear()
    for writer in writers:
        writer.close()
