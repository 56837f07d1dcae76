"""The `kvhandoff-push-writer` thread: one per worker rank, the sole owner of its push
NIXL calls.

It blocks on the rank's wake event when idle; while P finished blocks wait for an
unmatched `PUSH_REG` it self-polls every `push_writer_poll_interval_ms` (R-P07). Each
wake-up runs one `PushRank.writer_pass`. An exception in a pass is logged and the loop
goes on: untrusted input never kills the thread. Handshakes run on a small executor
whose callbacks only post results and wake the writer (R-P05).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvhandoff.adapters.push_rank import PushRank

log = logging.getLogger("kvhandoff.push.writer_thread")

THREAD_NAME = "kvhandoff-push-writer"


class HandshakeExecutor:
    """Background handshakes; `submit` never blocks the writer."""

    def __init__(self, workers: int = 2) -> None:
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvhandoff-handshake")

    def submit(self, job: Callable[[], None]) -> None:
        self._pool.submit(self._guarded, job)

    @staticmethod
    def _guarded(job: Callable[[], None]) -> None:
        try:
            job()
        except Exception:  # the job reports its own failures; this is a last resort
            log.exception("handshake job crashed")

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class PushWriterThread:
    def __init__(self, rank: PushRank, idle_timeout_s: float = 1.0) -> None:
        self.rank = rank
        self.idle_timeout_s = idle_timeout_s
        self.passes = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"{THREAD_NAME}-{rank.rank}", daemon=True
        )

    def start(self) -> PushWriterThread:
        self._thread.start()
        return self

    def _run(self) -> None:
        rank = self.rank
        while not self._stop.is_set():
            interval = rank.writer_poll_interval_s
            rank.wake.wait(self.idle_timeout_s if interval is None else interval)
            rank.wake.clear()
            try:
                rank.writer_pass()
            except Exception:
                self.errors += 1
                log.exception("writer pass failed; the writer keeps running")
            self.passes += 1

    def stop(self) -> None:
        self._stop.set()
        self.rank.wake.set()
        self._thread.join(timeout=10.0)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()
