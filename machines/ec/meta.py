"""Data the encoder-cache connector exchanges with its engine: requests and step metadata.

- `ECRequest`: what the scheduler half reads from an engine request (a protocol, so an
  engine passes its own request object); `ECRequestInfo` is a plain implementation.
- `CopyItem`: one encoding to copy between the GPU encoder cache and the CPU region.
- `ECConnectorMeta`: scheduler -> worker, once per step (`build_connector_meta`).
- `ECWorkerMeta`: worker -> scheduler, once per step (`build_connector_worker_meta` ->
  `update_connector_output`, R-E05).
- `ECFinished`: what the worker's `get_finished` reports to its model runner.

Plain frozen slotted dataclasses, no I/O; part of the local tier. The step metadata
(`CopyItem`, `ECConnectorMeta`, `ECWorkerMeta`, `ECFinished`) holds only builtins,
tuples, frozensets and nested such records, so it can cross a process boundary as it is
(msgspec encodes and decodes these dataclasses natively; the local tier itself never
imports msgspec, R-E02).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

__all__ = [
    "CopyDirection",
    "CopyItem",
    "ECConnectorMeta",
    "ECFinished",
    "ECRequest",
    "ECRequestInfo",
    "ECWorkerMeta",
]

CopyDirection = Literal["save", "load"]
"""`save`: GPU encoder cache -> CPU region; `load`: CPU region -> GPU encoder cache."""


class ECRequest(Protocol):
    """The fields of an engine request the scheduler half reads."""

    @property
    def request_id(self) -> str: ...

    @property
    def mm_hashes(self) -> Sequence[str]:
        """The request's multimodal inputs, by `mm_hash`."""
        ...

    @property
    def ec_transfer_params(self) -> Mapping[str, Any] | None:
        """Producer publications received with the request (consumer side), if any."""
        ...

    @property
    def metadata_only(self) -> Collection[str]:
        """`mm_hash`es whose media the orchestrator rewrote into a metadata-only
        reference: they cannot be encoded locally (B-05)."""
        ...

    @property
    def mm_metadata(self) -> Mapping[str, Mapping[str, Any]]:
        """Per `mm_hash`, the model's placeholder fields for its modality (producer side,
        published with the encoding, R-E06)."""
        ...


@dataclass(frozen=True, slots=True)
class ECRequestInfo:
    """A plain `ECRequest`."""

    request_id: str
    mm_hashes: tuple[str, ...] = ()
    ec_transfer_params: Mapping[str, Any] | None = None
    metadata_only: frozenset[str] = frozenset()
    mm_metadata: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CopyItem:
    """One encoding copied in a batch: its blocks in the region, in encoding order."""

    mm_hash: str
    blocks: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ECConnectorMeta:
    """Scheduler -> worker for one step: what to load now, and where to save what the
    encoder computes this step."""

    loads: tuple[CopyItem, ...] = ()
    saves: tuple[CopyItem, ...] = ()


@dataclass(frozen=True, slots=True)
class ECWorkerMeta:
    """Worker -> scheduler: copies whose end event fired since the last report (R-E05).

    `saved` entries become ready, `loaded` entries are unpinned. `failed_saves` are saves
    that failed or were never submitted (their entries are discarded); `failed_loads`
    are loads that failed (their entries are unpinned and their requests failed, B-05).
    """

    saved: tuple[str, ...] = ()
    loaded: tuple[str, ...] = ()
    failed_saves: tuple[str, ...] = ()
    failed_loads: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.saved or self.loaded or self.failed_saves or self.failed_loads)


@dataclass(frozen=True, slots=True)
class ECFinished:
    """Copies that landed since the worker's last `get_finished` call."""

    saved: frozenset[str] = frozenset()
    loaded: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()
