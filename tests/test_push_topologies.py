"""Every topology vLLM 0.33 supports, one by one over the simulated fabric with no faults
(R-T03, R-T04, R-T05), and the requests that must create no state at all (vLLM 0.33).

Each world runs requests through P and D of one topology; the world checks every WRITE
as it is posted and lands (only blocks D registered for that request, only blocks P
leases, P's bytes arriving), and at the end demands every request received and freed.
"""

from __future__ import annotations

import pytest
from push_harness import CONFIG, D_ENGINE, P_COORDS, P_ENGINE, Spy, finish, world

from kvhandoff.machines.push.d_request import D_REQUEST
from kvhandoff.machines.push.scheduler import PushScheduler
from kvhandoff.protocol.blocks import expand_to_physical
from kvhandoff.protocol.errors import RemoteProtocolError
from kvhandoff.protocol.legs import decode_leg
from kvhandoff.protocol.push_config import PushConfig
from kvhandoff.protocol.tp_mapping import write_targets
from kvhandoff.sim.push.settings import TOPOLOGIES, Topology


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
def test_R_T03_R_T04_every_topology_pushes_every_request(topology: Topology) -> None:
    w = world(topology)
    spy = Spy(w)
    clients = [w.issue(n) for n in (1, 2, 3, 4)]
    w.run_for(5.0)
    records = [w.ledger.clients[c] for c in clients]
    assert all(r.completed for r in records), [(r.client_id, r.p, r.d) for r in records]
    # One WRITE per (P rank, D rank it writes into) per request: every PP stage writes
    # its layers, every P TP rank its heads (R-T03, R-T04).
    per_request = sum(
        len(write_targets(topology.p_tp, tp_rank, topology.d_tp))
        for tp_rank in range(topology.p_tp)
    )
    assert len(spy.writes) == len(clients) * per_request * topology.p_pp
    finish(w)


@pytest.mark.parametrize("topology", [Topology(1, 1, 1), Topology(2, 1, 1), Topology(1, 2, 2)])
def test_R_T05_a_partial_prefix_hit_writes_only_the_blocks_d_lacks(topology: Topology) -> None:
    w = world(topology, prefix_hit=1.0)
    spy = Spy(w)
    client = w.issue(4)
    w.run_for(5.0)
    record = w.ledger.clients[client]
    assert record.completed and 0 < record.cached < 4, record
    lacking = 4 - record.cached
    registered = record.reg_sent_blocks
    assert registered == record.d_blocks[record.cached :], "D registers only what it lacks"
    ratio = w.settings.ratio
    assert spy.writes
    for transfer in spy.writes:  # each WRITE: P's tail into exactly D's registered blocks
        assert transfer.remote_ids == tuple(expand_to_physical(registered, ratio))
        assert len(transfer.local_ids) == lacking * ratio
    finish(w)


def _params() -> dict[str, object]:
    return dict(decode_leg({}, P_COORDS)["kv_transfer_params"])


def test_R_P02_requests_without_params_or_blocks_create_no_state_on_d() -> None:
    d = PushScheduler("decode", D_ENGINE, CONFIG)
    d.update_state_after_alloc("cmpl-a-0-1", [1, 2], None, 0.0)
    d.update_state_after_alloc("cmpl-b-0-1", [1, 2], {}, 0.0)
    d.update_state_after_alloc("cmpl-c-0-1", [], _params(), 0.0)  # a full prefix hit
    assert not d.has_pending_push_work()
    assert d.build_connector_meta(1.0).push_registrations == {}


def test_R_P02_S_04_decode_legs_are_checked_each_time_and_the_engine_memo_is_bounded() -> None:
    """P's engine coordinates are parsed once per distinct set of values; the request's
    own P id is checked on every leg, a bad leg is refused every time, and legs naming
    ever new engines never grow the memo past its bound."""
    d = PushScheduler("decode", D_ENGINE, CONFIG)
    good = _params()
    d.update_state_after_alloc("cmpl-m-0-1", [1], {**good, "remote_request_id": "p-1"}, 0.0)
    with pytest.raises(RemoteProtocolError, match="remote_request_id"):
        d.update_state_after_alloc("cmpl-m-1-1", [1], {**good, "remote_request_id": "a,b"}, 0.0)
    for _ in range(2):
        with pytest.raises(RemoteProtocolError):
            d.update_state_after_alloc("cmpl-m-2-1", [1], {**good, "remote_port": 0}, 0.0)
    for i in range(600):
        d.update_state_after_alloc(f"cmpl-n-{i}-1", [1], {**good, "remote_host": f"h{i}"}, 0.0)
    assert len(d._engines_seen) <= 256
    regs = d.build_connector_meta(1.0).push_registrations
    assert regs["cmpl-n-599-1"].remote_host == "h599" and regs["cmpl-m-0-1"].remote_host
    assert d.bus.get(D_REQUEST, "cmpl-m-0-1").ctx.heartbeat_id == "p-1"
    assert d.bus.get(D_REQUEST, "cmpl-n-0-1").ctx.heartbeat_id == "cmpl-n-0-1"


def test_R_P03_only_requests_that_finished_normally_and_hold_blocks_are_leased() -> None:
    p = PushScheduler("prefill", P_ENGINE, PushConfig())
    remote = {"do_remote_decode": True}
    assert p.request_finished("cmpl-a-0-1", [1, 2], None, 0.0) == (False, None)
    delay, params = p.request_finished("cmpl-b-0-1", [], remote, 0.0)
    # vLLM 0.33: nothing to lease, but D still gets the decode leg's params.
    assert delay is False and params is not None
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "cmpl-b-0-1"
    assert params["remote_block_ids"] == [[]]
    aborted = p.request_finished("cmpl-c-0-1", [1, 2], remote, 0.0, finished_normally=False)
    assert aborted == (False, None), "an aborted or errored request is freed at once"
    assert not p.has_pending_push_work()
    assert p.request_finished("cmpl-d-0-1", [1, 2], remote, 0.0)[0] is True
    assert p.has_pending_push_work()
