"""A helper script run as a child process, spoken to line by line with deadlines.

Protocol lines from the child start with `@@ `; anything else on its stdout (NIXL logs to
stdout) is skipped. Every read is bounded by a deadline, so a hung child fails the test
instead of hanging it. Loaded by the tests from its path (the folder is not a package).
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = b"@@ "
HELPERS = Path(__file__).resolve().parent


class ChildTimeout(AssertionError):
    """The child did not answer before the deadline."""


class Child:
    """One helper script in its own OS process."""

    def __init__(self, script: str, *args: str, stderr_path: Path) -> None:
        env = dict(os.environ, NIXL_LOG_LEVEL="WARN", PYTHONUNBUFFERED="1")
        self.stderr_path = stderr_path
        self._stderr = stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(HELPERS / script), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        assert self.proc.stdout is not None
        self._out = self.proc.stdout.fileno()
        self._buf = b""
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._out, selectors.EVENT_READ)

    def expect(self, timeout_s: float = 20.0) -> str:
        """The next protocol line, without its prefix."""
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\n" in self._buf:
                line, self._buf = self._buf.split(b"\n", 1)
                if line.startswith(PREFIX):
                    return line[len(PREFIX) :].decode()
            left = deadline - time.monotonic()
            if left <= 0 or not self._sel.select(left):
                raise ChildTimeout(f"no answer from child in {timeout_s} s; {self.stderr()}")
            chunk = os.read(self._out, 65536)
            if not chunk:
                raise ChildTimeout(f"child closed its stdout; {self.stderr()}")
            self._buf += chunk

    def send(self, line: str) -> None:
        """Write one command line to the child."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def request(self, line: str, timeout_s: float = 20.0) -> str:
        """Send one command and return its one-line answer."""
        self.send(line)
        return self.expect(timeout_s)

    def stderr(self) -> str:
        """The tail of the child's stderr, for failure messages."""
        self._stderr.flush()
        return "stderr: " + self.stderr_path.read_text(errors="replace")[-2000:]

    def sigkill(self) -> None:
        """SIGKILL the child and reap it."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=20)

    def close(self, timeout_s: float = 20.0) -> int:
        """Close stdin, wait for exit (SIGKILL after `timeout_s`), return the exit code."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(BrokenPipeError):
                self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.sigkill()
            code = self.proc.returncode
        self._sel.close()
        assert self.proc.stdout is not None
        self.proc.stdout.close()
        self._stderr.close()
        return code
