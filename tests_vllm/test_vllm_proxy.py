"""The reference proxy's legs (`kvhandoff proxy`, R-P01) drive two real vLLM 0.33
Schedulers (C-05): the bodies it sends P and D, turned into vLLM requests as vLLM's OpenAI
server does (`kv_transfer_params` into the sampling params' extra args). Push: both arrive
at once, D registers while P prefills, P pushes over real NIXL, and D's decode leg runs on
the bytes P wrote. Pull: D's leg carries the `kv_transfer_params` of P's own engine output
(what vLLM's server answers P's leg with), and D reads P's blocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from connector_engines import BLOCK, Engine, Run, engines
from connector_engines import prompt as _prompt
from connector_engines import run as _run

from kvhandoff.protocol.legs import PrefillCoordinates
from kvhandoff.proxy import prefill_body, pull_decode_body, push_decode_body


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 1)


def _vllm_request(request_id: str, body: dict[str, Any]) -> Any:
    """What vLLM's OpenAI server makes of a completions body (token-id prompt)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    extra = {"kv_transfer_params": body["kv_transfer_params"]}
    sampling = SamplingParams(max_tokens=body["max_tokens"], extra_args=extra)
    return Request(request_id, list(body["prompt"]), sampling, None)


def test_R_P01_C_05_proxy_legs_push_kv_between_two_real_vllm_schedulers(
    pair: tuple[Engine, Engine],
) -> None:
    from vllm.v1.request import RequestStatus

    prefill, decode = pair
    coordinates = PrefillCoordinates(prefill.engine_id, "127.0.0.1", prefill.port, tp_size=1)
    lengths = {"cmpl-proxy-0": 3 * BLOCK + 1, "cmpl-proxy-1": BLOCK}
    d_requests = {}
    for i, (rid, length) in enumerate(lengths.items()):
        client = {"model": "m", "prompt": _prompt(i, length), "max_tokens": 3, "stream": True}
        p_leg, d_leg = prefill_body(client), push_decode_body(client, coordinates)
        assert p_leg["max_tokens"] == 1
        prefill.sched.add_request(_vllm_request(rid, p_leg))
        d_requests[rid] = _vllm_request(rid, d_leg)
        decode.sched.add_request(d_requests[rid])
    first_d, _ = decode.step()  # D registers before P has run a step
    assert set(first_d.kv_connector_metadata.push.push_registrations) == set(lengths)
    assert all(not r.is_finished() for r in prefill.sched.requests.values())
    run = Run()
    for rid, registration in first_d.kv_connector_metadata.push.push_registrations.items():
        run.registered[rid] = list(registration.block_ids)
    run = _run(prefill, decode, seen=run)
    assert run.verified == set(lengths)
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in d_requests.values())
    assert all(len(r.output_token_ids) == 3 for r in d_requests.values())


@pytest.fixture(scope="module")
def pull_pair(tiny_model_dir: Path) -> Iterator[tuple[Engine, Engine]]:
    yield from engines(tiny_model_dir, 1, mode="pull")


def test_R_P01_C_02_proxy_relays_ps_answer_to_d_in_pull_mode(
    pull_pair: tuple[Engine, Engine],
) -> None:
    from connector_engines import STEP_LIMIT
    from vllm.v1.request import RequestStatus

    import vllm_harness

    prefill, decode = pull_pair
    lengths = {"cmpl-pull-0": 2 * BLOCK + 5, "cmpl-pull-1": 4 * BLOCK}
    clients = {
        rid: {"model": "m", "prompt": _prompt(i, n), "max_tokens": 2}
        for i, (rid, n) in enumerate(lengths.items())
    }
    for rid, client in clients.items():
        prefill.sched.add_request(_vllm_request(rid, prefill_body(client)))
    answers: dict[str, dict[str, Any]] = {}
    outputs: list[Any] = []
    for _ in range(STEP_LIMIT):
        vllm_harness.engine_step(prefill.sched, prefill.workers, prefill.aggregator, None, outputs)
        for out in outputs:
            if out.finish_reason is not None:  # the answer to P's leg
                answers[out.request_id] = {"kv_transfer_params": out.kv_transfer_params}
        if set(answers) == set(lengths):
            break
    assert set(answers) == set(lengths), "P answered every prefill leg"
    d_requests = {}
    for rid, client in clients.items():
        d_leg = pull_decode_body(client, answers[rid])
        assert d_leg["kv_transfer_params"]["transfer_mode"] == "pull"
        d_requests[rid] = _vllm_request(rid, d_leg)
        decode.sched.add_request(d_requests[rid])
    run = _run(prefill, decode)
    assert run.verified == set(lengths) and not run.failed
    assert all(r.status == RequestStatus.FINISHED_LENGTH_CAPPED for r in d_requests.values())
