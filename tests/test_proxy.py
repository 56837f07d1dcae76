"""`kvhandoff proxy` (R-P01): the legs it builds are the protocol's (`protocol/legs.py`), and
over HTTP it sends them as vLLM's routers do: both at once in push mode (D's leg reaches D
before P answers), P first in pull mode with P's returned params on D's leg; both legs
carry one X-Request-Id; the client gets D's answer, streamed through."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from kvhandoff.cli import build_parser
from kvhandoff.protocol.legs import (
    PrefillCoordinates,
    decode_leg,
    prefill_coordinates,
    prefill_leg,
    pull_params,
    pull_source,
)
from kvhandoff.proxy import (
    Proxy,
    Upstream,
    encode_body,
    prefill_body,
    pull_decode_body,
    push_decode_body,
    serve_in_thread,
)

P = PrefillCoordinates("prefill-engine-0", "10.0.0.7", 5600, tp_size=2)
CLIENT = {
    "model": "m",
    "prompt": "hello",
    "max_tokens": 64,
    "stream": True,
    "stream_options": {"include_usage": True},
}


def test_R_P01_prefill_leg_is_the_protocols_with_one_token_and_no_stream() -> None:
    leg = prefill_body(CLIENT)
    expected = prefill_leg(dict(CLIENT))
    assert leg["kv_transfer_params"] == expected["kv_transfer_params"]
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["max_tokens"] == 1 and leg["stream"] is False and "stream_options" not in leg
    chat = prefill_body({"messages": [], "max_completion_tokens": 50})
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1
    assert CLIENT["max_tokens"] == 64  # the client's request is not changed


def test_R_P01_push_decode_leg_carries_ps_coordinates_the_decoder_parses_back() -> None:
    leg = push_decode_body(CLIENT, P)
    assert leg == decode_leg(dict(CLIENT), P)
    assert leg["max_tokens"] == 64 and leg["stream"] is True
    assert prefill_coordinates(leg["kv_transfer_params"]) == P


def test_R_P01_pull_decode_leg_carries_what_p_returned() -> None:
    returned = pull_params(P, "cmpl-x-0-1a2b3c4d", [4, 5, 6])
    leg = pull_decode_body(CLIENT, {"kv_transfer_params": returned})
    assert leg["kv_transfer_params"] == returned
    source = pull_source(leg["kv_transfer_params"])
    assert source.block_ids == (4, 5, 6) and source.request_id == "cmpl-x-0-1a2b3c4d"
    assert source.prefill.engine_id == P.engine_id and source.prefill.tp_size == P.tp_size
    with pytest.raises(ValueError, match="kv_transfer_params"):
        pull_decode_body(CLIENT, {"choices": []})


class Fake:
    """An engine's OpenAI server: records each request, answers with `answer(body)`."""

    def __init__(self, answer: Callable[[dict[str, Any]], bytes]) -> None:
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        self.arrived = threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.path, self.headers["X-Request-Id"], body))
                fake.arrived.set()
                data = answer(body)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read()


@pytest.fixture
def fakes() -> Iterator[dict[str, Any]]:
    made: dict[str, Any] = {}
    yield made
    for item in made.values():
        if isinstance(item, ThreadingHTTPServer):
            item.shutdown()
            item.server_close()
        else:
            item.close()


def test_R_P01_push_mode_sends_the_decode_leg_while_p_prefills(fakes: dict[str, Any]) -> None:
    """P's fake answers only once D's leg has arrived (or after 30 s, which fails the
    test): a proxy that waited for P before sending D's leg could not pass."""
    seen_by_p: list[bool] = []

    def decode_answer(body: dict[str, Any]) -> bytes:
        return b'data: {"text": "hi"}\n\ndata: [DONE]\n\n'

    fakes["d"] = decode = Fake(decode_answer)

    def prefill_answer(body: dict[str, Any]) -> bytes:
        seen_by_p.append(decode.arrived.wait(30.0))
        return json.dumps({"choices": [{"text": "h"}]}).encode()

    fakes["p"] = prefill = Fake(prefill_answer)
    proxy = Proxy(Upstream.parse(prefill.url), Upstream.parse(decode.url), coordinates=P)
    fakes["proxy"] = server = serve_in_thread(proxy)
    fakes["routes"] = proxy

    status, data = _post(server.server_port, "/v1/completions", CLIENT)
    assert status == 200
    assert data == b'data: {"text": "hi"}\n\ndata: [DONE]\n\n'  # D's answer, as it streamed
    assert seen_by_p == [True]
    [(p_path, p_id, p_body)] = prefill.requests
    [(d_path, d_id, d_body)] = decode.requests
    assert p_path == d_path == "/v1/completions"
    assert p_id == d_id and len(p_id) == 32
    assert p_body == prefill_body(CLIENT)
    assert d_body == push_decode_body(CLIENT, P)


