# mypy: disallow-subclassing-any=False
"""kvhandoff's Prometheus metrics through vLLM 0.33's connector metrics hook (B-14, S-06).

vLLM's stat logger calls a connector class's `build_prom_metrics` once per process and then
`observe(data, engine_idx)` with every interval's stats payload: the sum of what the worker
ranks and the scheduler returned from `get_kv_connector_stats` (or
`get_ec_connector_stats`), each a `KVHandoffConnectorStats` / `KVHandoffECConnectorStats`
whose `data` is the plain dict of `stats.py`. Metric names follow vLLM's (`vllm:` prefix,
`_seconds` / `_bytes` units, counters exported as `..._total`); every metric carries vLLM's
per-engine labels (`model_name`, `engine`) and, where the name says "by", one more.

KV connector (`KVHandoffConnector`):

- `vllm:kvhandoff_transfers` (counter by `outcome`): requests done, `sent` on P, `received`,
  `failed` or `released` (vLLM ended it before its KV arrived) on D;
- `vllm:kvhandoff_failures` (counter by `cause`): failures by cause (`FAILURE_CAUSES`);
- `vllm:kvhandoff_rejected_inputs` (counter by `cause`): peer inputs refused;
- `vllm:kvhandoff_dropped_reports` (counter by `kind`): rank reports kvhandoff's scheduler
  ignored (`stale`: late, repeated, or of a request that ended; vLLM never sees them);
- `vllm:kvhandoff_lease_expiries`, `vllm:kvhandoff_watchdog_expiries` (counters);
- `vllm:kvhandoff_bytes_transferred` (histogram): KV bytes per finished request;
- `vllm:kvhandoff_finish_to_receive_seconds` (histogram): P, prefill end to D's receive;
- `vllm:kvhandoff_receive_wait_seconds` (histogram): D, block allocation to receive.

Encoder-cache connector (`KVHandoffECConnector`): `vllm:kvhandoff_ec_events` (counter by
`event`: the producer's grants and NACKs, the consumer's reads and fallbacks, by name),
`vllm:kvhandoff_ec_rejected_inputs` (by `cause`), `vllm:kvhandoff_ec_lease_expiries`
(grants a consumer never released), `vllm:kvhandoff_ec_evictions`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm.distributed.ec_transfer.ec_connector.metrics import (
    ECConnectorPromMetrics,
    ECConnectorStats,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from kvhandoff.integrations.vllm import stats
from kvhandoff.machines.push.meta import FAILURE_CAUSES

__all__ = [
    "KVHandoffConnectorStats",
    "KVHandoffECConnectorStats",
    "KVHandoffECPromMetrics",
    "KVHandoffPromMetrics",
]

# 1 ms .. about 10 min, a bucket per doubling (vLLM's own transfer histograms span the same).
SECONDS_BUCKETS = [0.001 * 2**i for i in range(20)]
# 4 KiB .. 16 GiB, a bucket per 4x.
BYTES_BUCKETS = [float(4096 * 4**i) for i in range(12)]


@dataclass
class KVHandoffConnectorStats(KVConnectorStats):
    """One interval of kvhandoff's KV observations (`stats.py`); the ranks' and the
    scheduler's add up."""

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: KVConnectorStats) -> KVHandoffConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


@dataclass
class KVHandoffECConnectorStats(ECConnectorStats):
    """One interval of kvhandoff's encoder-cache observations (`stats.py`)."""

    def reset(self) -> None:
        self.data.clear()

    def aggregate(self, other: ECConnectorStats) -> KVHandoffECConnectorStats:
        stats.merge(self.data, other.data)
        return self

    def reduce(self) -> dict[str, int | float]:
        return stats.reduce(self.data)

    def is_empty(self) -> bool:
        return stats.is_empty(self.data)


