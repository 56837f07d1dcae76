"""One simulated encoder-cache instance and its configuration (simulation only).

`Engine` bundles a real scheduler half and worker half with the block tags of its
region; `layout` and `transfer_config` give every simulated engine the same small,
tiny-block geometry and the same compatibility hash (`COMPAT`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvhandoff.machines.ec.cache_entry import EncodingEvicted
from kvhandoff.machines.ec.meta import ECWorkerMeta
from kvhandoff.machines.ec.request import FailRequest
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.machines.ec.worker import ECWorker
from kvhandoff.protocol.ec_config import ECLayout, ECRole, ECTransferConfig
from kvhandoff.protocol.ec_status import compatibility_hash

__all__ = ["BLOCK_BYTES", "COMPAT", "Engine", "layout", "transfer_config"]

HIDDEN = 4
DTYPE_SIZE = 2
BLOCK_BYTES = HIDDEN * DTYPE_SIZE
COMPAT = compatibility_hash("1.0", "model", "bfloat16", BLOCK_BYTES)


def layout(num_blocks: int) -> ECLayout:
    return ECLayout(hidden_dim=HIDDEN, dtype_size=DTYPE_SIZE, ec_cpu_bytes=num_blocks * BLOCK_BYTES)


def transfer_config(
    role: ECRole, num_blocks: int, *, engine_id: str, p2p: bool = True, **extra: Any
) -> ECTransferConfig:
    return ECTransferConfig(
        ec_connector="ECCPUConnector",
        ec_role=role,
        ec_connector_extra_config={
            "ec_cpu_bytes": num_blocks * BLOCK_BYTES,
            "ec_enable_nixl": p2p,
            **extra,
        },
        engine_id=engine_id,
    )


@dataclass
class Engine:
    """One instance: a scheduler half, one worker half per TP/PCP rank (each on its own
    bus, sharing nothing with the scheduler), and its region's block tags."""

    name: str
    role: ECRole
    scheduler: ECScheduler
    workers: list[ECWorker]
    region: list[str | None]
    host: str = ""
    port: int = 0
    epoch: int = 0
    alive: bool = True
    identity: bytes = b""  # its ZMQ identity, as the producer's ROUTER sees it
    known_agents: set[str] = field(default_factory=set)  # producer agents it loaded
    evicted: list[EncodingEvicted] = field(default_factory=list)
    failed: list[FailRequest] = field(default_factory=list)
    loads_unreported: dict[int, tuple[str, set[int]]] = field(default_factory=dict)
    """Ground truth of the simulation: load transfer id -> (`mm_hash`, ranks whose report
    of it has not reached the scheduler yet). The entry must stay pinned meanwhile."""
    reports_in_transit: list[tuple[float, int, ECWorkerMeta]] = field(default_factory=list)
    """Rank reports on their way to the scheduler: (due, order, report)."""

    @property
    def worker(self) -> ECWorker:
        """The writer rank's worker (TP 0 / PCP 0)."""
        return self.workers[0]

    def copies_in_flight(self) -> int:
        return sum(worker.in_flight() for worker in self.workers)

    def outstanding_loads(self) -> dict[str, int]:
        """Load transfers per `mm_hash` some rank has not reported yet."""
        out: dict[str, int] = {}
        for mm_hash, ranks in self.loads_unreported.values():
            if ranks:
                out[mm_hash] = out.get(mm_hash, 0) + 1
        return out
