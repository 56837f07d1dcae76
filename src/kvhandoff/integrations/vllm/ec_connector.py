# mypy: disallow-subclassing-any=False
"""`KVHandoffECConnector`: kvhandoff's encoder-cache P2P tier behind vLLM 0.33's
`ECConnectorBase` (C-05, R-T01). Imports vLLM; reached through the package's lazy names only.

    --ec-transfer-config '{"ec_connector": "KVHandoffECConnector",
        "ec_connector_module_path": "kvhandoff.integrations.vllm", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"ec_cpu_bytes": 1073741824, "ec_enable_nixl": true}}'

One instance per role, as vLLM builds them. The SCHEDULER role owns an `ECSide` (the
instance's `/dev/shm` region, NIXL agent and ZMQ side channel) with no local worker; each
WORKER role owns an `ECWorkerSide` attached to that region by name
(`region_name(engine_id, data-parallel index)`). The halves share no object: the
scheduler's per-step `ECConnectorMeta` rides in `KVHandoffECConnectorMetadata`, each rank's
`ECWorkerMeta` in `KVHandoffECWorkerMetadata` (plain frozen records, R-E02).

`ec_connector_extra_config` takes kvhandoff's EC keys (`protocol/ec_extra_config.py`,
unknown keys refused): `ec_cpu_bytes` (required), `ec_enable_nixl` (must be true: this is
the P2P tier), `nixl_backend` and the timeouts `consumer_ack_timeout_s`,
`nixl_read_timeout_s`, `read_quarantine_s`, `pin_lease_s`, `consumer_not_ready_timeout_s`,
`zmq_heartbeat_interval_s`, `zmq_heartbeat_timeout_s`, `zmq_heartbeat_ttl_s`. A producer
binds where `VLLM_EC_SIDE_CHANNEL_HOST` / `_PORT` say, as vLLM's own CPU connector does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.adapters.ec_worker_side import ECWorkerSide
from kvhandoff.adapters.shm.region import region_name
from kvhandoff.integrations.vllm import stats
from kvhandoff.integrations.vllm.metrics import KVHandoffECConnectorStats, KVHandoffECPromMetrics
from kvhandoff.machines.ec.meta import ECConnectorMeta, ECRequestInfo, ECWorkerMeta
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.protocol.ec_config import ECLayout, ECTransferConfig
from kvhandoff.protocol.ec_status import compatibility_hash

__all__ = [
    "KVHandoffECConnector",
    "KVHandoffECConnectorMetadata",
    "KVHandoffECWorkerMetadata",
    "ec_layout",
    "ec_request",
    "ec_transfer_config",
]

log = logging.getLogger("kvhandoff.integrations.vllm.ec")


@dataclass(frozen=True, slots=True)
class KVHandoffECConnectorMetadata(ECConnectorMetadata):
    """Scheduler -> every worker rank, once a step: kvhandoff's plan, nothing live."""

    meta: ECConnectorMeta


@dataclass(frozen=True, slots=True)
class KVHandoffECWorkerMetadata(ECConnectorWorkerMetadata):
    """One rank -> scheduler, once a step; vLLM aggregates the ranks' (R-T02)."""

    meta: ECWorkerMeta

    def aggregate(self, other: ECConnectorWorkerMetadata) -> KVHandoffECWorkerMetadata:
        if not isinstance(other, KVHandoffECWorkerMetadata):
            return self
        return KVHandoffECWorkerMetadata(self.meta.aggregate(other.meta))


def ec_transfer_config(vllm_config: Any) -> ECTransferConfig:
    """kvhandoff's `ECTransferConfig` from vLLM's `ec_transfer_config` (extra config as is:
    kvhandoff parses it and refuses unknown keys)."""
    ec = vllm_config.ec_transfer_config
    return ECTransferConfig(
        ec_connector=str(ec.ec_connector),
        ec_role=ec.ec_role,
        ec_connector_extra_config=dict(ec.ec_connector_extra_config or {}),
        engine_id=str(ec.engine_id),
        ec_connector_module_path=ec.ec_connector_module_path,
    )


def _dtype(vllm_config: Any) -> torch.dtype:
    dtype = vllm_config.model_config.dtype
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"KVHandoffECConnector needs a resolved torch dtype, got {dtype!r}")
    return dtype


def _device(vllm_config: Any) -> str:
    """Where this worker's encoder cache lives: vLLM's `device_config.device` ("cuda" on a
    CUDA platform: the copies then run on pooled CUDA streams, R-E05), CPU without one."""
    device = getattr(getattr(vllm_config, "device_config", None), "device", None)
    return str(device) if device is not None and str(device).startswith("cuda") else "cpu"


def ec_layout(vllm_config: Any, config: ECTransferConfig) -> ECLayout:
    """One block per encoder-output row: the widest measured encoder output
    (`mm_encoder_output_widths`, DeepStack rows included), else the embedding size."""
    widths = dict(getattr(vllm_config.ec_transfer_config, "mm_encoder_output_widths", {}) or {})
    hidden = max(widths.values()) if widths else vllm_config.model_config.get_inputs_embeds_size()
    extra = config.extra_config({})  # the env matters to the side channel only
    return ECLayout(int(hidden), _dtype(vllm_config).itemsize, extra.ec_cpu_bytes)


