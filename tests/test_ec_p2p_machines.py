"""Encoder-cache P2P machines, one by one: the consumer read and the producer grant
(issue 4), on a bus where `Emit`s to the cache entries are recorded, not delivered."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest
from test_ec_machines import discards, effects, isolated_bus

from kvhandoff.machines.ec.cache_entry import EC_CACHE_ENTRY
from kvhandoff.machines.ec.consumer_read import (
    EC_CONSUMER_READ,
    Ack,
    IssueRead,
    Join,
    ReadCtx,
    ReadDone,
    ReadFailed,
    ReadReleased,
    ReleaseRead,
    Send,
    SendXferDone,
    SendXferReq,
)
from kvhandoff.machines.ec.events import (
    Discard,
    PeerDisconnected,
    Pin,
    ReadFellBack,
    ReadLanded,
    Saved,
    Unpin,
)
from kvhandoff.machines.ec.producer_grant import (
    EC_PRODUCER_GRANT,
    Check,
    GrantCtx,
    ReadNotified,
    SendXferAck,
    XferDone,
)
from kvhandoff.machines.ec.settlement import EC_SETTLEMENT
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.effects import Emit
from kvhandoff.protocol.ec_grants import check_xfer_req, grant_ack, nack
from kvhandoff.protocol.ec_status import (
    EC_CONNECTOR_VERSION,
    EXTENSIONS,
    NACKS,
    RETRYABLE_NACKS,
    XferStatus,
    compatibility_hash,
)
from kvhandoff.protocol.ec_wire import XferAck, XferReq
from kvhandoff.protocol.errors import RemoteProtocolError

COMPAT = compatibility_hash("1.0", "model", "bfloat16", 8)
WAITER = ("r1", "h")


def fell_back(reason: str) -> Emit:
    """What the read tells its waiter when it falls back."""
    return Emit(EC_SETTLEMENT, WAITER, ReadFellBack(reason))


# -- consumer read -------------------------------------------------------------------------


def read_bus(**config: float) -> EventBus:
    bus = isolated_bus()
    machine = bus.register(EC_CONSUMER_READ, config or None)
    ctx = ReadCtx(
        "h",
        peer_host="p.host",
        peer_port=5601,
        size_bytes=24,
        dest_blocks=(4, 5, 6),
        compat_hash=COMPAT,
        engine_id="c",
        agent_name="c",
        max_not_ready=machine.config["consumer_max_not_ready_retries"],
        not_ready_s=machine.config["consumer_not_ready_timeout_s"],
        waiters={WAITER},
    )
    bus.create(EC_CONSUMER_READ, ctx, 0.0)
    return bus


def sent_request(bus: EventBus, now: float = 0.0) -> XferReq:
    effects(bus)
    inst = bus.get(EC_CONSUMER_READ, "h")
    attempt = 1 if inst is None else inst.ctx.attempt + 1
    bus.dispatch(EC_CONSUMER_READ, "h", Send(f"{attempt:032x}", now), now)
    (effect,) = effects(bus)
    assert isinstance(effect, SendXferReq)
    assert (effect.peer_host, effect.peer_port) == ("p.host", 5601)
    return effect.req


def granted(req: XferReq) -> XferAck:
    return grant_ack(
        req,
        producer_agent_name="agent-p",
        producer_agent_metadata=b"nixl-md",
        block_indices=[7, 8, 9],
        block_size_bytes=8,
        size_bytes=24,
        region_base_addr=4096,
        lease_s=30.0,
    )


def ack(bus: EventBus, reply: XferAck, now: float = 0.0) -> None:
    bus.dispatch(EC_CONSUMER_READ, "h", Ack(reply, now), now)


def test_R_E07_xfer_req_then_read_then_done() -> None:
    bus = read_bus()
    req = sent_request(bus)
    assert (req.version, req.mm_hash, req.num_blocks, req.size_bytes) == (2, "h", 3, 24)
    assert req.compat_hash == COMPAT and req.transfer_id == f"{1:032x}"
    assert "xfer_done" in req.extensions, "the consumer advertises its extensions (C-04)"
    assert bus.has_tag(EC_CONSUMER_READ, "h", "awaiting_ack")
    ack(bus, granted(req))
    (read,) = effects(bus)
    assert isinstance(read, IssueRead)
    assert read.src_blocks == (7, 8, 9) and read.dst_blocks == (4, 5, 6)
    assert bus.has_tag(EC_CONSUMER_READ, "h", "read_awaited")
    bus.dispatch(EC_CONSUMER_READ, "h", ReadDone(), 0.0)
    out = effects(bus)
    assert out[0] == Emit(EC_CACHE_ENTRY, "h", Saved())
    assert out[1] == Emit(EC_SETTLEMENT, WAITER, ReadLanded()), "its waiter holds it"
    assert isinstance(out[2], SendXferDone) and out[2].done.ok
    assert bus.get(EC_CONSUMER_READ, "h") is None


def test_C_04_xfer_done_only_to_a_producer_that_advertised_it() -> None:
    bus = read_bus()
    grant = granted(sent_request(bus))
    ack(
        bus,
        type(grant)(
            **{**{f: getattr(grant, f) for f in grant.__struct_fields__}, "extensions": ()}
        ),
    )
    effects(bus)
    bus.dispatch(EC_CONSUMER_READ, "h", ReadDone(), 0.0)
    assert not any(isinstance(e, SendXferDone) for e in effects(bus))


def test_C_04_the_read_notif_releases_a_stock_grant_xfer_done_a_kvhandoff_one() -> None:
    """Exactly one release per grant: a producer that advertised `xfer_done` gets
    `XferDone` and a READ without a notif; any other (a stock vLLM producer) gets the
    READ notif `<session_id>:<mm_hash>` and no `XferDone` (C-03, C-04)."""
    for extensions in (EXTENSIONS, ()):
        bus = read_bus()
        inst = bus.get(EC_CONSUMER_READ, "h")
        assert inst is not None
        inst.ctx.session_id = "sess"
        grant = granted(sent_request(bus))
        ack(bus, msgspec.structs.replace(grant, extensions=extensions))
        (read,) = effects(bus)
        assert isinstance(read, IssueRead)
        assert read.notif == (b"" if extensions else b"sess:h")
        bus.dispatch(EC_CONSUMER_READ, "h", ReadDone(), 0.0)
        dones = [e for e in effects(bus) if isinstance(e, SendXferDone)]
        assert len(dones) == (1 if extensions else 0)


def test_C_03_a_grant_ends_once_by_notif_or_xfer_done() -> None:
    for release in ("notif", "done"):
        bus = grant_bus()
        req = a_request(session_id="sess")
        key = (b"peer", req.transfer_id)
        create_grant(bus, key)
        inst = bus.get(EC_PRODUCER_GRANT, key)
        assert inst is not None
        inst.ctx.notif_key = "sess:h"
        bus.dispatch(EC_PRODUCER_GRANT, key, check_of(req, "ready"), 0.0)
        effects(bus)
        first = ReadNotified() if release == "notif" else XferDone(True)
        bus.dispatch(EC_PRODUCER_GRANT, key, first, 0.0)
        assert [e.event for e in effects(bus) if isinstance(e, Emit)] == [Unpin(consumed=True)]
        with pytest.raises(RemoteProtocolError):  # the second release finds no grant
            bus.dispatch(EC_PRODUCER_GRANT, key, XferDone(True), 0.0)


def test_R_E11_read_uses_the_agent_metadata_carried_by_the_ack() -> None:
    bus = read_bus()
    ack(bus, granted(sent_request(bus)))
    (read,) = effects(bus)
    assert isinstance(read, IssueRead)
    assert read.producer_agent_name == "agent-p"
    assert read.producer_agent_metadata == b"nixl-md"
    assert read.remote_base_addr == 4096


def test_R_E08_not_ready_retries_without_failure_and_keeps_blocks_B04() -> None:
    bus = read_bus()
    req = sent_request(bus)
    ack(bus, nack(req, XferStatus.NACK_NOT_READY))
    inst = bus.get(EC_CONSUMER_READ, "h")
    assert inst is not None and inst.state == "retry_next_step"
    assert inst.has("retry_pending") and inst.has("in_flight")
    out = effects(bus)
    assert not any(isinstance(e, Emit) and isinstance(e.event, ReadFellBack) for e in out)
    assert not discards(out), "blocks kept"
    assert inst.ctx.dest_blocks == (4, 5, 6)
    again = sent_request(bus)
    assert again.transfer_id == f"{2:032x}" and again.num_blocks == 3
    assert inst.ctx.past_ids == [req.transfer_id], "the earlier id is remembered as stale"
    assert bus.metrics.get("ec.consumer.not_ready") == 1.0


@pytest.mark.parametrize("status", sorted(NACKS - RETRYABLE_NACKS))
def test_R_E08_every_other_nack_falls_back_and_frees_the_destination(status: XferStatus) -> None:
    bus = read_bus()
    req = sent_request(bus)
    ack(bus, nack(req, status))
    assert bus.get(EC_CONSUMER_READ, "h") is None
    assert effects(bus)[:2] == [Emit(EC_CACHE_ENTRY, "h", Discard()), fell_back(str(status))]


def test_R_E08_classification_comes_from_retryable_nacks(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvhandoff.protocol.ec_status as status_module

    monkeypatch.setattr(
        status_module,
        "RETRYABLE_NACKS",
        frozenset({XferStatus.NACK_NOT_READY, XferStatus.NACK_INTERNAL}),
    )
    bus = read_bus()
    ack(bus, nack(sent_request(bus), XferStatus.NACK_INTERNAL))
    assert bus.get(EC_CONSUMER_READ, "h").state == "retry_next_step"  # type: ignore[union-attr]


def test_R_E08_not_ready_retries_are_bounded_by_config() -> None:
    bus = read_bus(consumer_max_not_ready_retries=2)
    for _ in range(2):
        ack(bus, nack(sent_request(bus), XferStatus.NACK_NOT_READY))
    ack(bus, nack(sent_request(bus), XferStatus.NACK_NOT_READY))
    assert bus.get(EC_CONSUMER_READ, "h") is None
    assert fell_back("NACK_NOT_READY") in effects(bus)


def test_R_E08_not_ready_retries_are_bounded_by_time_too() -> None:
    bus = read_bus(consumer_not_ready_timeout_s=5.0, consumer_ack_timeout_s=10.0)
    ack(bus, nack(sent_request(bus, 0.0), XferStatus.NACK_NOT_READY), 1.0)
    ack(bus, nack(sent_request(bus, 1.0), XferStatus.NACK_NOT_READY), 4.9)
    assert bus.has_tag(EC_CONSUMER_READ, "h", "retry_pending")
    ack(bus, nack(sent_request(bus, 4.9), XferStatus.NACK_NOT_READY), 5.0)
    assert bus.get(EC_CONSUMER_READ, "h") is None, "5 s after the first XferReq it gives up"
    assert fell_back("NACK_NOT_READY") in effects(bus)


def test_R_E08_the_not_ready_budget_is_checked_at_each_step_not_only_at_a_nack() -> None:
    """A retry due after the budget falls back at that step, without asking again (the
    budget was checked only when a NACK arrived, so one more XferReq went out)."""
    bus = read_bus(consumer_not_ready_timeout_s=5.0, consumer_ack_timeout_s=10.0)
    ack(bus, nack(sent_request(bus, 0.0), XferStatus.NACK_NOT_READY), 1.0)
    assert bus.has_tag(EC_CONSUMER_READ, "h", "retry_pending")
    effects(bus)
    bus.dispatch(EC_CONSUMER_READ, "h", Send(f"{2:032x}", 6.0), 6.0)  # the next step, late
    out = effects(bus)
    assert not any(isinstance(e, SendXferReq) for e in out), "no XferReq past the budget"
    assert fell_back("not_ready_timeout") in out
    assert bus.get(EC_CONSUMER_READ, "h") is None


def test_R_E07_a_second_request_joins_the_read_in_flight() -> None:
    bus = read_bus()
    ack(bus, granted(sent_request(bus)))
    bus.dispatch(EC_CONSUMER_READ, "h", Join(("r2", "h")), 0.0)
    effects(bus)
    bus.dispatch(EC_CONSUMER_READ, "h", ReadDone(), 0.0)
    out = effects(bus)
    assert Emit(EC_SETTLEMENT, WAITER, ReadLanded()) in out
    assert Emit(EC_SETTLEMENT, ("r2", "h"), ReadLanded()) in out


def test_R_E12_ack_timeout_falls_back_after_consumer_ack_timeout_s() -> None:
    bus = read_bus(consumer_ack_timeout_s=2.0)
    sent_request(bus)
    assert bus.deadline_of(EC_CONSUMER_READ, "h") == 2.0
    assert bus.fire_due(1.9) == 0
    assert bus.fire_due(2.1) == 1
    assert bus.get(EC_CONSUMER_READ, "h") is None
    assert effects(bus)[:2] == [Emit(EC_CACHE_ENTRY, "h", Discard()), fell_back("ack_timeout")]


def test_R_E12_read_timeout_quarantines_60s_without_eviction() -> None:
    bus = read_bus()
    ack(bus, granted(sent_request(bus)))
    effects(bus)
    bus.fire_due(20.0)
    inst = bus.get(EC_CONSUMER_READ, "h")
    assert inst is not None and inst.state == "quarantined"
    assert inst.has("read_posted") and not inst.has("in_flight")
    out = effects(bus)
    assert fell_back("read_timeout") in out, "the request falls back at once"
    assert not discards(out)
    assert bus.fire_due(79.9) == 0
    bus.fire_due(80.0)
    assert inst.state == "releasing", "the quarantine is over: the handle is released first"
    assert effects(bus) == [ReleaseRead("h", inst.ctx.transfer_id)]
    assert bus.get(EC_CONSUMER_READ, "h") is inst, "never freed before its handle is released"
    bus.dispatch(EC_CONSUMER_READ, "h", ReadReleased(), 80.0)
    assert bus.get(EC_CONSUMER_READ, "h") is None
    assert Emit(EC_CACHE_ENTRY, "h", Discard()) in effects(bus)


def test_R_E12_a_quarantined_read_frees_its_destination_when_its_dma_completes() -> None:
    bus = read_bus()
    ack(bus, granted(sent_request(bus)))
    bus.fire_due(20.0)
    effects(bus)
    bus.dispatch(EC_CONSUMER_READ, "h", ReadDone(), 21.0)  # reported after the handle went
    assert bus.get(EC_CONSUMER_READ, "h") is None, "freed at once, not after 60 s"
    assert Emit(EC_CACHE_ENTRY, "h", Discard()) in effects(bus)


def test_R_E08_peer_disconnect_falls_back_before_the_read_and_quarantines_during() -> None:
    bus = read_bus()
    sent_request(bus)
    bus.dispatch(EC_CONSUMER_READ, "h", PeerDisconnected(), 0.0)
    assert fell_back("peer_disconnected") in effects(bus)
    bus2 = read_bus()
    ack(bus2, granted(sent_request(bus2)))
    bus2.dispatch(EC_CONSUMER_READ, "h", PeerDisconnected(), 0.0)
    assert bus2.get(EC_CONSUMER_READ, "h").state == "quarantined"  # type: ignore[union-attr]


def test_R_E08_read_failure_falls_back_and_tells_the_producer() -> None:
    bus = read_bus()
    ack(bus, granted(sent_request(bus)))
    effects(bus)
    bus.dispatch(EC_CONSUMER_READ, "h", ReadFailed(), 0.0)
    out = effects(bus)
    assert isinstance(out[0], SendXferDone) and not out[0].done.ok
    assert fell_back("read_failed") in out


def test_R_E12_peer_events_a_state_does_not_declare_are_remote_errors() -> None:
    """A completion or ack a peer provokes in the wrong state never crashes the engine
    with a local error, and changes nothing."""
    bus = read_bus()
    sent_request(bus)
    with pytest.raises(RemoteProtocolError, match="'read_done' is not declared"):
        bus.dispatch(EC_CONSUMER_READ, "h", ReadDone(), 0.0)
    with pytest.raises(RemoteProtocolError, match="no live instance"):
        bus.dispatch(EC_CONSUMER_READ, "other", ReadFailed(), 0.0)
    assert bus.get(EC_CONSUMER_READ, "h").state == "xfer_req_sent"  # type: ignore[union-attr]
    assert bus.counters(EC_CONSUMER_READ).rejected == 2


# -- producer grant ----------------------------------------------------------------------


def grant_bus(**config: float) -> EventBus:
    bus = isolated_bus()
    bus.register(EC_PRODUCER_GRANT, config or None)
    return bus


def a_request(**overrides: Any) -> XferReq:
    fields: dict[str, Any] = {
        "version": EC_CONNECTOR_VERSION,
        "transfer_id": "t1",
        "mm_hash": "h",
        "compat_hash": COMPAT,
        "consumer_engine_id": "c",
        "consumer_agent_name": "c",
        "num_blocks": 2,
        "size_bytes": 16,
    }
    fields.update(overrides)
    return XferReq(**fields)


def check_of(req: XferReq, state: str | None) -> Check:
    """The snapshot of an entry in `state` (None: absent) that the producer takes."""
    return Check(
        req,
        COMPAT,
        entry_present=state is not None,
        entry_loadable=state in ("ready", "pinned"),
        entry_blocks=(3, 4) if state else (),
        entry_size_bytes=16 if state else 0,
    )


def create_grant(bus: EventBus, key: tuple[bytes, str], *, agent: bool = True) -> None:
    ctx = GrantCtx(
        key,
        peer=key[0],
        mm_hash="h",
        agent_name="agent-p" if agent else "",
        agent_metadata=b"md" if agent else b"",
        region_base_addr=4096,
        block_size_bytes=8,
    )
    bus.create(EC_PRODUCER_GRANT, ctx, 0.0)


def answer(bus: EventBus, req: XferReq, state: str | None, *, agent: bool = True) -> XferAck:
    key = (b"peer", req.transfer_id)
    create_grant(bus, key, agent=agent)
    bus.dispatch(EC_PRODUCER_GRANT, key, check_of(req, state), 0.0)
    acks = [e for e in effects(bus) if isinstance(e, SendXferAck)]
    assert len(acks) == 1 and acks[0].peer == b"peer"
    return acks[0].ack


@pytest.mark.parametrize(
    ("req", "state", "status"),
    [
        (a_request(version=1, compat_hash="x"), None, XferStatus.NACK_VERSION),
        (a_request(transfer_id=""), "ready", XferStatus.NACK_INTERNAL),
        (
            a_request(transfer_id="", session_id="s", size_bytes=0, num_blocks=0),
            "ready",
            XferStatus.OK,
        ),
        (a_request(compat_hash="other"), None, XferStatus.NACK_INCOMPAT),
        (a_request(), None, XferStatus.NACK_MISSING),
        (a_request(size_bytes=24, num_blocks=3), "ready", XferStatus.NACK_MISSING),
        (a_request(), "allocated", XferStatus.NACK_NOT_READY),
        (a_request(), "ready", XferStatus.OK),
        (a_request(), "pinned", XferStatus.OK),
    ],
)
def test_R_E09_R_E10_checks_version_then_compat_then_presence_then_readiness(
    req: XferReq, state: str | None, status: XferStatus
) -> None:
    bus = grant_bus()
    assert answer(bus, req, state).status is status
    protocol_says = check_xfer_req(req, expected_hash=COMPAT)
    if protocol_says is not None:
        assert protocol_says is status, "the machine agrees with the protocol's own check"


def test_R_E09_no_registered_agent_is_nack_internal() -> None:
    bus = grant_bus()
    assert answer(bus, a_request(), "ready", agent=False).status is XferStatus.NACK_INTERNAL


def test_R_E11_grant_carries_agent_metadata_and_source_blocks_and_pins() -> None:
    bus = grant_bus()
    key = (b"peer", "t1")
    create_grant(bus, key)
    bus.dispatch(EC_PRODUCER_GRANT, key, check_of(a_request(), "ready"), 0.0)
    out = effects(bus)
    assert out[0] == Emit(EC_CACHE_ENTRY, "h", Pin())
    assert isinstance(out[1], SendXferAck)
    ack = out[1].ack
    assert ack.status is XferStatus.OK
    assert (ack.producer_agent_name, ack.producer_agent_metadata) == ("agent-p", b"md")
    assert (ack.block_indices, ack.region_base_addr, ack.lease_s) == ([3, 4], 4096, 30.0)
    assert bus.has_tag(EC_PRODUCER_GRANT, key, "leased")


def test_R_E12_pin_lease_releases_an_unclaimed_grant_after_30s() -> None:
    bus = grant_bus()
    answer(bus, a_request(), "ready")
    key = (b"peer", "t1")
    assert bus.deadline_of(EC_PRODUCER_GRANT, key) == 30.0
    bus.fire_due(30.0)
    assert bus.get(EC_PRODUCER_GRANT, key) is None
    assert effects(bus)[0] == Emit(EC_CACHE_ENTRY, "h", Unpin(consumed=False))


def test_R_E12_xfer_done_unpins_before_the_lease_and_marks_consumed() -> None:
    bus = grant_bus()
    answer(bus, a_request(), "ready")
    key = (b"peer", "t1")
    bus.dispatch(EC_PRODUCER_GRANT, key, PeerDisconnected(), 0.0)  # ignored: lease decides
    bus.dispatch(EC_PRODUCER_GRANT, key, XferDone(True), 0.0)
    assert effects(bus) == [Emit(EC_CACHE_ENTRY, "h", Unpin(consumed=True))]
    with pytest.raises(RemoteProtocolError, match="no live instance"):  # a duplicate done
        bus.dispatch(EC_PRODUCER_GRANT, key, XferDone(True), 0.0)


@pytest.mark.parametrize(("peer_grants", "total_grants"), [(256, 256), (0, 4096)])
def test_S_03_a_consumer_over_its_pin_caps_is_nacked(peer_grants: int, total_grants: int) -> None:
    bus = grant_bus()
    key = (b"peer", "t1")
    create_grant(bus, key)
    check = check_of(a_request(), "ready")
    over = dataclasses.replace(check, peer_grants=peer_grants, total_grants=total_grants)
    bus.dispatch(EC_PRODUCER_GRANT, key, over, 0.0)
    out = effects(bus)
    (reply,) = [e for e in out if isinstance(e, SendXferAck)]
    assert reply.ack.status is XferStatus.NACK_INTERNAL
    assert not any(isinstance(e, Emit) and e.event == Pin() for e in out), "nothing pinned"
    assert bus.metrics["ec.producer.over_cap"] == 1
