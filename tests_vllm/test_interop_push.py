"""Wire compatibility with a stock vLLM 0.33.0 engine, push and pull (issue 16: C-01,
C-02, C-04, S-01).

Stock vLLM engines (`stock_vllm_push.py`): vLLM's real v1 Scheduler with the scheduler-role
`NixlPushConnector` (push) or `NixlConnector` (pull) in the test process, the worker-role
connector in a process of its own over real NIXL (UCX) with DRAM tensors, the two joined
only by the pickled scheduler output and connector output (R-T01).

kvhandoff engines, two kinds:
- `KvhandoffEngine` (`stock_vllm_kvh_engine.py`): kvhandoff's own halves, `PushScheduler`
  and its side channel in the test process, one `PushRank` over NIXL in a process, with
  vLLM's compatibility factors; push and pull;
- `VllmPushEngine(connector=KVHANDOFF)`: vLLM's Scheduler and worker with kvhandoff's
  vLLM connector (`KVHandoffConnector`) in both roles.

Every transfer (`stock_vllm_checks.push_and_verify`): 4 requests of 2-4 blocks (partial
last blocks), P's blocks filled with a per-request, per-block, per-layer pattern, D's
request ids differing from P's only in vLLM's random suffix, D's block ids differing from
P's; D's blocks must hold exactly P's bytes, then both engines drain: every block free,
nothing leased, registered or in flight. The engines are module-scoped (tests use fresh
request ids); the two through kvhandoff's vLLM connector come last.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from stock_vllm_checks import (
    PROMPTS,
    RECEIVE_BOUND_S,
    Engine,
    assert_drained,
    push_and_verify,
    request_ids,
)
from stock_vllm_common import KVHANDOFF, STOCK_PULL, pattern_bytes, run_until
from stock_vllm_kvh_engine import KvhandoffEngine
from stock_vllm_push import StockVllmPushEngine, VllmPushEngine

pytestmark = pytest.mark.integration


def _module_engine(make: Callable[[Path], Engine]) -> Any:
    """A module-scoped engine: started once, shared by the tests, always closed."""

    @pytest.fixture(scope="module")
    def engine(tiny_model_dir: Path) -> Iterator[Engine]:
        made = make(tiny_model_dir)
        try:
            yield made
        finally:
            made.close()

    return engine


def _eid(name: str) -> str:
    return f"{name}-{uuid.uuid4().hex[:6]}"


stock_p = _module_engine(lambda d: StockVllmPushEngine(d, "prefill", _eid("vllm-p")))
stock_d = _module_engine(lambda d: StockVllmPushEngine(d, "decode", _eid("vllm-d")))
stock_pull_p = _module_engine(
    lambda d: VllmPushEngine(d, "prefill", _eid("vllm-pull-p"), connector=STOCK_PULL)
)
stock_pull_d = _module_engine(
    lambda d: VllmPushEngine(d, "decode", _eid("vllm-pull-d"), connector=STOCK_PULL)
)
kvh_p = _module_engine(lambda d: VllmPushEngine(d, "prefill", _eid("kvh-p"), connector=KVHANDOFF))
kvh_d = _module_engine(lambda d: VllmPushEngine(d, "decode", _eid("kvh-d"), connector=KVHANDOFF))
direct_p = _module_engine(lambda d: KvhandoffEngine(d, "prefill", _eid("kvhd-p")))
direct_d = _module_engine(lambda d: KvhandoffEngine(d, "decode", _eid("kvhd-d")))
direct_pull_p = _module_engine(
    lambda d: KvhandoffEngine(d, "prefill", _eid("kvhd-pull-p"), mode="pull")
)
direct_pull_d = _module_engine(
    lambda d: KvhandoffEngine(d, "decode", _eid("kvhd-pull-d"), mode="pull")
)
# a kvhandoff P whose every WRITE fails to post (kvhandoff's seeded fault injection)
faulty_p = _module_engine(
    lambda d: KvhandoffEngine(d, "prefill", _eid("kvhd-faulty-p"), faults="write_fail=1")
)


@pytest.fixture
def spare_stock_d(tiny_model_dir: Path) -> Iterator[StockVllmPushEngine]:
    """A stock D of one test's own: it ends holding requests that wait for KV forever."""
    engine = StockVllmPushEngine(tiny_model_dir, "decode", _eid("vllm-d2"))
    try:
        yield engine
    finally:
        engine.close()


