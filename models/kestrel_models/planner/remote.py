"""A remote planner backend: any server that speaks the OpenAI chat-completions protocol
(vLLM `vllm serve`, SGLang, TensorRT-LLM `trtllm-serve`, OpenAI itself).

POST {base_url}/chat/completions with
    {"model", "messages": [{"role": "system", "content": str},
                           {"role": "user", "content": [{"type": "text", "text": str},
                                                        {"type": "image_url", "image_url":
                                                         {"url": "data:image/png;base64,..."}}]}],
     "max_tokens", "temperature", **extra}
and read choices[0].message.content. `extra` carries e.g. `response_format` (json_schema
structured output, which vLLM, SGLang and TensorRT-LLM enforce server-side with a grammar
engine). Standard library only (urllib, zlib): no client package.

Every attempt is bounded: connect and the reply's headers within timeout_s each, the whole
reply within 2 * timeout_s of the attempt's start; the body is read in chunks and abandoned as
soon as it passes max_reply_bytes (a plan is a few hundred bytes: an endless or huge reply
costs neither time nor memory). Timeouts, connection errors, HTTP 429 and 5xx are retried up
to max_retries times with exponential backoff (backoff_s * 2^i, or the server's Retry-After
when given, capped at max_backoff_s); other 4xx, too large and malformed replies fail at once.
Failures raise RemoteError (kind 'unavailable', 'malformed' or 'too_large'; the caller counts
it); the reply text is never trusted: the planner parses and validates it like its own
model's output. Parameter names in errors are the planner node's (`remote.*`).
"""

from __future__ import annotations

import base64
import http.client
import json
import struct
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["RemoteConfig", "RemoteBackend", "RemoteCompletion", "RemoteError", "png_bytes",
           "check_base_url"]


class RemoteError(RuntimeError):
    """The remote backend gave no usable completion (after retries where retryable).
    kind: 'unavailable' (no reply: connection, timeout, HTTP error) or 'malformed' (a reply
    that is not a chat completion)."""

    def __init__(self, message: str, kind: str = "unavailable") -> None:
        super().__init__(message)
        self.kind = kind


def check_base_url(url: str, name: str = "remote.base_url") -> str:
    """'http(s)://host[:port][/path]' -> the URL without a trailing '/'; ValueError naming the
    parameter otherwise."""
    if not isinstance(url, str) or not url or url != url.strip() or any(c.isspace() for c in url):
        raise ValueError(f"parameter '{name}' = {url!r}: must be an http(s):// URL without "
                         "spaces")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # ValueError for a bad port
    except ValueError as exc:
        raise ValueError(f"parameter '{name}' = {url!r}: not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"parameter '{name}' = {url!r}: must be http(s)://host[:port][/path], "
                         "e.g. http://127.0.0.1:8000/v1")
    if parts.query or parts.fragment:
        raise ValueError(f"parameter '{name}' = {url!r}: no query or fragment allowed")
    del port
    return url.rstrip("/")


@dataclass(frozen=True)
class RemoteConfig:
    base_url: str  # e.g. http://127.0.0.1:8000/v1
    model: str
    api_key: str = ""
    timeout_s: float = 10.0
    max_retries: int = 2
    backoff_s: float = 0.2
    max_backoff_s: float = 2.0
    max_tokens: int = 160
    temperature: float = 0.0
    max_reply_bytes: int = 65536

    def __post_init__(self) -> None:
        check_base_url(self.base_url)
        if not self.model.strip():
            raise ValueError(f"parameter 'remote.model' = {self.model!r}: must be the served "
                             "model name (e.g. the --served-model-name of vllm serve)")
        if not 0 < self.timeout_s <= 600:
            raise ValueError(f"parameter 'remote.timeout_s' = {self.timeout_s}: must be in "
                             "(0, 600]")
        if not 0 <= self.max_retries <= 10:
            raise ValueError(f"parameter 'remote.max_retries' = {self.max_retries}: must be in "
                             "[0, 10]")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"parameter 'remote.backoff_s' = {self.backoff_s}: must be in "
                             f"[0, max_backoff_s = {self.max_backoff_s}]")
        if self.max_tokens < 1:
            raise ValueError(f"parameter 'max_new_tokens' = {self.max_tokens}: must be >= 1")
        if not 0 <= self.temperature <= 5:
            raise ValueError(f"parameter 'temperature' = {self.temperature}: must be in [0, 5]")
        if self.max_reply_bytes < 1024:
            raise ValueError(f"parameter 'remote.max_reply_bytes' = {self.max_reply_bytes}: "
                             "must be >= 1024")

    def max_wait_s(self) -> float:
        """Upper bound on one complete() call, s: every attempt (2 * timeout_s: connect and
        headers, then the whole reply by 2 * timeout_s after the attempt's start) plus every
        backoff."""
        return (self.max_retries + 1) * 2 * self.timeout_s + self.max_retries * self.max_backoff_s


@dataclass
class RemoteCompletion:
    text: str
    finish_reason: str
    attempts: int
    latency_s: float
    usage: dict = field(default_factory=dict)


