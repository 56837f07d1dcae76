"""What both encoder-cache demo roles share: their options, stdin, pacing and settling.

`ECRoleOptions` is what `kvhandoff run producer|consumer` was told; `Stdin` reads its
command lines on a daemon thread; `pace` ends one engine step; `settle` keeps stepping
after the traffic until nothing is in flight; `SaveGate` holds the end event of saves
the producer wants late (the `slow` case, a `slow_save` fault).
"""

from __future__ import annotations

import os
import queue
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.demo.ec_audit import settled
from kvhandoff.demo.ec_requests import BLOCK_BYTES
from kvhandoff.machines.ec.meta import CopyDirection, CopyItem
from kvhandoff.protocol.ec_config import ECRole, ECTransferConfig

__all__ = ["ECRoleOptions", "SaveGate", "Stdin", "pace", "settle", "transfer_config"]


@dataclass
class ECRoleOptions:
    role: str
    engine_id: str
    listen_host: str
    listen_port: int
    advertise_host: str | None
    peer_host: str
    peer_port: int
    requests: int
    seed: int
    backend: str
    deadline_s: float
    per_step: int
    extra: dict[str, Any]
    machine: dict[str, float]
    wait_go: bool = False
    relay: bool = False
    step_ms: float = 0.0
    """Each engine step takes this long (0: as fast as it goes, idling when there is
    nothing to do)."""
    faults: str = ""
    """Seeded faults of `ECFaultPlan`, e.g. `read_fail=0.02,ack_drop=0.01`."""
    fault_seed: int = 0


def transfer_config(opts: ECRoleOptions, num_blocks: int) -> ECTransferConfig:
    role: ECRole = "ec_producer" if opts.role == "producer" else "ec_consumer"
    return ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role=role,
        ec_connector_extra_config={
            "ec_enable_nixl": True,
            "nixl_backend": opts.backend,
            **opts.extra,
            "ec_cpu_bytes": num_blocks * BLOCK_BYTES,
        },
        engine_id=opts.engine_id,
    )


class Stdin:
    """Lines from stdin on a daemon thread. When stdin is a pipe (a launcher, a test, a
    shell pipeline) its end means whoever drives the role is gone: None is queued and the
    role stops. A terminal or `/dev/null` ending means nothing."""

    def __init__(self) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        try:
            self.piped = stat.S_ISFIFO(os.fstat(sys.stdin.fileno()).st_mode)
        except (OSError, ValueError):
            self.piped = False
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in sys.stdin:
            if line.strip():
                self.lines.put(line.strip())
        if self.piped:
            self.lines.put(None)

    def wait_go(self, deadline: float) -> bool:
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line is None or line == "stop":
                return False
            if line == "go":
                return True
        return False

    def take(self) -> list[str | None]:
        out: list[str | None] = []
        while True:
            try:
                out.append(self.lines.get_nowait())
            except queue.Empty:
                return out


class SaveGate:
    """Holds the end event of saves named in `held` (mm_hash -> give-up time)."""

    def __init__(self) -> None:
        self.held: dict[str, float] = {}

    def may_land(
        self, batch_id: int, direction: CopyDirection, items: tuple[CopyItem, ...]
    ) -> bool:
        return direction != "save" or not any(item.mm_hash in self.held for item in items)


def _idle() -> None:
    time.sleep(0.0002)  # an engine with nothing to compute would wait for requests


def pace(opts: ECRoleOptions, busy: bool) -> None:
    """The end of one engine step: it took `--step-ms`, or it idles when it had no work."""
    if opts.step_ms > 0:
        time.sleep(opts.step_ms / 1000.0)
    elif not busy:
        _idle()


def settle(side: ECSide, opts: ECRoleOptions, until: float, step: Callable[[], Any]) -> None:
    """Keep stepping after the traffic until nothing is in flight (grants end with their
    XferDone or pin lease, reads with their quarantine), or `until`."""
    while not settled(side) and time.monotonic() < until:
        step()
        pace(opts, busy=False)