def test_C_01_stock_vllm_push_to_stock_vllm_baseline(
    stock_p: StockVllmPushEngine, stock_d: StockVllmPushEngine
) -> None:
    """The harness itself: an unmodified vLLM P pushes to an unmodified vLLM D (4 requests,
    bytes verified, both ends drain to every block free)."""
    for leg in push_and_verify(stock_p, stock_d, "base"):
        assert leg.params is not None and leg.params["transfer_mode"] == "push"


def test_S_01_hostile_handshake_requests_do_not_stop_the_kvhandoff_listener(
    direct_d: KvhandoffEngine,
) -> None:
    """A kvhandoff engine's side channel (its scheduler's listener; the next test's stock
    vLLM P handshakes with the same one) gets a malformed request, wrong frame counts,
    another dialect, an unknown rank and an oversized one; each is dropped and counted,
    and the next valid request, vLLM 0.33's own `(b"get_meta_msg", pp_rank, tp_rank)`, is
    answered as a stock vLLM peer reads it."""
    import msgspec
    import zmq
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
        NixlAgentMetadata,
        NixlHandshakePayload,
    )

    endpoint = f"tcp://{direct_d.host}:{direct_d.port}"
    encode = msgspec.msgpack.encode
    hostile: list[tuple[int, list[bytes]]] = [
        (zmq.DEALER, [b"GET_META"]),  # kvhandoff's old dialect: no envelope, one frame
        (zmq.REQ, [b"\xc1\xff not msgpack"]),
        (zmq.REQ, [encode((b"get_meta_msg",))]),  # wrong arity
        (zmq.REQ, [encode({"type": "req", "mm_hash": "x"})]),  # the EC P2P dialect
        (zmq.REQ, [encode((b"get_meta_msg", 0, 99))]),  # a rank the engine does not have
        (zmq.REQ, [encode((b"get_meta_msg", "0", None))]),
        (zmq.REQ, [encode((b"other", 0, 0))]),
        (zmq.DEALER, [b"", b"a", b"b", b"c"]),  # wrong frame count
        (zmq.DEALER, [b"x" * (1 << 20)]),  # oversized: ZMQ itself drops this peer
    ]
    counted = len(hostile) - 1  # every one but the oversized reaches the server's code
    server = direct_d.side_channel
    dropped_before = server.requests_dropped
    for kind, frames in hostile:
        ctx = zmq.Context()
        sock = ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 10_000)
        sock.connect(endpoint)
        sock.send_multipart(frames)
        sock.close()
        ctx.term()  # returns once the request left (or 10 s passed)

    def ask() -> list[bytes]:
        """vLLM's own handshake request for rank (0, 0), on a REQ socket, as its worker
        sends it; the reply (bounded wait, no retry)."""
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            sock.send(encode((b"get_meta_msg", 0, 0)))
            assert sock.poll(60_000, zmq.POLLIN), "the listener no longer answers"
            reply = sock.recv_multipart()
            sock.close(linger=0)
            return reply
        finally:
            ctx.term()

    # The server reads its connections in turn, so the last hostile requests may be read
    # just after a valid one: ask until all were counted (each ask is a served round
    # trip; bounded).
    deadline = time.monotonic() + 60
    while True:
        reply = ask()
        assert len(reply) == 2, f"vLLM's client asserts a 2-frame reply, got {len(reply)}"
        payload = msgspec.msgpack.decode(reply[0], type=NixlHandshakePayload)
        agent = msgspec.msgpack.decode(payload.agent_metadata_bytes, type=NixlAgentMetadata)
        assert agent.engine_id == direct_d.engine_id
        assert isinstance(msgspec.msgpack.decode(reply[1]), float)
        assert server.running
        if server.requests_dropped - dropped_before >= counted:
            break
        assert time.monotonic() < deadline, (server.requests_dropped, dropped_before, counted)


