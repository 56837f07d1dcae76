"""Push-mode machines, one by one: model-based tests with full transition coverage."""

from __future__ import annotations

from hypothesis import strategies as st

from kvhandoff.machines.push.d_registration import D_REGISTRATION
from kvhandoff.machines.push.effects import ReplayPush, ReplayRegistration
from kvhandoff.machines.push.handshake import HANDSHAKE, Ensure
from kvhandoff.machines.push.p_lease import P_LEASE
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.push_wire import PushRegistration
from kvhandoff.testing import run_model_test

REG = PushRegistration(
    request_id="cmpl-1-0-aaaaaaaa",
    decode_engine_id="D",
    decode_host="127.0.0.1",
    decode_port=5600,
    decode_tp_size=1,
    decode_tp_rank=0,
    block_ids=(1, 2),
    remote_engine_id="P",
    remote_host="127.0.0.1",
    remote_port=5500,
    remote_tp_size=1,
)


def test_R_P02_R_P10_d_registration_model() -> None:
    run_model_test(
        D_REGISTRATION,
        context=st.fixed_dictionaries(
            {"registration": st.just(REG), "completions_needed": st.integers(1, 2)}
        ),
        max_examples=400,
    )


def test_R_P03_R_P11_p_lease_model() -> None:
    run_model_test(
        P_LEASE,
        context=st.fixed_dictionaries({"block_ids": st.just((1, 2))}),
        max_examples=200,
    )


OPS = st.sampled_from([ReplayRegistration("d-1", REG), ReplayPush("p-1", (3, 4), REG)])


def test_R_P05_handshake_model() -> None:
    def replayed_or_deferred(inst: Instance[object]) -> None:
        deferred = inst.ctx.deferred  # type: ignore[attr-defined]
        assert inst.has("deferring") or not deferred, "only a handshake in progress defers"

    run_model_test(
        HANDSHAKE,
        context=st.fixed_dictionaries({"host": st.just("127.0.0.1"), "port": st.just(5500)}),
        payloads={Ensure: OPS.map(Ensure)},
        invariants=[replayed_or_deferred],
        max_examples=200,
    )


def test_B09_pull_machines_model() -> None:
    from kvhandoff.machines.pull.d_read import D_READ
    from kvhandoff.machines.pull.p_lease import PULL_P_LEASE
    from kvhandoff.protocol.legs import PrefillCoordinates, PullSource

    source = PullSource(PrefillCoordinates("P", "127.0.0.1", 5500, 1), "p-1", (1, 2))
    run_model_test(
        D_READ,
        context=st.fixed_dictionaries({"source": st.just(source), "block_ids": st.just((3, 4))}),
        max_examples=200,
    )
    run_model_test(
        PULL_P_LEASE,
        context=st.fixed_dictionaries({"block_ids": st.just((1, 2))}),
        max_examples=100,
    )


def test_B09_pull_read_timeout_releases_the_read_before_failing() -> None:
    from kvhandoff.machines.pull.d_read import D_READ, DReadCtx
    from kvhandoff.machines.push.effects import ReleaseTransfer, ReportFailedRecving
    from kvhandoff.machines.push.events import Drained, Enqueued, Poll, ReadPosted
    from kvhandoff.machines.runtime.bus import EventBus
    from kvhandoff.protocol.legs import PrefillCoordinates, PullSource

    bus = EventBus()
    bus.register(D_READ, {"push_write_timeout": 5.0})
    source = PullSource(PrefillCoordinates("P", "127.0.0.1", 5500, 1), "p-1", (1, 2))
    bus.create(D_READ, DReadCtx("d-1", source, (3, 4)), 0.0)
    for event in (Drained(), Enqueued(), ReadPosted(), Poll()):  # the first poll starts it
        bus.dispatch(D_READ, "d-1", event, 0.0)
    bus.drain_outbox()
    assert bus.fire_due(5.0) == 1
    effects = [effect for _, effect in bus.drain_outbox()]
    assert effects[0] == ReleaseTransfer("d-1")
    assert any(isinstance(e, ReportFailedRecving) and e.block_ids == (3, 4) for e in effects)
