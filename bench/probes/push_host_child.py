"""The push bench's child with a host stand-in for the CUDA IPC launch (a probe, never
production; see `push_host_overhead`).

P wraps its NIXL transport in the real `IpcPushTransport`, but opening a D rank's export
and launching the gather-scatter kernel are replaced: every WRITE to a connected D rank is
queued as on the GPU, the "launch" moves no bytes and its event has fired at once, and the
completion notifs leave through NIXL as they do after a real launch. What remains is the
framework's host work on the IPC path (P's scheduler, worker, writer and transport, D's
writer and worker), which is what limits the IPC path on the H200 (bench/RESULTS.md). D
therefore finds its blocks unwritten: the probe's reps are timed, never verified.

With `KVH_PROBE_PROFILE=DIR`, P's main thread (`go`) and writer thread (its passes during
`go`) and D's main thread (`arm`) and writer are profiled with cProfile in the timed reps;
the stats land in DIR as `<role>-<thread>.pstats`.
"""

from __future__ import annotations

import cProfile
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvhandoff.adapters.cuda.ipc_transport import IpcPushTransport
from kvhandoff.adapters.push_rank import PushRank
from kvhandoff.bench import push_child


class _FiredEvent:
    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


class _NullPeer:
    """An opened D rank whose launches move nothing and have ended at once."""

    device = None

    def check_ids(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> None:
        if len(local_ids) != len(remote_ids):
            raise ValueError("unequal block lists")

    def launch(self, local_ids: list[int], remote_ids: list[int]) -> _FiredEvent:
        return _FiredEvent()

    def retire(self, copy: object) -> None:
        return None


def _opened(self: IpcPushTransport, engine_id: str, rank: int) -> Any:
    if self.inner.engine(engine_id) is None:
        return None
    return self._mapped.setdefault(f"{engine_id}/{rank}", _NullPeer())  # type: ignore[arg-type]


_PROFILE_DIR = os.environ.get("KVH_PROBE_PROFILE")
_TIMERS = os.environ.get("KVH_PROBE_TIMERS")
_spent: dict[str, list[float]] = {}


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wall and thread-CPU seconds of every call during the timed reps, summed."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not _timing[0]:
            return fn(*args, **kwargs)
        w0, c0 = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            acc = _spent.setdefault(name, [0.0, 0.0, 0])
            acc[0] += time.perf_counter() - w0
            acc[1] += time.thread_time() - c0
            acc[2] += 1

    return wrapped


_profiles: dict[str, cProfile.Profile] = {}
_timing = [False]


def _profile(name: str) -> cProfile.Profile:
    return _profiles.setdefault(name, cProfile.Profile())


def _profiled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if not _timing[0]:
            return fn(*args, **kwargs)
        prof = _profile(name)
        prof.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            prof.disable()

    return wrapped


_sends: list[float] = []


def _note_sends() -> None:
    """Record when completion notifs leave P (`send_notifs`) and add the first and last
    of a rep to its `pushed` event (`t_notifs_first`, `t_notifs_last`)."""
    from kvhandoff.adapters.nixl.push_transport import NixlPushTransport

    send_notifs = NixlPushTransport.send_notifs

    def timed(self: NixlPushTransport, *args: Any, **kwargs: Any) -> Any:
        _sends.append(time.monotonic())
        return send_notifs(self, *args, **kwargs)

    NixlPushTransport.send_notifs = timed  # type: ignore[method-assign]
    emit = push_child.emit  # type: ignore[attr-defined]

    def emit_with_sends(event: str, **fields: Any) -> None:
        if event == "pushed":
            fields.update(
                t_notifs_first=min(_sends, default=None), t_notifs_last=max(_sends, default=None)
            )
            _sends.clear()
        elif event == "prepared":
            _sends.clear()
        emit(event, **fields)

    push_child.emit = emit_with_sends  # type: ignore[attr-defined]


_passes: list[tuple[float, int]] = []


def _trace_d_passes() -> None:
    """D: when each writer pass took notifs during the timed window, and how many; the
    gaps go into the `received` event (`pass_trace`: ms after the first notif)."""
    from kvhandoff.adapters.push_rank_writer import RankWriterSide

    writer_pass = RankWriterSide.writer_pass

    def traced(self: RankWriterSide) -> int:
        t = time.monotonic()
        handled = writer_pass(self)
        if _timing[0] and handled:
            _passes.append((t, handled))
        return handled

    RankWriterSide.writer_pass = traced  # type: ignore[method-assign]
    emit = push_child.emit  # type: ignore[attr-defined]

    def emit_with_passes(event: str, **fields: Any) -> None:
        if event == "received" and _passes:
            t0 = fields.get("t_notif_first") or _passes[0][0]
            trace = [(round((t - t0) * 1e3, 3), n) for t, n in _passes[-12:]]
            recv = round((fields["t_last"] - t0) * 1e3, 3)
            with open(os.environ["KVH_PROBE_TRACE"], "a") as out:
                out.write(json.dumps({"passes": trace, "received_at": recv}) + "\n")
        _passes.clear()
        emit(event, **fields)

    push_child.emit = emit_with_passes  # type: ignore[attr-defined]


def main(argv: list[str]) -> int:
    IpcPushTransport._opened = _opened  # type: ignore[method-assign]
    _note_sends()
    if argv[0] == "decode" and os.environ.get("KVH_PROBE_TRACE"):
        _trace_d_passes()
    role = argv[0]
    if _TIMERS:
        from kvhandoff.adapters.push_rank_writer import RankWriterSide
        from kvhandoff.adapters.push_side import PushSide
        from kvhandoff.machines.push.writer import PushWriter
        from kvhandoff.machines.rank.worker import PushWorker

        for cls, names in (
            (PushRank, ("writer_pass", "step", "_take_writer_items")),
            (PushSide, ("request_finished", "step", "build_connector_meta")),
            (IpcPushTransport, ("poll", "flush_writes", "complete_writes", "write_blocks")),
            (PushWriter, ("on_command", "on_issued", "on_notif", "_to_slot", "_through")),
            (PushWorker, ("start_load_kv", "get_finished", "take_writer_items")),
            (RankWriterSide, ("_issue_write", "_physical_pair", "_flush_writes")),
        ):
            for attr in names:
                setattr(cls, attr, _timed(f"{role} {cls.__name__}.{attr}", getattr(cls, attr)))
    if _PROFILE_DIR or _TIMERS:
        sides: tuple[tuple[type[Any], str], ...] = (
            (push_child.BenchPrefill, "go"),
            (push_child.BenchDecode, "arm"),
        )
        for side_cls, op in sides:
            original = getattr(side_cls, op)

            def run(self: Any, rep: int, _original: Any = original) -> None:
                _timing[0] = rep >= self.cfg.warmup
                try:
                    if _PROFILE_DIR:
                        _profiled(f"{role}-main", _original)(self, rep)
                    else:
                        _original(self, rep)
                finally:
                    _timing[0] = False

            setattr(side_cls, op, run)
    if _PROFILE_DIR:
        PushRank.writer_pass = _profiled(f"{role}-writer", PushRank.writer_pass)  # type: ignore[method-assign]
    try:
        return push_child.child_main(argv)
    finally:
        if _TIMERS:
            with open(os.path.join(_TIMERS, f"{role}.json"), "w") as out:
                json.dump(_spent, out)
        if _PROFILE_DIR:
            os.makedirs(_PROFILE_DIR, exist_ok=True)
            for name, prof in _profiles.items():
                prof.dump_stats(os.path.join(_PROFILE_DIR, f"{name}.pstats"))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