def test_C_01_stock_vllm_push_to_kvhandoff_engine(
    stock_p: StockVllmPushEngine, direct_d: KvhandoffEngine
) -> None:
    """An unmodified vLLM 0.33 P -> kvhandoff's own push halves as D."""
    push_and_verify(stock_p, direct_d, "s2dk")


def test_C_01_kvhandoff_engine_push_to_stock_vllm(
    direct_p: KvhandoffEngine, stock_d: StockVllmPushEngine
) -> None:
    """kvhandoff's own push halves (PushScheduler, PushRank over NIXL, vLLM's compatibility
    factors) as P -> an unmodified vLLM 0.33 D."""
    push_and_verify(direct_p, stock_d, "dk2s")


def test_C_01_partial_prefix_hit_on_a_stock_d_kvhandoff_p_writes_the_tail(
    direct_p: KvhandoffEngine, stock_d: StockVllmPushEngine
) -> None:
    """A stock D that already holds a prompt's first blocks (its prefix cache) registers
    only the blocks it lacks; kvhandoff P writes only its matching tail into them, and the
    cached blocks stay as they were."""
    n = PROMPTS[2]  # 100 tokens: 3 full blocks, then a partial one
    [(p1, d1, first), (p2, d2, second)] = request_ids("prefix", 2)
    leg = direct_p.add_prefill(p1, first, n)
    assert leg.params is not None
    d_first = stock_d.add_decode(d1, first, n, leg.params)
    run_until(
        [direct_p, stock_d],
        lambda: d_first.finished and not direct_p.has_work(),
        "the first request to complete",
        timeout_s=RECEIVE_BOUND_S,
    )
    cached = list(d_first.blocks)
    assert len(cached) == 4

    p_leg = direct_p.add_prefill(p2, second, n)  # P computes the whole prompt again
    assert p_leg.params is not None
    d_leg = stock_d.add_decode(d2, second, n, p_leg.params, prompt_tag=first)
    run_until(
        [direct_p, stock_d],
        lambda: d_leg.finished_recving and p_leg.finished_sending,
        "the tail push",
        timeout_s=RECEIVE_BOUND_S,
    )
    assert stock_d.errors == [] and direct_p.errors == []
    assert len(d_leg.blocks) == 1, d_leg.blocks  # D registered only the uncached block
    assert stock_d.read(d_leg.blocks) == [pattern_bytes(second, 3)]
    assert stock_d.read(cached[:3]) == [pattern_bytes(first, k) for k in range(3)]
    run_until(
        [direct_p, stock_d],
        lambda: d_leg.finished and not direct_p.has_work() and not stock_d.has_work(),
        "both engines to drain",
    )
    assert direct_p.all_blocks_free() and stock_d.all_blocks_free()
    assert_drained(direct_p)
    assert_drained(stock_d)


def test_C_02_stock_vllm_pull_to_stock_vllm_baseline(
    stock_pull_p: VllmPushEngine, stock_pull_d: VllmPushEngine
) -> None:
    """The pull harness: an unmodified vLLM D READs from an unmodified vLLM P (vLLM's
    `NixlConnector`), 4 requests, bytes verified, both ends drain to every block free."""
    for leg in push_and_verify(stock_pull_p, stock_pull_d, "pull"):
        assert leg.params is not None and leg.params["transfer_mode"] == "pull"


def test_C_02_kvhandoff_engine_pull_from_stock_vllm(
    stock_pull_p: VllmPushEngine, direct_pull_d: KvhandoffEngine
) -> None:
    """kvhandoff's pull halves as D READ from an unmodified vLLM 0.33 pull P."""
    push_and_verify(stock_pull_p, direct_pull_d, "pull-s2k")


def test_C_02_stock_vllm_pull_from_kvhandoff_engine(
    direct_pull_p: KvhandoffEngine, stock_pull_d: VllmPushEngine
) -> None:
    """An unmodified vLLM 0.33 pull D READs from kvhandoff's pull halves as P."""
    push_and_verify(direct_pull_p, stock_pull_d, "pull-k2s")


