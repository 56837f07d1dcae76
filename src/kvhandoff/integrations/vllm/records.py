"""The records vLLM carries between kvhandoff's connector halves (R-T01): per-step metadata
down, per-rank outputs up, the handshake payload once, and the failure statistics (B-14).
Each wraps kvhandoff's serialisable records only; nothing live crosses. Imports vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvhandoff.machines.push.meta import PushConnectorMeta, PushWorkerOutput

__all__ = [
    "KVHandoffConnectorMetadata",
    "KVHandoffConnectorStats",
    "KVHandoffHandshakeMetadata",
    "KVHandoffWorkerMetadata",
]


class KVHandoffConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> every worker, once a step: kvhandoff's msgspec payload, nothing live."""

    def __init__(self, push: PushConnectorMeta) -> None:
        self.push = push


class KVHandoffWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once a step: every rank's output, concatenated by vLLM."""

    def __init__(self, outputs: Sequence[PushWorkerOutput] = ()) -> None:
        self.outputs = tuple(outputs)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVHandoffWorkerMetadata:
        more = other.outputs if isinstance(other, KVHandoffWorkerMetadata) else ()
        return KVHandoffWorkerMetadata(self.outputs + more)


class KVHandoffHandshakeMetadata(KVConnectorHandshakeMetadata):
    """Worker -> scheduler once, at start-up: the rank's encoded handshake payload (bytes),
    which the scheduler's side channel serves to peer engines (R-P15)."""

    def __init__(self, payload: bytes, tp_rank: int) -> None:
        self.payload = payload
        self.tp_rank = tp_rank


@dataclass
class KVHandoffConnectorStats(KVConnectorStats):
    """kvhandoff's failures by cause (B-14) over one interval: `data` maps each cause in
    `FAILURE_CAUSES`, `stale_reports` (kvhandoff ignored them) and `dropped_reports` (the
    connector kept them from vLLM) to a count; ranks' and scheduler's counts add up."""

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVHandoffConnectorStats:
        for name, count in other.data.items():
            self.data[name] = int(self.data.get(name, 0)) + int(count)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: int(count) for name, count in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())
