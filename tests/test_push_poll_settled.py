"""R-P09, B-10: get_finished polls a posted WRITE once, then only when the rank's
transport says its transfer may have ended (the `polled` tag); the write timeout still
runs on the bus's timers, whatever the transport says."""

from __future__ import annotations

from push_harness import CONFIG, D_ENGINE, Halves, report

from kvhandoff.machines.kv.effects import PollTransfer, ReleaseTransfer
from kvhandoff.machines.kv.events import Matched, WritePosted
from kvhandoff.machines.push.p_lease import P_LEASE


def _posted(rid: str) -> Halves:
    p = Halves("prefill")
    p.sched.request_finished(rid, [1], {"do_remote_decode": True}, p.now)
    p.hand_over()
    p.worker.take_writer_items(report(rid, Matched(D_ENGINE.engine_id), WritePosted()), p.now)
    p.effects()
    return p


def _polls(p: Halves) -> list[str]:
    return [e.request_id for e in p.effects() if isinstance(e, PollTransfer)]


def test_R_P09_the_first_poll_always_goes_out_then_only_when_settled() -> None:
    rid = "cmpl-poll-1-0a0a0a0a"
    p = _posted(rid)
    asked: list[str] = []

    def in_flight(request_id: str) -> bool:
        asked.append(request_id)
        return False

    p.worker.get_finished(p.now, in_flight)
    assert _polls(p) == [rid], "posted: polled whatever the transport says"
    assert asked == [] and p.state(P_LEASE, rid) == "writing"
    p.worker.get_finished(p.now, in_flight)
    assert _polls(p) == [] and asked == [rid], "still in flight: no poll"
    p.worker.get_finished(p.now, lambda _rid: True)
    assert _polls(p) == [rid], "settled: polled"
    p.worker.get_finished(p.now)
    assert _polls(p) == [rid], "no transport view: polled every step, as before"


def test_B_10_the_write_timeout_fires_while_the_transport_says_in_flight() -> None:
    rid = "cmpl-poll-2-0a0a0a0a"
    p = _posted(rid)
    p.worker.get_finished(p.now, lambda _rid: False)
    p.effects()
    p.clock.advance(CONFIG.push_write_timeout + 1)
    p.worker.get_finished(p.now, lambda _rid: False)
    effects = p.effects()
    assert ReleaseTransfer(rid) in effects
    assert not any(isinstance(e, PollTransfer) for e in effects)
    assert p.state(P_LEASE, rid) is None or p.state(P_LEASE, rid) != "writing"
