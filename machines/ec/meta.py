"""Data the encoder-cache connector exchanges with its engine: requests and step metadata.

- `ECRequest`: what the scheduler half reads from an engine request (a protocol, so an
  engine passes its own request object); `ECRequestInfo` is a plain implementation.
- `CopyItem`: one encoding to copy between the GPU encoder cache and the CPU region,
  under the transfer id the scheduler minted for it (R-T06).
- `ECConnectorMeta`: scheduler -> worker, once per step (`build_connector_meta`).
- `RankReport`: one worker rank -> scheduler, once per step
  (`build_connector_worker_meta`, R-E05): the transfer ids whose copies landed or failed.
- `ECWorkerMeta`: what reaches the scheduler's `update_connector_output`: the reports of
  every rank, aggregated (`aggregate` concatenates them, keeping each rank's identity, so
  the scheduler can tell a second rank from a duplicate, R-T02).
- `ECFinished`: what the worker's `take_landed` reports to its model runner.

Plain frozen slotted dataclasses, no I/O; part of the local tier. The step metadata
(`CopyItem`, `ECConnectorMeta`, `RankReport`, `ECWorkerMeta`, `ECFinished`) holds only
builtins, tuples, frozensets and nested such records, so it can cross a process boundary
as it is (R-T01). They are deliberately not msgspec Structs: the seed forbids the local
tier to import msgspec (R-E02), and msgspec encodes and decodes these dataclasses
natively, which is what an engine that ships them between processes does.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from kvhandoff.protocol.errors import LocalProtocolError

__all__ = [
    "CopyDirection",
    "CopyItem",
    "ECConnectorMeta",
    "ECFinished",
    "ECRequest",
    "ECRequestInfo",
    "ECWorkerMeta",
    "RankReport",
    "computed_inputs",
    "input_of",
    "tokens_by_hash",
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
    def mm_tokens(self) -> Sequence[int]:
        """Encoder tokens (rows) of each multimodal input, in `mm_hashes` order: the size
        the engine allocates for it, against which announced sizes are checked (S-04)."""
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
    mm_tokens: tuple[int, ...] = ()
    mm_modalities: tuple[str, ...] = ()
    """Modality of each multimodal input, in `mm_hashes` order (optional; published as
    vLLM's `modality`)."""
    mm_ends: tuple[int, ...] = ()
    """Prompt position just past each multimodal input (vLLM's `mm_position.offset +
    length`), in `mm_hashes` order; an input with `num_computed_tokens` at or past it is
    computed already and needs no encoding (optional: none means not known)."""


@dataclass(frozen=True, slots=True)
class CopyItem:
    """One encoding copied in a batch: its blocks in the region, in encoding order, and
    the transfer id every rank reports it under (R-T06)."""

    mm_hash: str
    blocks: tuple[int, ...]
    num_tokens: int
    transfer_id: int = 0


@dataclass(frozen=True, slots=True)
class ECConnectorMeta:
    """Scheduler -> worker for one step: what to load now, and where to save what the
    encoder computes this step."""

    loads: tuple[CopyItem, ...] = ()
    saves: tuple[CopyItem, ...] = ()


@dataclass(frozen=True, slots=True)
class RankReport:
    """One worker rank's copies whose end event fired since its last report (R-E05), by
    transfer id (R-T06).

    `saved` and `loaded` landed; `failed_saves` failed or were never submitted;
    `failed_loads` failed. A transfer ends only when every rank taking part reported it
    (loads: every rank; saves: the writer, TP 0 / PCP 0), R-T02.
    """

    tp_rank: int = 0
    pcp_rank: int = 0
    saved: tuple[int, ...] = ()
    loaded: tuple[int, ...] = ()
    failed_saves: tuple[int, ...] = ()
    failed_loads: tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.saved or self.loaded or self.failed_saves or self.failed_loads)


@dataclass(frozen=True, slots=True)
class ECWorkerMeta:
    """Worker ranks -> scheduler: the rank reports of one step, aggregated (R-T02)."""

    reports: tuple[RankReport, ...] = ()

    def aggregate(self, other: ECWorkerMeta) -> ECWorkerMeta:
        """Both sets of reports (vLLM aggregates the metas of its workers this way)."""
        return ECWorkerMeta(self.reports + other.reports)

    def __bool__(self) -> bool:
        return any(self.reports)


@dataclass(frozen=True, slots=True)
class ECFinished:
    """Copies that landed since the worker's last `get_finished` call."""

    saved: frozenset[str] = frozenset()
    loaded: frozenset[str] = frozenset()
    failed: frozenset[str] = frozenset()


def computed_inputs(request: ECRequest, num_computed_tokens: int) -> set[str]:
    """The inputs of `request` the engine computed already (their end position is at or
    before `num_computed_tokens`); `mm_ends` is optional on an engine's request."""
    ends = getattr(request, "mm_ends", ()) or ()
    if isinstance(num_computed_tokens, bool) or not isinstance(num_computed_tokens, int):
        return set()
    return {
        h
        for h, end in zip(request.mm_hashes, ends, strict=False)
        if isinstance(end, int) and end <= num_computed_tokens
    }


def tokens_by_hash(request: ECRequest) -> dict[str, int]:
    hashes, tokens = request.mm_hashes, request.mm_tokens
    return {h: int(t) for h, t in zip(hashes, tokens, strict=False)}


def input_of(request: ECRequest, index: int) -> tuple[str, int]:
    """(`mm_hash`, tokens) of input `index` of `request`; `LocalProtocolError` if bad."""
    hashes, tokens = request.mm_hashes, request.mm_tokens
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(hashes):
        raise LocalProtocolError(
            f"request {request.request_id!r} has {len(hashes)} multimodal inputs; no index "
            f"{index!r}"
        )
    if index >= len(tokens):
        raise LocalProtocolError(
            f"request {request.request_id!r} names no token count for input {index}"
        )
    count = tokens[index]
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise LocalProtocolError(f"num_tokens must be a positive int, got {count!r}")
    return hashes[index], count
