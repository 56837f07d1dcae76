"""kvhandoff extensions are advertised in the handshake and used only with peers that
advertise them (C-04): a kvhandoff D hears `PUSH_FAIL` at once when P's WRITE fails to post
(B-10); a D whose handshake does not advertise it (a stock vLLM D advertises nothing) is
never sent one, and waits for its watchdog as vLLM 0.33 does.

Both over the in-memory fabric (`SimulatedPushWorld`): no sleeps, time moves when the test
moves it.
"""

from __future__ import annotations

from push_harness import world

from kvhandoff.protocol.handshake import EXT_PUSH_FAIL, decode_handshake, encode_handshake
from kvhandoff.protocol.notifs import WRITE_FAILED_PREFIX
from kvhandoff.sim.push.world import SimulatedPushWorld


def _record_decode_notifs(w: SimulatedPushWorld) -> list[bytes]:
    """Every notif a D rank drains, in order."""
    seen: list[bytes] = []
    for transport in w.decode.transports:
        drain = transport.get_new_notifs

        def recording(drain=drain) -> list[tuple[str, bytes]]:  # type: ignore[no-untyped-def]
            batch = drain()
            seen.extend(message for _, message in batch)
            return batch

        transport.get_new_notifs = recording  # type: ignore[method-assign]
    return seen


def test_C_04_kvhandoff_d_advertises_push_fail_and_hears_it() -> None:
    w = world()
    served = decode_handshake(encode_handshake(w.decode.transports[0].handshake_payload()))
    assert EXT_PUSH_FAIL in served.extensions
    seen = _record_decode_notifs(w)
    client = w.issue(2)
    w.network.fail_next_write_posts = 1
    w.run_for(0.5)  # far below any watchdog or lease
    assert any(m.startswith(WRITE_FAILED_PREFIX) for m in seen), "PUSH_FAIL reached D"
    assert w.ledger.clients[client].d == "failed", "D failed the receive at once"
    assert w.ledger.clients[client].p == "freed"


def test_C_04_no_push_fail_to_a_d_that_did_not_advertise_it() -> None:
    w = world()
    for transport in w.decode.transports:
        transport.advertise((), "")  # what a stock vLLM D's handshake says: nothing
    served = decode_handshake(encode_handshake(w.decode.transports[0].handshake_payload()))
    assert served.extensions == ()
    seen = _record_decode_notifs(w)
    client = w.issue(2)
    w.network.fail_next_write_posts = 1
    w.run_for(0.5)
    assert not any(m.startswith(WRITE_FAILED_PREFIX) for m in seen), "no PUSH_FAIL sent"
    assert w.ledger.clients[client].p == "freed", "P still frees its blocks (B-10)"
    assert w.ledger.clients[client].d != "failed", "D waits for its watchdog, as vLLM does"
    assert w.prefill.side.failed_transfers == 1
