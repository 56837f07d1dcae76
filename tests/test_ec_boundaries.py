"""What crosses a process boundary in an engine: the encoder-cache step metadata.

Scheduler -> worker (`ECConnectorMeta` of `CopyItem`s) and worker -> scheduler
(`ECWorkerMeta`), and what the worker reports to its runner (`ECFinished`), are frozen
slotted dataclasses of builtins, tuples and frozensets: no live object, lock or callable.
The local tier never imports msgspec (R-E02), but msgspec encodes and decodes these
records natively, which is what an engine that ships them between processes does.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, get_args, get_origin

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvhandoff.machines.ec.meta import (
    CopyItem,
    ECConnectorMeta,
    ECFinished,
    ECWorkerMeta,
    RankReport,
)

HASHES = st.text(min_size=1, max_size=12)
ITEMS = st.builds(
    CopyItem,
    HASHES,
    st.lists(st.integers(0, 2**31), max_size=8).map(tuple),
    st.integers(1, 2**20),
    st.integers(0, 2**62),
)
CONNECTOR_META = st.builds(
    ECConnectorMeta,
    st.lists(ITEMS, max_size=4).map(tuple),
    st.lists(ITEMS, max_size=4).map(tuple),
)
IDS = st.lists(st.integers(0, 2**62), max_size=5).map(tuple)
RANK_REPORT = st.builds(RankReport, st.integers(0, 7), st.integers(0, 3), IDS, IDS, IDS, IDS)
WORKER_META = st.builds(ECWorkerMeta, st.lists(RANK_REPORT, max_size=4).map(tuple))
FINISHED = st.builds(
    ECFinished, st.frozensets(HASHES), st.frozensets(HASHES), st.frozensets(HASHES)
)
RECORDS = (CopyItem, ECConnectorMeta, RankReport, ECWorkerMeta, ECFinished)


def round_trip(value: Any) -> Any:
    for encoder, decode in (
        (msgspec.msgpack.encode, msgspec.msgpack.decode),
        (msgspec.json.encode, msgspec.json.decode),
    ):
        again = decode(encoder(value), type=type(value))
        assert again == value and type(again) is type(value)
    return value


@given(CONNECTOR_META)
def test_R_T01_R_E05_scheduler_to_worker_meta_round_trips(meta: ECConnectorMeta) -> None:
    round_trip(meta)


@given(WORKER_META)
def test_R_T01_R_E05_worker_to_scheduler_meta_round_trips(meta: ECWorkerMeta) -> None:
    round_trip(meta)


@given(WORKER_META, WORKER_META)
def test_R_T02_aggregation_keeps_every_rank_report(a: ECWorkerMeta, b: ECWorkerMeta) -> None:
    both = a.aggregate(b)
    assert both.reports == a.reports + b.reports
    assert round_trip(both) == both


@given(FINISHED)
def test_R_E05_finished_copies_round_trip(finished: ECFinished) -> None:
    round_trip(finished)


def test_R_E05_empty_step_metadata_round_trips() -> None:
    for value in (ECConnectorMeta(), ECWorkerMeta(), ECFinished()):
        round_trip(value)
    assert not ECWorkerMeta(), "an empty report is falsy"
    assert not ECWorkerMeta((RankReport(1, 0),)), "so is one whose ranks report nothing"
    assert round_trip(ECWorkerMeta((RankReport(saved=(7,)),)))


def _plain(hint: object) -> bool:
    """Builtins, tuples/frozensets of plain types, literals, or another boundary record."""
    if hint in (str, int, float, bool, bytes) or hint in RECORDS:
        return True
    origin = get_origin(hint)
    if origin is typing.Literal:
        return all(isinstance(arg, str) for arg in get_args(hint))
    if origin in (tuple, frozenset):
        return all(arg is Ellipsis or _plain(arg) for arg in get_args(hint))
    return False


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: r.__name__)
def test_R_E05_boundary_records_are_frozen_slotted_and_plain(record: type) -> None:
    params = record.__dataclass_params__  # type: ignore[attr-defined]
    assert dataclasses.is_dataclass(record) and params.frozen
    assert "__slots__" in record.__dict__, "slotted: no per-instance dict"
    hints = typing.get_type_hints(record)
    loose = {name: hint for name, hint in hints.items() if not _plain(hint)}
    assert loose == {}, f"{record.__name__} carries more than builtins: {loose}"
