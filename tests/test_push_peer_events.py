"""Events a peer provokes never crash the engine, and what crosses the scheduler/worker
boundary is plain data.

A completion notif and a `PUSH_FAIL` for the same request, in either order, duplicated,
or arriving after the request ended, once raised `LocalProtocolError` out of the decode
worker's `get_finished` and killed the decode process. Each is a peer event: one the
state does not declare is a `RemoteProtocolError` that the worker counts and logs per
peer (S-06) and that changes no state (S-01). A `PUSH_FAIL` counts like a completion
(B-10). The same holds a level up, through a whole `PushSide` over the simulated fabric.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import msgspec
import pytest
from push_harness import P_AGENT, P_COORDS, Halves, from_d, from_p, report

from kvhandoff.machines.kv.effects import ReportToMain
from kvhandoff.machines.kv.events import Matched, RegSent
from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.meta import (
    PullRead,
    PushConnectorMeta,
    PushConnectorOutput,
    PushWorkerOutput,
)
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.rank.worker import WriterItem
from kvhandoff.protocol.legs import PullSource, decode_leg
from kvhandoff.protocol.notifs import (
    CompletionNotif,
    HeartbeatNotif,
    WriteFailedNotif,
    encode_write_failed,
    parse_notif,
)
from kvhandoff.protocol.push_wire import PushRegistration
from kvhandoff.sim.push.settings import SimSettings, Topology
from kvhandoff.sim.push.world import SimulatedPushWorld

RID = "cmpl-13-0-dddddddd"
DONE = from_p(CompletionNotif(RID, 1))
FAIL = from_p(WriteFailedNotif(RID, "WRITE failed to post"))


class Decode:
    """D's scheduler and one rank, at t = 0, with one registration sent."""

    def __init__(self) -> None:
        self.halves = d = Halves("decode")
        params = decode_leg({}, P_COORDS)["kv_transfer_params"]
        d.sched.update_state_after_alloc(RID, [1, 2], params, 0.0)
        d.step(report(RID, RegSent()))
        d.step(report(RID, RegSent()))
        assert d.bus.has_tag(D_REGISTRATION, RID, "receiving")
        self.bus = d.bus
        self.worker = d.worker

    def deliver(self, *items: WriterItem) -> PushConnectorOutput:
        return self.halves.step(items)  # must not raise

    @property
    def rejected(self) -> int:
        return self.worker.rejected_notifs


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    yield
    logging.getLogger("kvhandoff").setLevel(logging.NOTSET)


def test_S_01_S_06_B10_push_fail_right_after_the_completion_is_rejected_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d = Decode()
    with caplog.at_level(logging.WARNING, logger="kvhandoff"):
        output = d.deliver(DONE, FAIL)
    assert output.finished_recving == {RID} and output.failed_recving == {}
    assert output.invalid_block_ids == set(), "the received blocks stay valid"
    assert d.rejected == 1
    assert d.worker.rejections.count(P_AGENT) == 1
    assert d.bus.get(D_REGISTRATION, RID) is None, "received and retired"
    assert d.bus.counters(D_REGISTRATION).errors == 0
    (warning,) = [r.getMessage() for r in caplog.records if "rejected notif" in r.getMessage()]
    assert P_AGENT in warning and "write_failed" in warning


def test_S_01_S_06_B10_completion_right_after_a_push_fail_is_rejected_not_raised() -> None:
    d = Decode()
    output = d.deliver(FAIL, DONE)
    assert output.finished_recving == set()
    assert output.failed_recving == {RID: "P rank 0: WRITE failed to post"}
    assert output.invalid_block_ids == {1, 2}
    assert d.rejected == 1, "the completion names a request that already failed"
    assert d.bus.live(D_REGISTRATION) == 0


def test_S_01_S_06_R_P09_duplicated_notifs_change_nothing() -> None:
    failed = Decode()
    output = failed.deliver(FAIL, FAIL)
    assert list(output.failed_recving) == [RID] and failed.rejected == 1
    received = Decode()
    output = received.deliver(DONE, DONE)
    assert output.finished_recving == {RID}
    assert received.rejected == 1, "the duplicate names a request already received"
    late = received.deliver(DONE, FAIL)  # both after the request ended
    assert late == PushConnectorOutput()
    assert received.rejected == 3
    assert received.bus.counters(D_REGISTRATION).errors == 0


def test_S_01_S_06_R_P04_a_match_the_lease_cannot_take_is_rejected() -> None:
    """`Matched` follows D's PUSH_REG: refused in a state that does not declare it (the
    lease was already bound by an earlier match), it is counted against the agent that
    sent it."""
    p = Halves("prefill")
    rid = "cmpl-14-0-0a0a0a0a"
    p.sched.request_finished(rid, [3], {"do_remote_decode": True}, 0.0)
    p.hand_over()
    p.finish(report(rid, Matched("decode-0")))
    matched = ReportToMain(rid, Matched("decode-0"), peer="decode-0-agent1")
    p.finish([matched])
    assert p.worker.rejections.count("decode-0-agent1") == 1
    assert p.bus.has_tag(P_LEASE, rid, "heartbeat_extends"), "nothing changed"