class _Registry:
    """Metric families made with the classes vLLM passes (its own, or Ray's wrappers),
    each resolved to one child per engine; labelled families keep their children per
    label value."""

    def __init__(
        self,
        metric_types: Mapping[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        self._types = dict(metric_types)
        self._labelnames = list(labelnames)
        self._per_engine = per_engine_labelvalues

    def _cls(self, kind: str) -> type[Any]:
        for base, cls in self._types.items():
            if base.__name__ == kind:
                return cls
        raise KeyError(f"vLLM passed no {kind} metric type")

    def counter(self, name: str, doc: str) -> dict[int, Any]:
        family = self._cls("Counter")(name=name, documentation=doc, labelnames=self._labelnames)
        children: dict[int, Any] = create_metric_per_engine(family, self._per_engine)
        return children

    def histogram(self, name: str, doc: str, buckets: list[float]) -> dict[int, Any]:
        family = self._cls("Histogram")(
            name=name, documentation=doc, buckets=buckets, labelnames=self._labelnames
        )
        children: dict[int, Any] = create_metric_per_engine(family, self._per_engine)
        return children

    def labelled(self, name: str, doc: str, label: str) -> Labelled:
        family = self._cls("Counter")(
            name=name, documentation=doc, labelnames=[*self._labelnames, label]
        )
        return Labelled(family, self._per_engine)


class Labelled:
    """A counter family with one extra label: a child per (engine, label value)."""

    def __init__(self, family: Any, per_engine: dict[int, list[object]]) -> None:
        self.family = family
        self.per_engine = per_engine
        self._children: dict[tuple[int, str], Any] = {}

    def inc(self, engine_idx: int, label: str, count: int) -> None:
        if count <= 0:
            return
        child = self._children.get((engine_idx, label))
        if child is None:
            child = self.family.labels(*self.per_engine[engine_idx], label)
            self._children[(engine_idx, label)] = child
        child.inc(count)


def _inc(metric: dict[int, Any], engine_idx: int, count: Any) -> None:
    if isinstance(count, int | float) and count > 0:
        metric[engine_idx].inc(count)


def _counts(data: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = data.get(name)
    return value if isinstance(value, Mapping) else {}


def _samples(data: Mapping[str, Any], name: str) -> list[float]:
    value = data.get(name)
    return [float(v) for v in value] if isinstance(value, list | tuple) else []


class KVHandoffPromMetrics(KVConnectorPromMetrics):
    """`KVHandoffConnector.build_prom_metrics`: see the module docstring."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        make = _Registry(metric_types, labelnames, per_engine_labelvalues)
        self.transfers = make.labelled(
            "vllm:kvhandoff_transfers",
            "kvhandoff KV transfers done, by outcome (sent on P; received, failed or"
            " released on D).",
            "outcome",
        )
        self.failures = make.labelled(
            "vllm:kvhandoff_failures", "kvhandoff KV transfer failures, by cause.", "cause"
        )
        self.rejected = make.labelled(
            "vllm:kvhandoff_rejected_inputs",
            "Peer inputs kvhandoff refused (notifs, handshakes), by cause.",
            "cause",
        )
        self.dropped = make.labelled(
            "vllm:kvhandoff_dropped_reports",
            "Rank reports kvhandoff ignored (stale: late, repeated or ended), by kind.",
            "kind",
        )
        self.lease_expiries = make.counter(
            "vllm:kvhandoff_lease_expiries",
            "P block leases that expired before the transfer finished.",
        )
        self.watchdog_expiries = make.counter(
            "vllm:kvhandoff_watchdog_expiries",
            "D registrations dropped by the registration watchdog.",
        )
        self.bytes = make.histogram(
            "vllm:kvhandoff_bytes_transferred",
            "KV bytes of each request kvhandoff transferred (every layer and rank).",
            BYTES_BUCKETS,
        )
        self.finish_to_receive = make.histogram(
            "vllm:kvhandoff_finish_to_receive_seconds",
            "P: from the prefill's end to every rank's report that D has the KV.",
            SECONDS_BUCKETS,
        )
        self.receive_wait = make.histogram(
            "vllm:kvhandoff_receive_wait_seconds",
            "D: from the decode leg's block allocation to every rank's receive.",
            SECONDS_BUCKETS,
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for outcome, count in _counts(data, "transfers").items():
            self.transfers.inc(engine_idx, str(outcome), int(count))
        for cause in FAILURE_CAUSES:
            self.failures.inc(engine_idx, cause, int(data.get(cause, 0) or 0))
        for cause, count in _counts(data, "rejected_inputs").items():
            self.rejected.inc(engine_idx, str(cause), int(count))
        self.dropped.inc(engine_idx, "stale", int(data.get("stale_reports", 0) or 0))
        _inc(self.lease_expiries, engine_idx, data.get("lease_expiries"))
        _inc(self.watchdog_expiries, engine_idx, data.get("watchdog_expiries"))
        for metric, name in (
            (self.bytes, "bytes_transferred"),
            (self.finish_to_receive, "finish_to_receive_s"),
            (self.receive_wait, "receive_wait_s"),
        ):
            for sample in _samples(data, name):
                metric[engine_idx].observe(sample)


class KVHandoffECPromMetrics(ECConnectorPromMetrics):
    """`KVHandoffECConnector.build_prom_metrics`: see the module docstring."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        make = _Registry(metric_types, labelnames, per_engine_labelvalues)
        self.events = make.labelled(
            "vllm:kvhandoff_ec_events",
            "kvhandoff encoder-cache events (grants, NACKs, reads, fallbacks), by name.",
            "event",
        )
        self.rejected = make.labelled(
            "vllm:kvhandoff_ec_rejected_inputs",
            "Control messages and reports the encoder cache refused, by cause.",
            "cause",
        )
        self.lease_expiries = make.counter(
            "vllm:kvhandoff_ec_lease_expiries",
            "Producer grants whose pin lease ran out before the consumer released them.",
        )
        self.evictions = make.counter(
            "vllm:kvhandoff_ec_evictions", "Encoder-cache entries evicted for space."
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for event, count in _counts(data, "ec_events").items():
            self.events.inc(engine_idx, str(event), int(count))
        for cause, count in _counts(data, "ec_rejected_inputs").items():
            self.rejected.inc(engine_idx, str(cause), int(count))
        _inc(self.lease_expiries, engine_idx, data.get("ec_lease_expiries"))
        _inc(self.evictions, engine_idx, data.get("ec_evictions"))