def _resolver(vllm_config: Any) -> FieldsFor | None:
    """vLLM's placeholder-field resolver for a real `ModelConfig` (None for a stub)."""
    from vllm.config import ModelConfig

    if not isinstance(vllm_config.model_config, ModelConfig):
        return None
    from vllm.distributed.ec_transfer.ec_connector.utils import PlaceholderMetadataResolver

    resolver = PlaceholderMetadataResolver(vllm_config.model_config)
    fields: FieldsFor = resolver.fields_for
    return fields


def _dp_index(vllm_config: Any) -> int:
    parallel = vllm_config.parallel_config
    return int(getattr(parallel, "data_parallel_index", 0) or 0)


def _rank(vllm_config: Any, size: int, group: str) -> int:
    """This worker's rank in vLLM's `group` ("tp" or "pcp") when the groups are up, else
    the configured global rank, else 0."""
    from vllm.distributed import parallel_state

    if size <= 1:
        return 0
    if parallel_state.model_parallel_is_initialized():
        if group == "tp":
            return int(parallel_state.get_tensor_model_parallel_rank())
        return int(parallel_state.get_pcp_group().rank_in_group)
    rank = int(getattr(vllm_config.parallel_config, "rank", 0) or 0)
    tp = int(vllm_config.parallel_config.tensor_parallel_size)
    return rank % tp if group == "tp" else (rank // tp) % size


FieldsFor = Callable[[str], Collection[str]]
"""Which placeholder fields the model publishes for a modality (vLLM's resolver)."""


def _feature_metadata(feature: Any, fields_for: FieldsFor | None) -> dict[str, Any]:
    """The placeholder fields a consumer needs for `feature` (R-E06): those vLLM's resolver
    names for its modality, else its data's small tensors and number lists; at least its
    encoder-token count (kvhandoff publishes an encoding only with metadata)."""
    metadata: dict[str, Any] = {}
    wanted = set(fields_for(str(feature.modality))) if fields_for is not None else set()
    if "audio_num_tokens" in wanted:
        metadata["audio_num_tokens"] = [_num_embeds(feature)]
    data = getattr(feature, "data", None)
    get_data = getattr(data, "get_data", None)
    items = get_data().items() if callable(get_data) else ()
    for key, value in items:
        if wanted and key not in wanted:
            continue
        if isinstance(value, torch.Tensor) and (wanted or value.numel() <= 64):
            metadata[key] = (value.reshape(1) if value.dim() == 0 else value).tolist()
        elif isinstance(value, list) and all(isinstance(v, int | float) for v in value):
            metadata[key] = list(value)
    if not metadata:
        metadata["num_embeds"] = [_num_embeds(feature)]
    return metadata


def _num_embeds(feature: Any) -> int:
    position = feature.mm_position
    count = getattr(position, "get_num_embeds", None)
    return int(count() if callable(count) else position.length)


def ec_request(
    request: Any, *, metadata: bool = False, fields_for: FieldsFor | None = None
) -> ECRequestInfo:
    """What kvhandoff's scheduler half reads from a vLLM `Request`: each feature's
    `identifier` (the `mm_hash`), rows, modality; a feature without media (`data` None)
    cannot be encoded locally (B-05); `metadata` adds the producer's publication fields."""
    features = list(getattr(request, "mm_features", None) or ())
    params = getattr(request, "ec_transfer_params", None)
    return ECRequestInfo(
        request_id=str(request.request_id),
        mm_hashes=tuple(str(f.identifier) for f in features),
        ec_transfer_params=params if isinstance(params, Mapping) else None,
        metadata_only=frozenset(str(f.identifier) for f in features if f.data is None),
        mm_metadata=(
            {str(f.identifier): _feature_metadata(f, fields_for) for f in features}
            if metadata
            else {}
        ),
        mm_tokens=tuple(_num_embeds(f) for f in features),
        mm_modalities=tuple(str(getattr(f, "modality", "") or "") for f in features),
        mm_ends=tuple(int(f.mm_position.offset) + int(f.mm_position.length) for f in features),
    )


class KVHandoffECConnector(ECConnectorBase):
    """kvhandoff's encoder-cache P2P tier as a vLLM EC connector (see the module
    docstring)."""

    def __init__(self, vllm_config: Any, role: Any, *, clock: Clock = real_clock) -> None:
        super().__init__(vllm_config, role)
        self.clock = clock
        self.config = ec_transfer_config(vllm_config)
        self.layout = ec_layout(vllm_config, self.config)
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        self.pcp_size = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
        self.region_name = region_name(self.config.engine_id, _dp_index(vllm_config))
        self.side: ECSide | None = None
        self.worker_side: ECWorkerSide | None = None  # attached on first use, see `_worker`
        self._fields_for: FieldsFor | None = None
        self._dtype = _dtype(vllm_config)
        self._ranks = (0, 0)
        self._stats_seen: dict[str, Any] = {}
        if role == ECConnectorRole.SCHEDULER:
            self._fields_for = _resolver(vllm_config)
            from vllm.version import __version__ as vllm_version

            compat = compatibility_hash(
                vllm_version,
                str(vllm_config.model_config.model),
                str(self._dtype),
                self.layout.block_size_bytes,
            )
            self.side = ECSide(
                self.config,
                self.layout,
                compat_hash=compat,
                env=dict(os.environ),
                dp_rank=_dp_index(vllm_config),
                clock=clock,
                tp_size=self.tp_size,
                pcp_size=self.pcp_size,
                local_worker=False,
            )
            assert self.side.region is not None
            self.region_name = self.side.region.name
        else:
            self._ranks = (
                _rank(vllm_config, self.tp_size, "tp"),
                _rank(vllm_config, self.pcp_size, "pcp"),
            )

    def _sched(self) -> ECSide:
        if self.side is None:
            raise RuntimeError("KVHandoffECConnector: a scheduler-side call on the worker role")
        return self.side

    def _worker(self) -> ECWorkerSide:
        """The rank's `ECWorkerSide`, attached to the scheduler's region on the first step:
        vLLM builds its workers (and their connectors) before the scheduler, whose process
        creates the region (R-E03)."""
        if self.side is not None:
            raise RuntimeError("KVHandoffECConnector: a worker-side call on the scheduler role")
        if self.worker_side is None:
            tp_rank, pcp_rank = self._ranks
            self.worker_side = ECWorkerSide(
                self.config,
                self.layout,
                region_name=self.region_name,
                tp_rank=tp_rank,
                pcp_rank=pcp_rank,
                dtype=self._dtype,
                clock=self.clock,
                device=_device(self._vllm_config),
            )
        return self.worker_side

    # -- worker side -----------------------------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: ECConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KVHandoffECConnectorMetadata):
            self._worker().bind_connector_metadata(connector_metadata.meta)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self.worker_side is not None:
            self.worker_side.clear_connector_metadata()

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._worker().start_load_caches(encoder_cache, **kwargs)

    def save_caches(
        self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any
    ) -> None:
        self._worker().save_caches(encoder_cache, mm_hash, **kwargs)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # nothing waits on a request: copies are per encoding

    def build_connector_worker_meta(self) -> KVHandoffECWorkerMetadata | None:
        if self.worker_side is None:
            return None
        meta = self.worker_side.build_connector_worker_meta()
        return None if meta is None else KVHandoffECWorkerMetadata(meta)

    # -- scheduler side --------------------------------------------------------------------

    def has_cache_item(self, identifier: str) -> bool:
        return self._sched().has_cache_item(identifier)

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        return self._sched().ensure_cache_available(ec_request(request), num_computed_tokens)

    def take_unavailable_requests(self) -> set[str]:
        return self._sched().take_unavailable_requests()

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        self._sched().update_state_after_alloc(ec_request(request), index)

    def update_state_after_free(self, request: Any, index: int) -> None:
        """Nothing to do: an entry is unpinned once every rank reported its load (R-T06)."""
        self._sched()

    def build_connector_meta(self, scheduler_output: Any) -> KVHandoffECConnectorMetadata:
        return KVHandoffECConnectorMetadata(self._sched().build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM's `ECConnectorOutput`: the ranks' aggregated `KVHandoffECWorkerMetadata`
        (anything else, or none, reports nothing)."""
        carried = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(connector_output, KVHandoffECWorkerMetadata):
            carried = connector_output
        meta = carried.meta if isinstance(carried, KVHandoffECWorkerMetadata) else None
        self._sched().update_connector_output(meta)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        side = self._sched()
        info = ec_request(request, metadata=side.config.is_producer, fields_for=self._fields_for)
        return side.request_finished(info)

    def has_pending_push_work(self) -> bool:
        """True while the engine must keep stepping (as vLLM 0.33's connector): a save or
        load unconfirmed, a read alive, or a P2P producer, whose requests come from peers
        (`ECScheduler.has_pending_work`)."""
        return self.side is not None and self.side.has_pending_push_work()

    def get_ec_connector_stats(self) -> KVHandoffECConnectorStats | None:
        """Scheduler: what moved since the last call (`stats.ec_totals`: events by name,
        refused inputs by cause, expired grant leases, evictions); None when nothing did,
        and always on a worker rank (its copies report through the worker metadata)."""
        if self.side is None:
            return None
        data = stats.delta(stats.ec_totals(self.side), self._stats_seen)
        return None if stats.is_empty(data) else KVHandoffECConnectorStats(data=data)

    @classmethod
    def build_ec_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVHandoffECConnectorStats | None:
        return KVHandoffECConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type[Any], type[Any]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVHandoffECPromMetrics:
        """kvhandoff's encoder-cache Prometheus metrics (`metrics.py`)."""
        return KVHandoffECPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.side is not None:
            self.side.close()
        if self.worker_side is not None:
            self.worker_side.shutdown()
