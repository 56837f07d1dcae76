"""Model-based tests of every encoder-cache machine, full transition coverage (issue 4)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvhandoff.machines.catalog import EC_DECLARATIONS
from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY, EntryCtx
from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ, Ack, Join, Leave, ReadCtx, Send
from kvhandoff.machines.ec.copy_batch import EC_COPY_BATCH
from kvhandoff.machines.ec.events import ReadFellBack, Unpin
from kvhandoff.machines.ec.meta import CopyItem
from kvhandoff.machines.ec.notices import EC_LANDED_COPY, EC_REQUEST_FAILURE
from kvhandoff.machines.ec.planned_save import EC_PLANNED_SAVE, PlannedSaveCtx
from kvhandoff.machines.ec.producer_agent import EC_PRODUCER_AGENT, AgentCtx
from kvhandoff.machines.ec.producer_grant import EC_PRODUCER_GRANT, Check, XferDone
from kvhandoff.machines.ec.publication_hold import EC_PUBLICATION_HOLD
from kvhandoff.machines.ec.read_handle import EC_READ_HANDLE, ReadHandleCtx
from kvhandoff.machines.ec.request import (
    EC_REQUEST,
    EncodingLost,
    FallBack,
    RequestCtx,
    Settled,
)
from kvhandoff.machines.ec.settlement import EC_SETTLEMENT, Consider, Load, SettlementCtx
from kvhandoff.machines.ec.transfer import EC_TRANSFER, RankReported, TransferCtx
from kvhandoff.machines.ec.worker_region import EC_WORKER_REGION, Register
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_grants import grant_ack, nack
from kvhandoff.protocol.ec_publication import PublishedEncoding
from kvhandoff.protocol.ec_status import EC_CONNECTOR_VERSION, XferStatus, compatibility_hash
from kvhandoff.protocol.ec_wire import XferAck, XferReq
from kvhandoff.testing import run_model_test

COMPAT = compatibility_hash("1.0", "model", "bfloat16", 8)


def model_test(decl: Any, max_examples: int = 150, **options: Any) -> None:
    coverage = run_model_test(decl, max_examples=max_examples, **options)
    assert not coverage.missing()


# -- ec.cache_entry ----------------------------------------------------------------------


def entry_pins_match_state(inst: Instance[EntryCtx]) -> None:
    pins = inst.ctx.pins
    assert (pins > 0) == (inst.state == "pinned"), (inst.state, pins)
    assert inst.has("evictable") == (inst.state == "ready")


def test_R_E04_cache_entry_model() -> None:
    model_test(
        EC_CACHE_ENTRY,
        context=st.fixed_dictionaries(
            {
                "blocks": st.lists(st.integers(0, 63), min_size=1, max_size=4, unique=True).map(
                    tuple
                ),
                "size_bytes": st.integers(1, 64),
                "origin": st.sampled_from(["save", "read"]),
            }
        ),
        payloads={Unpin: st.builds(Unpin, st.booleans())},
        invariants=[entry_pins_match_state],
    )


# -- ec.copy_batch ---------------------------------------------------------------------------

ITEMS = st.lists(
    st.builds(CopyItem, st.sampled_from(["a", "b", "c"]), st.just((1, 2)), st.integers(1, 4)),
    min_size=1,
    max_size=3,
).map(tuple)


def test_R_E05_copy_batch_model() -> None:
    model_test(
        EC_COPY_BATCH,
        max_examples=60,
        context=st.fixed_dictionaries(
            {"direction": st.sampled_from(["save", "load"]), "items": ITEMS}
        ),
    )


# -- ec.landed_copy and ec.request_failure (notices) -----------------------------------------


def notice_tags(inst: Instance[Any]) -> None:
    assert inst.has("untaken") == (inst.state == "posted")


def test_R_E05_landed_copy_model() -> None:
    model_test(
        EC_LANDED_COPY,
        max_examples=20,
        context=st.fixed_dictionaries(
            {
                "direction": st.sampled_from(["save", "load"]),
                "mm_hashes": st.just(("h",)),
                "ok": st.booleans(),
            }
        ),
        invariants=[notice_tags],
    )


def test_B05_request_failure_model() -> None:
    model_test(
        EC_REQUEST_FAILURE,
        max_examples=20,
        context=st.fixed_dictionaries({"request_id": st.just("r1"), "reason": st.just("lost")}),
        invariants=[notice_tags],
    )


def planned_save_tags(inst: Instance[PlannedSaveCtx]) -> None:
    assert inst.has("planned") == (inst.state == "planned")
    assert inst.has("unsaved") == (inst.state in ("planned", "abandoned"))


def test_R_E03_R_T06_planned_save_model() -> None:
    model_test(
        EC_PLANNED_SAVE,
        max_examples=40,
        context=st.fixed_dictionaries(
            {"item": st.builds(CopyItem, st.just("h"), st.just((1, 2)), st.just(2))}
        ),
        invariants=[planned_save_tags],
    )


# -- ec.consumer_read -------------------------------------------------------------------------

REQ = XferReq(
    version=EC_CONNECTOR_VERSION,
    transfer_id="c:1:1",
    mm_hash="h",
    compat_hash=COMPAT,
    consumer_engine_id="c",
    consumer_agent_name="c",
    num_blocks=2,
    size_bytes=16,
)
OK_ACK = grant_ack(
    REQ,
    producer_agent_name="p",
    producer_agent_metadata=b"md",
    block_indices=[5, 6],
    block_size_bytes=8,
    size_bytes=16,
    region_base_addr=0,
    lease_s=30.0,
)
ACKS: st.SearchStrategy[XferAck] = st.one_of(
    st.just(OK_ACK),
    st.sampled_from([nack(REQ, s) for s in XferStatus if s is not XferStatus.OK]),
    st.just(nack(REQ, XferStatus.NACK_NOT_READY)),
)
READ_CTX = st.fixed_dictionaries(
    {
        "max_not_ready": st.just(3.0),
        "peer_host": st.just("p"),
        "peer_port": st.just(5601),
        "size_bytes": st.just(16),
        "dest_blocks": st.just((0, 1)),
        "compat_hash": st.just(COMPAT),
        "engine_id": st.just("c"),
        "agent_name": st.just("c"),
        "not_ready_s": st.just(60.0),
    }
)
WAITERS = st.sampled_from([("r1", "h"), ("r2", "h")])


def read_invariants(inst: Instance[ReadCtx]) -> None:
    ctx = inst.ctx
    assert ctx.dest_blocks == (0, 1), "the destination is never given up while the read lives"
    assert ctx.not_ready <= 3
    if inst.state == "retry_next_step":
        assert ctx.not_ready >= 1, "only a NACK_NOT_READY leads here"
    if inst.state == "reading":
        assert ctx.grant is not None and ctx.grant.status is XferStatus.OK
    assert inst.has("timed_wait") == (inst.timer is not None), "tagged exactly when timed"


def test_R_E08_R_E12_consumer_read_model() -> None:
    model_test(
        EC_CONSUMER_READ,
        max_examples=300,  # 28 transitions; 150 examples leave one to chance
        context=READ_CTX,
        payloads={
            Ack: ACKS.map(lambda reply: Ack(reply, 0.0)),
            Send: st.builds(
                Send,
                st.text("0123456789abcdef", min_size=32, max_size=32),
                st.sampled_from([0.0, 0.0, 120.0]),  # 120 s: past the not-ready budget
            ),
            Join: st.builds(Join, WAITERS),
            Leave: st.builds(Leave, WAITERS),
        },
        invariants=[read_invariants],
    )


# -- ec.producer_grant ------------------------------------------------------------------------


def _check(version: int, compat: str, state: str | None, size: int, pins: int = 0) -> Check:
    req = XferReq(
        version=version,
        transfer_id="t",
        mm_hash="h",
        compat_hash=compat,
        consumer_engine_id="c",
        consumer_agent_name="c",
        num_blocks=2,
        size_bytes=size,
    )
    present = state is not None
    return Check(
        req,
        COMPAT,
        entry_present=present,
        entry_loadable=state in ("ready", "pinned"),
        entry_blocks=(3, 4) if present else (),
        entry_size_bytes=16 if present else 0,
        peer_grants=pins,
        total_grants=pins,
    )


CHECKS = st.builds(
    _check,
    st.sampled_from([EC_CONNECTOR_VERSION, EC_CONNECTOR_VERSION + 1]),
    st.sampled_from([COMPAT, "other"]),
    st.sampled_from([None, "allocated", "ready", "pinned"]),
    st.sampled_from([16, 9]),
    st.sampled_from([0, 0, 0, 0, 256]),
)


def test_R_E09_R_E10_S_03_producer_grant_model() -> None:
    model_test(
        EC_PRODUCER_GRANT,
        max_examples=300,
        context=st.fixed_dictionaries(
            {
                "peer": st.just(b"peer"),
                "mm_hash": st.just("h"),
                "agent_name": st.sampled_from(["agent", ""]),
                "agent_metadata": st.just(b"md"),
                "block_size_bytes": st.just(8),
            }
        ),
        payloads={Check: CHECKS, XferDone: st.builds(XferDone, st.booleans())},
    )


# -- ec.request -------------------------------------------------------------------------------

HASHES = st.sampled_from(["a", "b", "c"])


def request_invariants(inst: Instance[RequestCtx]) -> None:
    ctx = inst.ctx
    if inst.has("failed_cleanly"):
        assert ctx.failure, "a failed request says why"
    else:
        assert not set(ctx.local) & ctx.metadata_only, "no local fallback without media"


def test_B05_request_model() -> None:
    model_test(
        EC_REQUEST,
        context=st.fixed_dictionaries(
            {
                "mm_hashes": st.sampled_from([("a",), ("a", "b")]),
                "metadata_only": st.frozensets(HASHES, max_size=2),
            }
        ),
        payloads={
            Settled: st.builds(Settled, HASHES),
            FallBack: st.builds(FallBack, HASHES, st.sampled_from(["NACK_MISSING", "ack_timeout"])),
            EncodingLost: st.builds(EncodingLost, HASHES),
        },
        invariants=[request_invariants],
    )


# -- ec.settlement ----------------------------------------------------------------------------

PUBLISHED = PublishedEncoding({"grid": [1, 2, 2]}, "p", 5601, 16)
CONSIDERS = st.builds(
    Consider,
    computed=st.sampled_from([False, False, False, True]),
    loadable=st.booleans(),
    read_in_flight=st.booleans(),
    own_save_pending=st.booleans(),
    quarantined=st.booleans(),
    size_problem=st.sampled_from(["", "too big"]),
    published=st.sampled_from([None, PUBLISHED]),
    p2p=st.booleans(),
    unservable=st.booleans(),
    params_error=st.sampled_from(["", "malformed"]),
)


def settlement_invariants(inst: Instance[SettlementCtx]) -> None:
    assert inst.has("encode_locally") == bool(inst.ctx.reason), "local exactly with a reason"


def test_R_E07_B05_S_04_settlement_model() -> None:
    model_test(
        EC_SETTLEMENT,
        max_examples=400,  # the `computed` route joined; 250 left one transition to chance
        context=st.fixed_dictionaries({}),
        payloads={
            Consider: st.one_of(CONSIDERS, st.just(Consider(own_save_pending=True))),
            ReadFellBack: st.builds(ReadFellBack, st.sampled_from(["ack_timeout", "NACK_MISSING"])),
            Load: st.builds(Load, st.integers(1, 9)),
        },
        invariants=[settlement_invariants],
    )


# -- ec.transfer ------------------------------------------------------------------------------


def transfer_invariants(inst: Instance[TransferCtx]) -> None:
    ctx = inst.ctx
    assert ctx.pending <= ctx.participants and ctx.failed_ranks <= ctx.participants
    assert inst.has("in_flight") == (inst.state == "copying")


def test_R_T02_R_T06_transfer_model() -> None:
    model_test(
        EC_TRANSFER,
        context=st.fixed_dictionaries(
            {
                "mm_hash": st.just("h"),
                "direction": st.sampled_from(["save", "load"]),
                "request_id": st.just("r"),
                "participants": st.just(frozenset({0, 1})),
                "pending": st.builds(set, st.just([0, 1])),
            }
        ),
        payloads={RankReported: st.builds(RankReported, st.integers(0, 2), st.booleans())},
        invariants=[transfer_invariants],
    )


# -- ec.producer_agent ----------------------------------------------------------------------


def agent_invariants(inst: Instance[AgentCtx]) -> None:
    reads = inst.ctx.reads
    assert reads >= 0
    assert (reads > 0) == (inst.state in ("reading", "stale")), (inst.state, reads)


def test_R_E11_B_08_producer_agent_model() -> None:
    model_test(
        EC_PRODUCER_AGENT,
        context=st.fixed_dictionaries({"metadata": st.just(b"md")}),
        invariants=[agent_invariants],
    )


# -- ec.worker_region -------------------------------------------------------------------------


def test_R_E03_worker_region_model() -> None:
    model_test(
        EC_WORKER_REGION,
        max_examples=60,
        context=st.fixed_dictionaries({"writer": st.booleans()}),
        payloads={Register: st.builds(Register, st.integers(0, 2**40))},
    )


def read_handle_tags(inst: Instance[ReadHandleCtx]) -> None:
    assert inst.has("in_flight") == (inst.state == "posted")
    assert inst.has("unreported") == (inst.state == "failed_unreported")


def test_R_E12_B_08_read_handle_model() -> None:
    model_test(
        EC_READ_HANDLE,
        max_examples=30,
        context=st.fixed_dictionaries({"mm_hash": st.just("h"), "agent": st.just("p")}),
        invariants=[read_handle_tags],
    )


def test_R_E06_B_01_publication_hold_model() -> None:
    model_test(
        EC_PUBLICATION_HOLD,
        max_examples=20,
        context=st.fixed_dictionaries({}),
    )


def test_every_ec_machine_has_a_model_test() -> None:
    expected = {decl.name for decl in EC_DECLARATIONS}
    tests = [name for name in globals() if name.startswith("test_") and name.endswith("_model")]
    assert len(tests) == len(expected), (tests, expected)
