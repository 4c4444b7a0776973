"""Remote OpenAI-compatible backend against a small local server that speaks the protocol."""

from __future__ import annotations

import base64
import json
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from kestrel_models.planner.remote import (
    RemoteBackend, RemoteConfig, RemoteError, check_base_url, png_bytes,
)

PLAN = "pick red_cube\nplace bin\nend"


class _Server:
    """Replies follow `script`: a list of actions consumed one per request; the last repeats.
    ('ok', text) | ('status', code[, retry_after]) | ('sleep', seconds) | ('garbage',)."""

    def __init__(self) -> None:
        self.script: list[tuple] = [("ok", PLAN)]
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.requests.append(json.loads(body))
                outer.headers.append(dict(self.headers))
                act = outer.script.pop(0) if len(outer.script) > 1 else outer.script[0]
                if act[0] == "sleep":
                    time.sleep(act[1])
                    act = ("ok", PLAN)
                if act[0] == "status":
                    self.send_response(act[1])
                    if len(act) > 2:
                        self.send_header("Retry-After", str(act[2]))
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"{}")
                    return
                if act[0] == "garbage":
                    data = b'{"choices": []}'
                else:
                    data = json.dumps({
                        "id": "x", "object": "chat.completion", "model": "m",
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": act[1]}}],
                        "usage": {"prompt_tokens": 5, "completion_tokens": 7}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and closed

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture()
def server() -> Iterator[_Server]:
    s = _Server()
    yield s
    s.close()


def _backend(url: str, **kw: object) -> RemoteBackend:
    cfg = dict(base_url=url, model="planner-vlm", api_key="sk-test", timeout_s=1.0,
               max_retries=2, backoff_s=0.01, max_backoff_s=0.05)
    cfg.update(kw)
    return RemoteBackend(RemoteConfig(**cfg))  # type: ignore[arg-type]


def test_request_and_reply(server: _Server) -> None:
    img = np.random.default_rng(0).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    out = _backend(server.url).complete("system rules", "put the cube in the bin", img)
    assert out.text == PLAN and out.finish_reason == "stop" and out.attempts == 1
    assert out.usage == {"prompt_tokens": 5, "completion_tokens": 7}
    req = server.requests[0]
    assert req["model"] == "planner-vlm" and req["max_tokens"] == 160
    assert req["messages"][0] == {"role": "system", "content": "system rules"}
    text, image = req["messages"][1]["content"]
    assert text == {"type": "text", "text": "put the cube in the bin"}
    assert server.headers[0]["Authorization"] == "Bearer sk-test"
    png = base64.b64decode(image["image_url"]["url"].split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png == png_bytes(img)
    # Decode our PNG's pixels back (IDAT = zlib of filter byte 0 + row bytes).
    idat = png[png.index(b"IDAT") + 4: png.index(b"IEND") - 8]
    rows = zlib.decompress(idat)
    assert np.array_equal(np.frombuffer(rows, np.uint8).reshape(6, 16)[:, 1:].reshape(6, 5, 3),
                          img)


def test_retries_on_5xx_429_and_timeout(server: _Server) -> None:
    server.script = [("status", 503), ("status", 429, 0), ("ok", PLAN)]
    out = _backend(server.url).complete("s", "u")
    assert out.text == PLAN and out.attempts == 3
    server.script = [("sleep", 1.5), ("ok", "end")]
    t0 = time.monotonic()
    out = _backend(server.url, timeout_s=0.3).complete("s", "u")
    assert out.text == "end" and out.attempts == 2
    assert time.monotonic() - t0 < 1.4  # the slow reply was abandoned, not awaited


def test_exhausted_retries_and_non_retryable_errors(server: _Server) -> None:
    server.script = [("status", 500)]
    with pytest.raises(RemoteError, match="3 attempts: HTTP 500"):
        _backend(server.url).complete("s", "u")
    assert len(server.requests) == 3
    server.script = [("status", 400)]
    with pytest.raises(RemoteError, match="HTTP 400"):
        _backend(server.url).complete("s", "u")
    assert len(server.requests) == 4  # no retry on a client error
    server.script = [("garbage",)]
    with pytest.raises(RemoteError, match="malformed reply"):
        _backend(server.url).complete("s", "u")


def test_connection_refused_is_retried_then_raises() -> None:
    s = _Server()
    url = s.url
    s.close()  # nothing listens there now
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="connection error"):
        _backend(url, max_retries=1).complete("s", "u")
    assert time.monotonic() - t0 < 5


def test_extra_fields_and_malformed_kind(server: _Server) -> None:
    """`extra` adds request fields (response_format for server-side structured output) and
    may not replace base fields; a malformed reply is RemoteError(kind='malformed')."""
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object"}}}
    out = _backend(server.url).complete("s", "u", extra={"response_format": rf})
    assert out.text == PLAN and server.requests[0]["response_format"] == rf
    with pytest.raises(ValueError, match="would replace a base field"):
        _backend(server.url).request_body("s", "u", None, {"model": "other"})
    server.script = [("garbage",)]
    with pytest.raises(RemoteError) as info:
        _backend(server.url).complete("s", "u")
    assert info.value.kind == "malformed"
    server.script = [("status", 503)]
    with pytest.raises(RemoteError) as info:
        _backend(server.url, max_retries=0).complete("s", "u")
    assert info.value.kind == "unavailable"


def test_config_validation() -> None:
    for url in ["localhost:8000", "ftp://x/v1", "http://", "http://x:70000", "http://a b",
                "http://x/v1#frag"]:
        with pytest.raises(ValueError, match="parameter 'remote.base_url'"):
            RemoteConfig(base_url=url, model="m")
    assert check_base_url("https://host:8443/v1/") == "https://host:8443/v1"
    with pytest.raises(ValueError, match="parameter 'remote.model'"):
        RemoteConfig(base_url="http://x", model="")
    with pytest.raises(ValueError, match="parameter 'remote.timeout_s'"):
        RemoteConfig(base_url="http://x", model="m", timeout_s=0)
    with pytest.raises(ValueError, match="parameter 'remote.max_retries'"):
        RemoteConfig(base_url="http://x", model="m", max_retries=-1)
    cfg = RemoteConfig(base_url="http://x", model="m", timeout_s=2.0, max_retries=2,
                       max_backoff_s=0.5)
    assert cfg.max_wait_s() == 3 * 2 * 2.0 + 2 * 0.5
    with pytest.raises(ValueError, match="image must be uint8"):
        png_bytes(np.zeros((2, 2), np.uint8))