def png_bytes(image: np.ndarray) -> bytes:
    """uint8 [H, W, 3] RGB -> PNG file bytes (8-bit truecolour, no filter)."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
    h, w, _ = image.shape
    raw = b"".join(b"\x00" + image[y].tobytes() for y in range(h))

    def chunk(tag: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + tag + data
                + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


_CHUNK = 16384  # reply bytes per read, B


class _Retryable(Exception):
    def __init__(self, msg: str, retry_after: float | None = None) -> None:
        super().__init__(msg)
        self.retry_after = retry_after


class RemoteBackend:
    def __init__(self, config: RemoteConfig) -> None:
        self.config = config
        self.url = check_base_url(config.base_url) + "/chat/completions"

    def request_body(self, system: str, user: str, image: np.ndarray | None,
                     extra: Mapping[str, object] | None = None) -> dict:
        """The JSON body; `extra` adds fields (e.g. response_format) and may not replace the
        model, messages or sampling fields."""
        content: list[dict] = [{"type": "text", "text": user}]
        if image is not None:
            b64 = base64.b64encode(png_bytes(image)).decode("ascii")
            content.append({"type": "image_url",
                            "image_url": {"url": f"data:image/png;base64,{b64}"}})
        body = {"model": self.config.model,
                "messages": [{"role": "system", "content": system},
                             {"role": "user", "content": content}],
                "max_tokens": self.config.max_tokens, "temperature": self.config.temperature}
        for k, v in (extra or {}).items():
            if k in body:
                raise ValueError(f"extra request field {k!r} would replace a base field")
            body[k] = v
        return body

    def complete(self, system: str, user: str, image: np.ndarray | None = None,
                 extra: Mapping[str, object] | None = None) -> RemoteCompletion:
        """One chat completion; RemoteError when none could be had."""
        body = json.dumps(self.request_body(system, user, image, extra)).encode()
        c = self.config
        t0 = time.monotonic()
        last = ""
        for attempt in range(c.max_retries + 1):
            try:
                text, reason, usage = self._once(body)
                return RemoteCompletion(text, reason, attempt + 1, time.monotonic() - t0, usage)
            except _Retryable as exc:
                last = str(exc)
                if attempt == c.max_retries:
                    break
                wait = exc.retry_after if exc.retry_after is not None else c.backoff_s * 2**attempt
                time.sleep(min(max(wait, 0.0), c.max_backoff_s))
        raise RemoteError(f"{self.url}: no completion after {c.max_retries + 1} attempts: {last}")

    def _read_capped(self, resp: http.client.HTTPResponse, deadline: float) -> bytes:
        """The reply body, read in chunks: RemoteError 'too_large' as soon as it passes
        max_reply_bytes, _Retryable when it is not complete by `deadline` (monotonic s)."""
        cap = self.config.max_reply_bytes
        length = resp.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > cap:
            raise RemoteError(f"{self.url}: reply of {int(length)} bytes is larger than "
                              f"remote.max_reply_bytes ({cap})", "too_large")
        sock = getattr(getattr(getattr(resp, "fp", None), "raw", None), "_sock", None)
        buf = bytearray()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Retryable(f"reply not complete within {2 * self.config.timeout_s} s")
            if sock is not None:
                sock.settimeout(left)  # a blocked read ends by the deadline too
            chunk = resp.read1(_CHUNK)
            if not chunk:
                return bytes(buf)
            buf += chunk
            if len(buf) > cap:
                raise RemoteError(f"{self.url}: reply larger than remote.max_reply_bytes "
                                  f"({cap} bytes); not read further", "too_large")

    def _once(self, body: bytes) -> tuple[str, str, dict]:
        deadline = time.monotonic() + 2 * self.config.timeout_s
        headers = {"Content-Type": "application/json"}
        if self.config.api_key:
            headers["Authorization"] = f"Bearer {self.config.api_key}"
        req = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.config.timeout_s) as resp:
                raw = self._read_capped(resp, deadline)
        except urllib.error.HTTPError as exc:
            if exc.code == 429 or exc.code >= 500:
                ra = exc.headers.get("Retry-After") if exc.headers else None
                try:
                    after = float(ra) if ra is not None else None
                except ValueError:
                    after = None
                raise _Retryable(f"HTTP {exc.code}", after) from exc
            raise RemoteError(f"{self.url}: HTTP {exc.code}: {exc.read(200)!r}") from exc
        except TimeoutError as exc:
            if time.monotonic() >= deadline - 0.05:  # the body's deadline, not one read
                raise _Retryable(f"reply not complete within {2 * self.config.timeout_s} s"
                                 ) from exc
            raise _Retryable(f"timeout after {self.config.timeout_s} s") from exc
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, TimeoutError):
                raise _Retryable(f"timeout after {self.config.timeout_s} s") from exc
            raise _Retryable(f"connection error: {exc.reason}") from exc
        except (ConnectionError, http.client.HTTPException) as exc:  # reset, incomplete read
            raise _Retryable(f"connection error: {exc!r}") from exc
        try:
            reply = json.loads(raw)
            choice = reply["choices"][0]
            text = choice["message"]["content"]
            if not isinstance(text, str):
                raise TypeError("content is not a string")
            usage = reply.get("usage") or {}
            usage = usage if isinstance(usage, dict) else {}
        except (ValueError, KeyError, IndexError, TypeError, RecursionError) as exc:
            raise RemoteError(f"{self.url}: malformed reply: {raw[:200]!r}", "malformed") from exc
        finish = choice.get("finish_reason", "") if isinstance(choice, dict) else ""
        return text, str(finish), usage
