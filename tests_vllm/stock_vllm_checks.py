"""The checks the interop tests share: request ids as two engines' API servers make them,
one transfer of several requests P -> D verified byte for byte, and "nothing left" on an
engine (every block free, nothing leased, registered or in flight)."""

from __future__ import annotations

import itertools
import uuid

from stock_vllm_common import KVHANDOFF, Leg, pattern_bytes, run_until
from stock_vllm_kvh_engine import KVHANDOFF_DIRECT, KvhandoffEngine
from stock_vllm_push import VllmPushEngine

PROMPTS = (40, 70, 100, 33)  # 2, 3, 4 and 2 blocks of 32 tokens: partial last blocks
RECEIVE_BOUND_S = 30.0  # a push takes well under a second here; past this, it never will
TAGS = itertools.count(1)  # each request's KV pattern, unique in the session

Engine = VllmPushEngine | KvhandoffEngine


def request_ids(name: str, n: int) -> list[tuple[str, str, int]]:
    """(P request id, D request id, pattern tag) per request: the two legs share a base id
    and differ in vLLM's random 8-hex suffix, as the API servers of two engines make them."""
    run = uuid.uuid4().hex[:6]
    return [
        (
            f"cmpl-{name}-{run}-{i}-{uuid.uuid4().hex[:8]}",
            f"cmpl-{name}-{run}-{i}-{uuid.uuid4().hex[:8]}",
            next(TAGS),
        )
        for i in range(n)
    ]


def push_and_verify(p: Engine, d: Engine, name: str) -> list[Leg]:
    """Several requests P -> D through vLLM's request flow: P's finished prefill returns
    the decode leg's kv_transfer_params, which D gets verbatim (a proxy's job); D's blocks
    must hold exactly P's bytes; then both engines drain: every block free, nothing leased,
    registered or in flight on either side."""
    legs = request_ids(name, len(PROMPTS))
    errors_before = len(p.errors), len(d.errors)  # the engines are shared by the module
    p_legs = [p.add_prefill(p_id, tag, n) for (p_id, _, tag), n in zip(legs, PROMPTS, strict=True)]
    run_until([p], lambda: all(leg.finished for leg in p_legs), "P's prefills to finish")
    for leg in p_legs:
        assert leg.params is not None, f"P returned no decode-leg params for {leg.request_id}"
        assert leg.params.get("remote_engine_id") == p.engine_id, leg.params
        assert leg.params.get("remote_request_id") == leg.request_id, leg.params
        assert leg.params.get("remote_port") == p.port, leg.params
    assert not p.all_blocks_free(), "P holds the finished prefills' blocks (lease)"

    # D gets the legs in reverse order, so its block ids differ from P's.
    d_legs = []
    for (_, d_id, tag), n, p_leg in reversed(list(zip(legs, PROMPTS, p_legs, strict=True))):
        assert p_leg.params is not None
        d_legs.append(d.add_decode(d_id, tag, n, p_leg.params))
    d_legs.reverse()
    run_until(
        [p, d],
        lambda: all(leg.finished_recving for leg in d_legs),
        "D to receive every push",
        timeout_s=RECEIVE_BOUND_S,
    )
    errors = p.errors[errors_before[0] :], d.errors[errors_before[1] :]
    assert errors == ([], []), errors
    assert [leg.blocks for leg in d_legs] != [leg.blocks for leg in p_legs]
    for p_leg, d_leg in zip(p_legs, d_legs, strict=True):
        assert len(d_leg.blocks) == len(p_leg.blocks), (p_leg, d_leg)
        want = [pattern_bytes(p_leg.tag, k) for k in range(len(p_leg.blocks))]
        assert p.read(p_leg.blocks) == want, "P computed its pattern"
        assert d.read(d_leg.blocks) == want, f"D's blocks of {d_leg.request_id}"

    run_until(
        [p, d],
        lambda: (
            all(leg.finished_sending for leg in p_legs) and not p.has_work() and not d.has_work()
        ),
        "both engines to drain",
    )
    assert all(leg.finished_sending for leg in p_legs)
    assert all(leg.finished for leg in d_legs)
    for engine in (p, d):
        assert engine.all_blocks_free(), (engine.engine_id, engine.free_blocks())
        assert_drained(engine)
    return p_legs


def assert_drained(engine: Engine) -> None:
    state = engine.worker_state()
    if isinstance(engine, KvhandoffEngine):
        assert engine.connector_kind == KVHANDOFF_DIRECT
        assert set(state["live"].values()) == {0}, state
        assert state["failed_transfers"] == 0 and state["writer_alive"], state
        if engine.role == "decode":  # every notif from the stock P was understood
            assert state["rejected_notifs"] == 0, state
        bus = engine.scheduler.bus
        live = {name: len(bus.machine_named(name).index) for name in bus.kinds()}
        assert set(live.values()) <= {0}, live
    elif engine.connector_kind == KVHANDOFF:
        assert set(state["live"].values()) == {0}, state
        assert state["failed_transfers"] == 0, state
        sched = engine.scheduler.connector.scheduler
        live = {name: len(sched.bus.machine_named(name).index) for name in sched.bus.kinds()}
        assert set(live.values()) <= {0}, live
    else:
        assert state["writer_alive"], state
        assert state["recving"] == [] and state["sending"] == {}, state
        assert state["recving_transfers"] == [], state
        assert state["reqs_to_send"] == [] and state["reqs_to_process"] == [], state