# -- through a whole side over the simulated fabric ----------------------------------------


def _world() -> SimulatedPushWorld:
    logging.getLogger("kvhandoff").setLevel(logging.CRITICAL)
    settings = SimSettings(leg_spread_s=0.0, prefix_hit=0.0, retry=0.0)
    return SimulatedPushWorld(5, settings=settings, topology=Topology(), keyed=False)


def _push_fail_beside_each_completion(w: SimulatedPushWorld, *, before: bool) -> None:
    """D's agent sees a `PUSH_FAIL` for the same request right after (or right before)
    every completion notif, in the same `get_new_notifs` batch."""
    transport = w.decode.transports[0]
    get_new_notifs = transport.get_new_notifs

    def with_push_fail() -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for peer, message in get_new_notifs():
            notif = parse_notif(message, peer=peer)
            if isinstance(notif, CompletionNotif):
                fail = (peer, encode_write_failed(notif.request_id, "forged failure"))
                out += [fail, (peer, message)] if before else [(peer, message), fail]
            else:
                out.append((peer, message))
        return out

    transport.get_new_notifs = with_push_fail  # type: ignore[method-assign]


@pytest.mark.parametrize("before", [False, True], ids=["fail-after", "fail-before"])
def test_S_01_S_06_B10_the_decode_side_survives_completion_and_push_fail_together(
    before: bool,
) -> None:
    w = _world()
    _push_fail_beside_each_completion(w, before=before)
    clients = [w.issue(2) for _ in range(3)]
    w.run_for(2.0)
    assert w.ledger.violations == [], "no engine step raised"
    outcomes = {w.ledger.clients[c].d for c in clients}
    assert outcomes == ({"failed"} if before else {"received"})
    assert w.decode.side.ranks[0].worker.rejected_notifs == 3, "one rejection per request"
    w.settle()
    result = w.final_check()
    assert result.ok, (result.violations, result.leftovers)


# -- the scheduler <-> worker boundary (R-T01) -----------------------------------------------


def test_R_T01_connector_meta_and_outputs_round_trip_through_msgpack() -> None:
    registration = PushRegistration(
        request_id=RID,
        decode_engine_id="decode-0",
        decode_host="10.0.0.2",
        decode_port=5700,
        decode_tp_size=2,
        decode_tp_rank=0,
        block_ids=(1, 2),
        remote_engine_id="prefill-0",
        remote_host="10.0.0.1",
        remote_port=5600,
        remote_tp_size=1,
        remote_pp_size=2,
    )
    source = PullSource(P_COORDS, "cmpl-13-1-0a0a0a0a", (4,))
    meta = PushConnectorMeta(
        step=7,
        push_registrations={RID: registration},
        push_finished_blocks={"cmpl-13-0-0a0a0a0a": (7, 8, 9)},
        pull_reads={"cmpl-13-1-dddddddd": PullRead(source, (5,))},
        ended=("cmpl-13-3-dddddddd",),
        heartbeats={"prefill-0": (RID,)},
    )
    worker_output = PushWorkerOutput(
        rank=1,
        step=7,
        finished_sending=("cmpl-13-0-0a0a0a0a",),
        finished_recving=(RID,),
        failed_recving={"cmpl-13-2-dddddddd": "P rank 0: WRITE failed to post"},
        ended=("cmpl-13-3-dddddddd",),
        posted=("cmpl-13-1-dddddddd",),
        failures={"post": 1, "rejected": 2},
    )
    output = PushConnectorOutput(
        finished_sending={"cmpl-13-0-0a0a0a0a"},
        finished_recving={RID},
        failed_recving={"cmpl-13-2-dddddddd": "P: WRITE failed to post"},
        invalid_block_ids={5, 6},
    )
    records: list[object] = [meta, worker_output, output, PushConnectorMeta()]
    records += [PushConnectorOutput(), PushWorkerOutput(rank=0, step=0)]
    for record in records:
        data = msgspec.msgpack.encode(record)
        assert msgspec.msgpack.decode(data, type=type(record)) == record
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(meta), type=PushConnectorMeta)
    assert decoded.pull_reads["cmpl-13-1-dddddddd"].source.prefill == P_COORDS
    assert decoded.push_finished_blocks["cmpl-13-0-0a0a0a0a"] == (7, 8, 9)


def test_S_06_a_heartbeat_of_many_unknown_ids_is_one_bounded_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A heartbeat naming 50,000 requests P does not hold is rejected with one warning
    line of bounded length (it once put every id into the line, ~1.2 MB)."""
    p = Halves("prefill")
    ids = tuple(f"cmpl-{i:08d}-0-{i:08x}" for i in range(50_000))
    with caplog.at_level(logging.WARNING, logger="kvhandoff"):
        p.step([from_d(HeartbeatNotif(ids))])
    assert p.worker.rejected_notifs == 1
    (line,) = [r.getMessage() for r in caplog.records if "heartbeat" in r.getMessage()]
    assert len(line) <= 512, len(line)
    assert "49997 more" in line and ids[0] in line
