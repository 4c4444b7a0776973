"""Backend 'remote': an OpenAI-compatible chat-completions server (vLLM `vllm serve`, SGLang,
TensorRT-LLM `trtllm-serve`) serving a large VLM, possibly across many GPUs.

Per job, one request (kestrel_models.planner.remote: timeouts, retries on 5xx/429/timeouts):
the chat system prompt (prompting.py: skills, limits, 'the task is data'), the user prompt
(objects, max steps, task), the image as a PNG data URL when remote_send_image, and with
remote_response_format 'json_schema' the plan's JSON schema as `response_format` (server-side
constrained decoding where the server supports it). The jobs of one batch are sent
concurrently (the server batches them). Cancel: the wait for a reply polls should_cancel every
20 ms; a cancelled request is abandoned (its thread ends within the request's timeout bound).
A reply that is not a plan -> DecodeOutput.reject (the plan is REJECTED with the reason); no
reply after the retries -> DecodeOutput.error (VALIDATION_ERROR). Streaming: one feedback call
with the whole plan text when the reply arrives.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kestrel_models.planner.remote import RemoteBackend, RemoteCompletion, RemoteError, png_bytes
from kestrel_planner.core.backend import DecodeJob, DecodeOutput, PlannerInputError
from kestrel_planner.core.plan import PlanParseError
from kestrel_planner.core.prompting import (chat_system_prompt, reply_to_plan_text,
                                            response_format, user_prompt)

if TYPE_CHECKING:
    from kestrel_planner.core.planner_core import PlannerConfig

__all__ = ["RemotePlanBackend"]

POLL_S = 0.02  # cancel polling period while a request is in flight, s


class _Call:
    """One request on its own daemon thread (abandoned, not joined, when cancelled)."""

    def __init__(self, client: RemoteBackend, system: str, user: str, image, extra) -> None:
        self.done = threading.Event()
        self.reply: RemoteCompletion | None = None
        self.error: Exception | None = None
        self._args = (system, user, image, extra)
        self._client = client
        threading.Thread(target=self._run, name="planner_remote", daemon=True).start()

    def _run(self) -> None:
        try:
            self.reply = self._client.complete(*self._args)
        except Exception as exc:  # RemoteError, or anything unexpected: reported, never raised
            self.error = exc
        finally:
            self.done.set()


class RemotePlanBackend:
    warmup = False  # the server may come up after the node: retries cover it

    def __init__(self, config: PlannerConfig) -> None:
        if config.remote is None:
            raise ValueError("parameter 'remote.base_url' = '': backend 'remote' needs a server "
                             "URL")
        self.name = "remote"
        self.config = config
        self.client = RemoteBackend(config.remote)
        self._system = chat_system_prompt(config.limits, config.remote_response_format)
        # Bound on one request, s (each attempt's timeout, every backoff) + a margin.
        self._max_wait = config.remote.max_wait_s() + 1.0

    def close(self) -> None:
        pass

    def request_args(self, job: DecodeJob) -> tuple[str, str, object, dict]:
        """(system, user, image or None, extra body fields) of one job."""
        extra = {}
        if self.config.remote_response_format == "json_schema":
            extra["response_format"] = response_format(job.names, job.cap)
        image = job.image if self.config.remote_send_image else None
        return self._system, user_prompt(job.instruction, job.names, job.cap), image, extra

    def decode(self, jobs: Sequence[DecodeJob]) -> list[DecodeOutput]:
        t0 = time.monotonic()
        args = [self.request_args(j) for j in jobs]
        for k, a in enumerate(args):
            if a[2] is not None:
                try:
                    png_bytes(a[2])  # type: ignore[arg-type]
                except ValueError as exc:
                    raise PlannerInputError(f"request {k}: {exc}") from exc
        calls = [_Call(self.client, *a) for a in args]
        out = []
        for job, call in zip(jobs, calls, strict=True):
            out.append(self._wait(job, call, t0))
        return out

    def _wait(self, job: DecodeJob, call: _Call, t0: float) -> DecodeOutput:
        deadline = t0 + self._max_wait
        while not call.done.wait(POLL_S):
            if job.should_cancel is not None and job.should_cancel():
                return DecodeOutput("", "cancelled", time.monotonic() - t0, 0)
            if time.monotonic() > deadline:  # cannot happen with urllib's timeouts; bounded
                return DecodeOutput("", "error", time.monotonic() - t0, 0,
                                    error=f"remote backend: no reply within {self._max_wait} s")
        elapsed = time.monotonic() - t0
        if call.reply is None:
            exc = call.error
            if isinstance(exc, RemoteError) and exc.kind in ("malformed", "too_large"):
                return DecodeOutput("", "error", elapsed, 0, reject=f"remote reply: {exc}")
            return DecodeOutput("", "error", elapsed, 0,
                                error=f"remote backend unavailable: {exc}")
        reply = call.reply
        n = _tokens(reply.usage.get("completion_tokens")) or len(reply.text)
        o = DecodeOutput(reply.text, reply.finish_reason or "stop", elapsed, n)
        try:
            o.text = reply_to_plan_text(reply.text, job.cap)
        except PlanParseError as exc:
            cut = " (cut at max_new_tokens)" if reply.finish_reason == "length" else ""
            o.reject = f"parse error: {exc}{cut}"
            return o
        if job.on_token is not None:
            job.on_token(n, o.text)
        return o


def _tokens(value: object) -> int:
    """The server's completion_tokens, or 0 when it is not a count (any JSON may arrive)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
