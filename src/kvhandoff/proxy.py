"""`kvhandoff proxy`: a tiny reference disaggregating proxy for vLLM's OpenAI server (R-P01).

One prefill engine P and one decode engine D behind one address. For each client request
to `/v1/completions` or `/v1/chat/completions` the proxy picks one request id (sent to both
as `X-Request-Id`) and builds the two legs with `protocol/legs.py`:

- the prefill leg to P: `max_tokens=1` (and `max_completion_tokens=1` when the client set
  it), `kv_transfer_params={"do_remote_decode": True, ...}`, never streamed;
- the decode leg to D: the client's request with `do_remote_prefill=True` and P's
  coordinates.

Push mode (the default) sends both legs at once, as routers do: D registers its blocks
while P prefills, and P pushes the KV the moment it finishes. P's coordinates (engine id,
side-channel host and port, TP size) are configured, since D needs them before P answers.
Pull mode sends the prefill leg first and puts the `kv_transfer_params` P returns on the
decode leg. With an encoder engine (`--encoder`, the encoder cache's producer) the request
goes there first, as an encode-only leg (`max_tokens=1`), and the `ec_transfer_params` it
answers with ride on the prefill leg, whose engine then reads the encodings from the
producer's CPU tier instead of encoding. The client gets D's answer (streamed through when
it asked to stream); a prefill or encoder leg that fails fails the request with 502.

Standard library only (`http.server`, `http.client`, threads): a reference for what the
legs carry and in which order they go, not a production router.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal
from urllib.parse import urlsplit

from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg, prefill_leg

log = logging.getLogger("kvhandoff.proxy")

Mode = Literal["push", "pull"]
ROUTES = ("/v1/completions", "/v1/chat/completions")


@dataclass(frozen=True, slots=True)
class Upstream:
    """An engine's OpenAI server: `http://host:port`."""

    host: str
    port: int

    @classmethod
    def parse(cls, url: str) -> Upstream:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"an engine URL is http://HOST:PORT, got {url!r}")
        return cls(parts.hostname, parts.port)


def prefill_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill leg's JSON body: `prefill_leg`, never streamed."""
    leg = prefill_leg(dict(request))
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    leg.pop("stream_options", None)
    return leg


def push_decode_body(request: Mapping[str, Any], prefill: PrefillCoordinates) -> dict[str, Any]:
    """Push mode's decode leg: `decode_leg` with P's configured coordinates."""
    return decode_leg(dict(request), prefill)


def pull_decode_body(
    request: Mapping[str, Any], prefill_response: Mapping[str, Any]
) -> dict[str, Any]:
    """Pull mode's decode leg: the client's request with the `kv_transfer_params` P's
    answer carried (its coordinates, request id and blocks)."""
    params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, Mapping) or params.get("do_remote_prefill") is not True:
        raise ValueError("the prefill leg's answer carries no kv_transfer_params to decode with")
    leg = dict(request)
    leg["kv_transfer_params"] = dict(params)
    return leg


def encode_body(request: Mapping[str, Any]) -> dict[str, Any]:
    """The encoder leg: the client's request, one token, never streamed, no KV params."""
    leg = {k: v for k, v in request.items() if k not in ("stream_options", "kv_transfer_params")}
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["stream"] = False
    return leg


def with_encodings(leg: Mapping[str, Any], encoder_response: Mapping[str, Any]) -> dict[str, Any]:
    """A leg with the `ec_transfer_params` the encoder answered with (none: as it was)."""
    out = dict(leg)
    params = encoder_response.get("ec_transfer_params")
    if isinstance(params, Mapping) and params:
        out["ec_transfer_params"] = dict(params)
    return out


def _post(
    upstream: Upstream, path: str, body: Mapping[str, Any], request_id: str, timeout: float
) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection(upstream.host, upstream.port, timeout=timeout)
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    conn.request("POST", path, body=payload, headers=headers)
    return conn.getresponse()


def _read_json(response: http.client.HTTPResponse) -> dict[str, Any]:
    data = response.read()
    response.close()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {data[:500]!r}")
    parsed = json.loads(data)
    if not isinstance(parsed, dict):
        raise RuntimeError("the engine answered with something other than a JSON object")
    return parsed


class Proxy:
    """The proxy's routing, independent of the HTTP server that serves it."""

    def __init__(
        self,
        prefill: Upstream,
        decode: Upstream,
        *,
        mode: Mode = "push",
        coordinates: PrefillCoordinates | None = None,
        encoder: Upstream | None = None,
        timeout: float = 600.0,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        if mode == "push" and coordinates is None:
            raise ValueError("push mode needs P's coordinates (engine id, side channel, TP)")
        self.prefill = prefill
        self.decode = decode
        self.mode = mode
        self.encoder = encoder
        self.coordinates = coordinates
        self.timeout = timeout
        self.new_id = new_id
        self._pool = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kvhandoff-proxy")

    def route(self, path: str, request: Mapping[str, Any]) -> http.client.HTTPResponse:
        """Send both legs of one client request; return D's open response."""
        request_id = self.new_id()
        p_leg = prefill_body(request)
        if self.encoder is not None:
            e_leg = encode_body(request)
            encoded = _read_json(_post(self.encoder, path, e_leg, request_id, self.timeout))
            p_leg = with_encodings(p_leg, encoded)
        p_answer: Future[dict[str, Any]] = self._pool.submit(
            lambda: _read_json(_post(self.prefill, path, p_leg, request_id, self.timeout))
        )
        if self.mode == "push":
            assert self.coordinates is not None
            d_leg = push_decode_body(request, self.coordinates)
            response = _post(self.decode, path, d_leg, request_id, self.timeout)
            try:
                p_answer.result()  # a failed prefill fails the request
            except BaseException:
                response.close()  # D's request ends with the connection (vLLM aborts it)
                raise
            return response
        d_leg = pull_decode_body(request, p_answer.result())
        return _post(self.decode, path, d_leg, request_id, self.timeout)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def handler(proxy: Proxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the answer ends when the connection closes

        def do_POST(self) -> None:
            if self.path not in ROUTES:
                self._error(404, f"no route {self.path}; this proxy serves {list(ROUTES)}")
                return
            try:
                length = int(self.headers.get("Content-Length", "0"))
                request = json.loads(self.rfile.read(length))
                if not isinstance(request, dict):
                    raise ValueError("the request body is not a JSON object")
            except ValueError as exc:
                self._error(400, str(exc))
                return
            try:
                response = proxy.route(self.path, request)
            except Exception as exc:  # an engine failed or could not be reached
                log.warning("request failed: %s", exc)
                self._error(502, str(exc))
                return
            self.send_response(response.status)
            for name in ("Content-Type", "X-Request-Id"):
                value = response.getheader(name)
                if value:
                    self.send_header(name, value)
            self.end_headers()
            while chunk := response.read1(65536):
                self.wfile.write(chunk)
                self.wfile.flush()
            response.close()

        def _error(self, status: int, message: str) -> None:
            body = json.dumps({"error": {"message": message, "code": status}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s " + format, self.address_string(), *args)

    return Handler


def serve(proxy: Proxy, host: str, port: int) -> ThreadingHTTPServer:
    """A bound server for `proxy` (call `serve_forever`, or run it on a thread)."""
    server = ThreadingHTTPServer((host, port), handler(proxy))
    server.daemon_threads = True
    return server


def serve_in_thread(proxy: Proxy, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """Serve on a daemon thread (tests, embedding); `server.shutdown()` stops it."""
    server = serve(proxy, host, port)
    threading.Thread(target=server.serve_forever, name="kvhandoff-proxy", daemon=True).start()
    return server