def test_R_P01_pull_mode_sends_p_first_and_relays_its_params(fakes: dict[str, Any]) -> None:
    returned = pull_params(P, "cmpl-p-side-id", [7, 8])

    def prefill_answer(body: dict[str, Any]) -> bytes:
        return json.dumps({"choices": [], "kv_transfer_params": returned}).encode()

    fakes["p"] = prefill = Fake(prefill_answer)
    d_saw_p_done: list[bool] = []

    def decode_answer(body: dict[str, Any]) -> bytes:
        d_saw_p_done.append(len(prefill.requests) == 1)
        return json.dumps({"choices": [{"text": "decoded"}]}).encode()

    fakes["d"] = decode = Fake(decode_answer)
    proxy = Proxy(Upstream.parse(prefill.url), Upstream.parse(decode.url), mode="pull")
    fakes["proxy"] = server = serve_in_thread(proxy)
    fakes["routes"] = proxy

    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}
    status, data = _post(server.server_port, "/v1/chat/completions", chat)
    assert status == 200 and json.loads(data) == {"choices": [{"text": "decoded"}]}
    assert d_saw_p_done == [True]
    [(_, d_id, d_body)] = decode.requests
    assert d_id == prefill.requests[0][1]
    assert d_body == {**chat, "kv_transfer_params": returned}


def test_R_P01_failed_prefill_fails_the_request_and_unknown_routes_are_refused(
    fakes: dict[str, Any],
) -> None:
    fakes["d"] = decode = Fake(lambda body: b"{}")
    proxy = Proxy(Upstream("127.0.0.1", 1), Upstream.parse(decode.url), mode="pull")
    fakes["proxy"] = server = serve_in_thread(proxy)
    fakes["routes"] = proxy
    status, data = _post(server.server_port, "/v1/completions", CLIENT)
    assert status == 502 and decode.requests == []
    assert json.loads(data)["error"]["code"] == 502
    status, _ = _post(server.server_port, "/v1/embeddings", CLIENT)
    assert status == 404


def test_R_P01_cli_parses_the_proxy_command() -> None:
    args = build_parser().parse_args(
        [
            "proxy",
            "--prefill",
            "http://127.0.0.1:8100",
            "--decode",
            "http://127.0.0.1:8200",
            "--prefill-engine-id",
            "prefill-0",
            "--prefill-side-channel",
            "127.0.0.1:5600",
            "--listen",
            "0.0.0.0:9000",
        ]
    )
    assert args.mode == "push" and args.listen == ("0.0.0.0", 9000)
    assert args.prefill_side_channel == ("127.0.0.1", 5600)
    with pytest.raises(ValueError, match="HOST:PORT"):
        Upstream.parse("https://example.com")


def test_R_P01_encoder_leg_goes_first_and_its_ec_params_ride_on_the_prefill_leg(
    fakes: dict[str, Any],
) -> None:
    """With an encoder engine the proxy sends it a one-token leg first, then puts the
    `ec_transfer_params` it answered with on P's leg (not on D's)."""
    published = {"img-1": {"metadata": {"num_embeds": [4]}, "peer_host": "10.0.0.9"}}
    fakes["e"] = encoder = Fake(
        lambda body: json.dumps({"choices": [], "ec_transfer_params": published}).encode()
    )
    fakes["p"] = prefill = Fake(lambda body: json.dumps({"choices": []}).encode())
    fakes["d"] = decode = Fake(lambda body: json.dumps({"choices": [{"text": "d"}]}).encode())
    proxy = Proxy(
        Upstream.parse(prefill.url),
        Upstream.parse(decode.url),
        coordinates=P,
        encoder=Upstream.parse(encoder.url),
    )
    fakes["proxy"] = server = serve_in_thread(proxy)
    fakes["routes"] = proxy
    status, _ = _post(server.server_port, "/v1/chat/completions", CLIENT)
    assert status == 200
    [(_, e_id, e_body)] = encoder.requests
    [(_, p_id, p_body)] = prefill.requests
    [(_, d_id, d_body)] = decode.requests
    assert e_id == p_id == d_id
    assert e_body == encode_body(CLIENT) and e_body["max_tokens"] == 1
    assert "kv_transfer_params" not in e_body
    assert p_body == {**prefill_body(CLIENT), "ec_transfer_params": published}
    assert "ec_transfer_params" not in d_body
