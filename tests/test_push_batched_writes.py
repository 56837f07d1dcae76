"""B-13, batched WRITEs, through the whole push path over the simulated fabric.

The requests P's writer matches in one pass leave as ONE transfer per D rank; D still
gets one completion notif per request, in the same form, after its bytes landed, and
completes each as before; a batch that fails fails every request in it as a failed
WRITE does (B-10). The real NIXL transport's batching (one `make_prepped_xfer` for the
batch, notifs with `send_notif` after it is DONE) is in
`test_push_transport_conformance.py`.
"""

from __future__ import annotations

from push_harness import Spy, finish, hold, release, world

from kvhandoff.protocol.notifs import encode_completion_notif
from kvhandoff.sim.push.world import SimulatedPushWorld

REQUESTS = 4


def _matched_in_one_pass(w: SimulatedPushWorld) -> list[str]:
    """D registers every request first; then P finishes them all in one step."""
    clients = [w.issue(2) for _ in range(REQUESTS)]
    held = [hold(w, "prefill") for _ in clients]
    w.run_for(2.0)  # handshake, PUSH_REGs held by P's writer
    for arrival in held:
        release(w, "prefill", arrival)
    return clients


def test_B_13_one_transfer_carries_every_write_matched_in_one_pass() -> None:
    w = world()
    spy = Spy(w)
    clients = _matched_in_one_pass(w)
    w.run_for(2.0)
    batcher = w.engine("prefill").transports[0].batcher
    assert (batcher.batches_posted, batcher.writes_batched) == (1, REQUESTS)
    assert len(spy.writes) == REQUESTS, "the world's contracts saw each request's WRITE"
    batches = {id(write.batch) for write in spy.writes}
    assert len(batches) == 1 and spy.writes[0].batch is not None
    assert spy.writes[0].batch.notif == b"", "the transfer itself carries no notif"
    # D unchanged: one completion notif per request, in the same form, every one received.
    completions = [m for _s, _d, m in spy.notifs if b":" in m and not m.startswith(b"PUSH")]
    for client in clients:
        record = w.ledger.clients[client]
        assert record.completed
        assert completions.count(encode_completion_notif(record.d_id or "", 1)) == 1
    finish(w)


def test_B_13_a_failed_batch_fails_every_request_in_it() -> None:
    w = world()
    clients = _matched_in_one_pass(w)
    w.network.fail_next_write_posts = 1  # the one batched post
    w.run_for(5.0)
    batcher = w.engine("prefill").transports[0].batcher
    assert batcher.batches_posted == 0
    for client in clients:
        record = w.ledger.clients[client]
        assert not record.completed
    assert not w.prefill.pool.owner, "B-10: P freed every request's blocks"
    assert [w.ledger.clients[c].d for c in clients] == ["failed"] * REQUESTS, "PUSH_FAIL"
    assert w.prefill.side.stats()["post"] == REQUESTS  # B-14: each counted as a post failure
    finish(w)