def test_C_04_push_fail_goes_only_to_a_peer_that_advertises_it(
    faulty_p: KvhandoffEngine,
    spare_stock_d: StockVllmPushEngine,
    direct_d: KvhandoffEngine,
    stock_p: StockVllmPushEngine,
) -> None:
    """A kvhandoff P whose WRITEs fail frees its blocks at once either way, and tells a
    kvhandoff D (`PUSH_FAIL`, advertised in its handshake), which fails the requests at
    once; a stock vLLM D, which advertises nothing, gets no `PUSH_FAIL` (it would crash its
    engine step decoding one) and keeps serving: its next transfer from a stock P works."""
    c04 = request_ids("c04", 2)
    p_legs = [faulty_p.add_prefill(p_id, tag, 40 + 30 * i) for i, (p_id, _, tag) in enumerate(c04)]
    stock_legs = [
        spare_stock_d.add_decode(d_id, tag, 40 + 30 * i, leg.params or {})
        for i, ((_, d_id, tag), leg) in enumerate(zip(c04, p_legs, strict=True))
    ]
    run_until(
        [faulty_p, spare_stock_d],
        lambda: all(leg.finished_sending for leg in p_legs),
        "kvhandoff P to free the blocks of its failed WRITEs",
        timeout_s=RECEIVE_BOUND_S,
    )
    assert faulty_p.worker_state()["failed_transfers"] == len(p_legs)
    assert faulty_p.all_blocks_free() and not faulty_p.has_work()
    assert not any(leg.finished_recving for leg in stock_legs), "nothing arrived"
    assert spare_stock_d.errors == [], spare_stock_d.errors

    # The stock D keeps stepping (a PUSH_FAIL would raise in its worker's step) and serves
    # a normal push from a stock P.
    [(p_id, d_id, tag)] = request_ids("c04-next", 1)
    p_leg = stock_p.add_prefill(p_id, tag, PROMPTS[1])
    run_until([stock_p], lambda: p_leg.finished, "the stock P's prefill")
    assert p_leg.params is not None
    d_leg = spare_stock_d.add_decode(d_id, tag, PROMPTS[1], p_leg.params)
    run_until(
        [stock_p, spare_stock_d],
        lambda: d_leg.finished_recving and p_leg.finished_sending,
        "the stock D's next transfer",
        timeout_s=RECEIVE_BOUND_S,
    )
    want = [pattern_bytes(tag, k) for k in range(len(p_leg.blocks))]
    assert spare_stock_d.read(d_leg.blocks) == want
    assert spare_stock_d.errors == [], spare_stock_d.errors
    assert spare_stock_d.worker_state()["writer_alive"]
    assert not any(leg.finished_recving for leg in stock_legs), "still waiting, not failed"

    # The same failure towards a kvhandoff D: PUSH_FAIL, and D fails both requests at once
    # instead of waiting for its registration watchdog.
    c04 = request_ids("c04-kvh", 2)
    p_legs = [faulty_p.add_prefill(p_id, tag, 40 + 30 * i) for i, (p_id, _, tag) in enumerate(c04)]
    failed_before = len(direct_d.errors)
    kvh_legs = [
        direct_d.add_decode(d_id, tag, 40 + 30 * i, leg.params or {})
        for i, ((_, d_id, tag), leg) in enumerate(zip(c04, p_legs, strict=True))
    ]
    run_until(
        [faulty_p, direct_d],
        lambda: all(leg.finished_recving for leg in kvh_legs),
        "kvhandoff D to hear of the failed WRITEs",
        timeout_s=RECEIVE_BOUND_S,
    )
    assert len(direct_d.errors) > failed_before, "D reported the requests as failed"
    run_until([faulty_p, direct_d], lambda: not direct_d.has_work(), "kvhandoff D to drain")
    assert direct_d.all_blocks_free()


def test_C_01_kvhandoff_push_to_stock_vllm(
    kvh_p: VllmPushEngine, stock_d: StockVllmPushEngine
) -> None:
    """kvhandoff P (its vLLM connector, both roles) -> an unmodified vLLM 0.33 D."""
    push_and_verify(kvh_p, stock_d, "k2s")


def test_C_01_stock_vllm_push_to_kvhandoff(
    stock_p: StockVllmPushEngine, kvh_d: VllmPushEngine
) -> None:
    """An unmodified vLLM 0.33 P -> kvhandoff D (its vLLM connector, both roles)."""
    push_and_verify(stock_p, kvh_d, "s2k")
