"""kvhandoff's connector moving KV between two real vLLM 0.33 Schedulers over real NIXL
(C-05, R-T01, R-P15): P and D each a real Scheduler in this process, each worker-role
connector in its own process building its rank from `register_kv_caches` (DRAM tensors),
the handshake through vLLM's `get_handshake_metadata` / `set_xfer_handshake_metadata`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from connector_engines import (
    BLOCK,
    P_LEG,
    Engine,
    Run,
    all_free,
    d_leg,
    engines,
    prompt,
    pull_transfer,
    request,
    run,
    transfer,
)


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    """P and D at TP=1, shared by this module's tests: each ends with every block free."""
    yield from engines(tiny_model_dir, 1)


@pytest.fixture
def pair_tp2(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 2)


def test_C_05_bytes_move_between_two_vllm_schedulers_over_real_nixl(
    pair: tuple[Engine, Engine],
) -> None:
    """Several requests, one of them prefilled in chunks (longer than the step's token
    budget): P's vLLM leases each finished prefill leg, kvhandoff's P worker pushes its
    blocks into D's registered blocks over NIXL, D's vLLM runs each decode leg once every
    byte landed; both schedulers end with every block free."""
    lengths = {"cmpl-a-0": 3 * BLOCK + 5, "cmpl-b-0": 2 * BLOCK, "cmpl-c-0": 9 * BLOCK + 1}
    assert max(lengths.values()) > 256  # max_num_batched_tokens: a chunked prefill
    transfer(*pair, lengths)


def test_R_P10_abort_on_d_mid_transfer_frees_every_block_on_both_sides(
    pair: tuple[Engine, Engine],
) -> None:
    """vLLM aborts D's request while P is still prefilling it (chunked): kvhandoff's D
    ranks drop it, vLLM frees its blocks, P's lease ends on its own; both schedulers end
    with every block free and the other request's bytes intact."""
    from vllm.v1.request import RequestStatus

    prefill, decode = pair
    lengths = {"cmpl-abort-0": 12 * BLOCK, "cmpl-keep-0": 2 * BLOCK}
    d_requests = {}
    for i, (rid, length) in enumerate(lengths.items()):
        prefill.sched.add_request(request(rid, prompt(10 + i, length), P_LEG, 1))
        d_requests[rid] = request(rid, prompt(10 + i, length), d_leg(prefill), 2)
        decode.sched.add_request(d_requests[rid])
    prefill.step()  # P computes the first chunk only
    out, _kv_output = decode.step()
    seen = Run()
    seen.registered = {
        r: list(g.block_ids) for r, g in out.kv_connector_metadata.push.push_registrations.items()
    }
    assert d_requests["cmpl-abort-0"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    decode.sched.finish_requests("cmpl-abort-0", RequestStatus.FINISHED_ABORTED)
    seen = run(prefill, decode, unverified=frozenset({"cmpl-abort-0"}), seen=seen)
    assert seen.verified == {"cmpl-keep-0"}
    assert d_requests["cmpl-abort-0"].status == RequestStatus.FINISHED_ABORTED
    assert d_requests["cmpl-keep-0"].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not seen.failed
    assert decode.sched.connector.scheduler.stale_reports == 0
    all_free(prefill, decode)


def test_R_P12_failed_transfer_surfaces_as_invalid_blocks_and_finished_error(
    pair: tuple[Engine, Engine],
) -> None:
    """D's ranks cannot handshake with the P engine the decode leg names (its side
    channel serves another engine): each rank fails the receive, vLLM gets the request
    finished and failed with its blocks as load errors, and ends it FINISHED_ERROR; every
    block is free."""
    from vllm.v1.request import RequestStatus

    prefill, decode = pair
    rid = "cmpl-fail-0"
    req = request(rid, prompt(20, 3 * BLOCK), d_leg(prefill, engine_id="nobody"), 2)
    decode.sched.add_request(req)
    seen = run(prefill, decode)
    assert req.status == RequestStatus.FINISHED_ERROR
    assert seen.failed == {rid}
    assert seen.invalid == set(seen.registered[rid])
    all_free(prefill, decode)


def test_R_T03_tp2_workers_on_both_sides_move_every_rank_share(
    pair_tp2: tuple[Engine, Engine],
) -> None:
    """TP=2 on P and D, each worker its own process and NIXL agent: every D rank holds
    its head share of every block, written by its P peer rank."""
    lengths = {"cmpl-tp-a-0": 4 * BLOCK + 3, "cmpl-tp-b-0": 9 * BLOCK}
    transfer(*pair_tp2, lengths)


@pytest.fixture(scope="module")
def pull_pair(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 1, mode="pull")


def test_C_02_pull_mode_reads_between_two_vllm_schedulers_over_real_nixl(
    pull_pair: tuple[Engine, Engine],
) -> None:
    """`transfer_mode: pull` (B-09): P's vLLM finishes each prefill leg and returns, from
    kvhandoff's connector, vLLM-shaped pull params (its block ids, one list per group); the
    decode leg carries them to D, whose worker READs P's blocks over NIXL; P's lease ends
    with the READ's notif. Bytes verified on D, every block free on both schedulers."""
    lengths = {"cmpl-p-0": 2 * BLOCK + 3, "cmpl-q-0": 3 * BLOCK}
    pull_transfer(*pull_pair, lengths)
