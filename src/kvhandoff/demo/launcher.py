"""Starts the demo roles as real OS processes and reads their `@@ <json>` event lines."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvhandoff.demo.push_role import MARK


@dataclass
class RoleProcess:
    name: str
    proc: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    stderr_tail: list[str] = field(default_factory=list)
    ready: dict[str, Any] = field(default_factory=dict)

    def next_event(self, deadline: float) -> dict[str, Any] | None:
        try:
            return self.events.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None


def start_role(
    name: str, argv: Sequence[str], prefix: Sequence[str] = (), module: str = "kvhandoff"
) -> RoleProcess:
    """Start `python -m <module> <argv>` (`kvhandoff <argv>`) as a child; `prefix` wraps it
    (e.g. `ip netns exec NS`)."""
    env = dict(os.environ, NIXL_LOG_LEVEL="WARN", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", module, *argv],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    role = RoleProcess(name, proc)
    assert proc.stdout is not None and proc.stderr is not None
    threading.Thread(target=_pump_events, args=(proc.stdout, role), daemon=True).start()
    threading.Thread(target=_pump_stderr, args=(proc.stderr, role), daemon=True).start()
    return role


def _pump_events(stream: TextIO, role: RoleProcess) -> None:
    for line in stream:
        if line.startswith(MARK):
            role.events.put(json.loads(line[len(MARK) :]))
    role.events.put({"event": "exit"})


def _pump_stderr(stream: TextIO, role: RoleProcess) -> None:
    for line in stream:
        role.stderr_tail.append(line.rstrip())
        del role.stderr_tail[:-30]


def wait_ready(role: RoleProcess, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while (event := role.next_event(deadline)) is not None:
        if event["event"] == "ready":
            role.ready = event
            return event
        if event["event"] == "exit":
            break
    stop_all([role])
    tail = "\n".join(role.stderr_tail[-10:])
    raise RuntimeError(f"{role.name} did not come up:\n{tail}")


def go(roles: Sequence[RoleProcess]) -> None:
    """Release roles started with --wait-go, together."""
    for role in roles:
        assert role.proc.stdin is not None
        role.proc.stdin.write("go\n")
        role.proc.stdin.flush()


def relay(role: RoleProcess, message: dict[str, Any]) -> None:
    """Send one JSON line to a role's stdin (the proxy relaying a leg)."""
    assert role.proc.stdin is not None
    role.proc.stdin.write(json.dumps(message) + "\n")
    role.proc.stdin.flush()


def collect(
    roles: Sequence[RoleProcess],
    timeout_s: float,
    on_event: Callable[[str, dict[str, Any]], None],
) -> None:
    """Feed every role's events to `on_event` until all have exited or time runs out."""
    deadline = time.monotonic() + timeout_s
    live = {r.name: r for r in roles}
    while live and time.monotonic() < deadline:
        idle = True
        for name, role in list(live.items()):
            try:
                event = role.events.get_nowait()
            except queue.Empty:
                continue
            idle = False
            if event["event"] == "exit":
                del live[name]
            else:
                on_event(name, event)
        if idle:
            time.sleep(0.002)  # poll interval: one role's silence never delays another's
    stop_all(roles)


def stop_all(roles: Sequence[RoleProcess]) -> None:
    for role in roles:
        if role.proc.poll() is None:
            role.proc.terminate()
    for role in roles:
        try:
            role.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            role.proc.kill()
            role.proc.wait()
