"""Model-based tests of every encoder-cache machine, full transition coverage (issue 4)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from kvhandoff.machines.catalog import EC_DECLARATIONS
from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY, EntryCtx
from kvhandoff.machines.ec.consumer_read import EC_CONSUMER_READ, Ack, ReadCtx
from kvhandoff.machines.ec.copy_batch import EC_COPY_BATCH
from kvhandoff.machines.ec.events import Unpin
from kvhandoff.machines.ec.meta import CopyItem
from kvhandoff.machines.ec.producer_grant import EC_PRODUCER_GRANT, Check, XferDone
from kvhandoff.machines.ec.request import (
    EC_REQUEST,
    EncodingLost,
    FallBack,
    Hold,
    Load,
    RequestCtx,
)
from kvhandoff.machines.ec.worker_region import EC_WORKER_REGION, Register
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.ec_grants import grant_ack, nack
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
        "id_prefix": st.just("c:1:"),
    }
)


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
        context=READ_CTX,
        payloads={Ack: ACKS.map(Ack)},
        invariants=[read_invariants],
    )


# -- ec.producer_grant ------------------------------------------------------------------------


def _check(version: int, compat: str, state: str | None, size: int) -> Check:
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
    )


CHECKS = st.builds(
    _check,
    st.sampled_from([EC_CONNECTOR_VERSION, EC_CONNECTOR_VERSION + 1]),
    st.sampled_from([COMPAT, "other"]),
    st.sampled_from([None, "allocated", "ready", "pinned"]),
    st.sampled_from([16, 9]),
)


def test_R_E09_R_E10_producer_grant_model() -> None:
    model_test(
        EC_PRODUCER_GRANT,
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
        assert ctx.failure and not ctx.held, "a failed request holds nothing"
    else:
        assert not set(ctx.local) & ctx.metadata_only, "no local fallback without media"


def test_B05_request_model() -> None:
    model_test(
        EC_REQUEST,
        context=st.fixed_dictionaries({"metadata_only": st.frozensets(HASHES, max_size=2)}),
        payloads={
            Hold: st.builds(Hold, HASHES),
            Load: st.builds(Load, HASHES),
            FallBack: st.builds(FallBack, HASHES, st.sampled_from(["NACK_MISSING", "ack_timeout"])),
            EncodingLost: st.builds(EncodingLost, HASHES),
        },
        invariants=[request_invariants],
    )


# -- ec.worker_region -------------------------------------------------------------------------


def test_R_E03_worker_region_model() -> None:
    model_test(
        EC_WORKER_REGION,
        max_examples=60,
        context=st.fixed_dictionaries({"writer": st.booleans()}),
        payloads={Register: st.builds(Register, st.integers(0, 2**40))},
    )


def test_every_ec_machine_has_a_model_test() -> None:
    expected = {decl.name for decl in EC_DECLARATIONS}
    tests = [name for name in globals() if name.startswith("test_") and name.endswith("_model")]
    assert len(tests) == len(expected), (tests, expected)
