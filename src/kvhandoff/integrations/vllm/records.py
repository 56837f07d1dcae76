"""The records vLLM carries between kvhandoff's connector halves (R-T01): per-step metadata
down, per-rank outputs up, the handshake payload once, and the statistics (B-14; the stats
class lives in `metrics.py`). Each wraps kvhandoff's serialisable records only; nothing
live crosses. Imports vLLM."""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvhandoff.integrations.vllm.metrics import KVHandoffConnectorStats
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
