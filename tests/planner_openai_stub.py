"""A small OpenAI-compatible chat-completions server for the planner's remote-backend tests.

It speaks the protocol vLLM / SGLang / TensorRT-LLM serve (POST /v1/chat/completions, GET
/v1/models) and plays a "model" that reads the planner's user prompt (objects, task):
  task mentions...   reply
  'garbage'          text that is not a plan                      -> plan REJECTED (parse)
  'malformed'        HTTP 200 whose body is not a chat completion -> REJECTED (reply)
  'fast'             a plan at speed=10 m/s (obeys the injection) -> REJECTED (limits)
  'unicorn'          a plan whose target is not in the scene      -> REJECTED (scene)
  'fail'             HTTP 500 every time                          -> VALIDATION_ERROR (retries)
  'busy'             HTTP 503 then 429 then a plan                -> accepted after retries
  'slow'             sleeps `slow_s` before the plan              -> a client timeout
  'huge'             a 20 MB reply ("home" 4 million times), no Content-Length, streamed
                                                                  -> REJECTED (reply size)
  'many'             a 500-step plan (small enough to be read)   -> REJECTED (max_steps)
  anything else      pick <first object> [place <second object>] | move_to | home -> accepted
The reply is JSON per the request's response_format json_schema when one is sent, else the
plan text form. Every request body and header set is recorded (requests, headers).
`script` (in-process use) overrides the model: actions consumed one per request, the last one
repeating: ('ok', content) | ('status', code[, retry_after]) | ('sleep', s) | ('malformed',) |
('huge', n_bytes, with_content_length) (written in 64 KiB pieces: the stub never holds it) |
('drip', every_s) (headers, then one body byte every every_s).

In-process:   with OpenAIStub() as s: ... s.url ...
As a process: python tests/planner_openai_stub.py --port-file PATH [--log PATH]
              (writes the URL to --port-file; one JSON line per request to --log: the task,
              the Authorization header, whether an image and a response_format were sent)
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["OpenAIStub", "model_reply", "HUGE_BYTES"]

HUGE_BYTES = 20_000_000  # the 'huge' reply, bytes


def _prompt(body: dict) -> tuple[list[str], str]:
    """(object names, task) from the planner's user message."""
    objects: list[str] = []
    task = ""
    for msg in body.get("messages", []):
        if msg.get("role") != "user":
            continue
        content = msg.get("content")
        parts = content if isinstance(content, list) else [{"type": "text", "text": content}]
        for part in parts:
            if part.get("type") != "text":
                continue
            for line in str(part.get("text", "")).splitlines():
                if line.startswith("objects: "):
                    objects = [w for w in line[9:].split() if w != "none"]
                elif line.startswith("task: "):
                    task = line[6:]
    return objects, task


def model_reply(body: dict) -> tuple[str, object]:
    """The stub model: ('ok', content) | ('status', code) | ('malformed',) | ('sleep', ...)."""
    objects, task = _prompt(body)
    t = task.lower()
    if "garbage" in t:
        return ("ok", "Sure! Here is what I would do: grab the thing, then relax.")
    if "malformed" in t:
        return ("malformed",)
    if "fail" in t:
        return ("status", 500)
    if "huge" in t:
        return ("huge", HUGE_BYTES, False)
    steps: list[dict]
    if "many" in t:
        steps = [{"skill": "home"}] * 500
    elif "fast" in t and objects:
        steps = [{"skill": "move_to", "target": objects[0], "speed": 10.0}]
    elif "unicorn" in t:
        steps = [{"skill": "pick", "target": "purple_unicorn"}]
    elif len(objects) >= 2:
        steps = [{"skill": "pick", "target": objects[0], "speed": 0.2, "height": 0.05},
                 {"skill": "place", "target": objects[1]}]
    elif objects:
        steps = [{"skill": "move_to", "target": objects[0], "speed": 0.2, "height": 0.1}]
    else:
        steps = [{"skill": "home"}]
    if "response_format" in body:
        return ("ok", json.dumps({"steps": steps}))
    lines = [" ".join([s["skill"]] + ([s["target"]] if "target" in s else [])
                      + [f"{k}={v:g}" for k, v in s.items() if k not in ("skill", "target")])
             for s in steps]
    return ("ok", "\n".join(lines + ["end"]))


class OpenAIStub:
    def __init__(self, host: str = "127.0.0.1", port: int = 0, slow_s: float = 2.0,
                 log: Path | None = None) -> None:
        self.log = log
        self.script: list[tuple] = []
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.slow_s = slow_s
        self._busy: dict[str, int] = {}
        self._lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                self._json(200, {"object": "list", "data": [{"id": "stub", "object": "model"}]})

            def do_POST(self) -> None:  # noqa: N802
                try:
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                except (ValueError, TypeError, KeyError):
                    self._json(400, {"error": {"message": "bad request body"}})
                    return
                act = outer._next(body, dict(self.headers))
                if act[0] == "sleep":
                    time.sleep(act[1])
                    act = model_reply(body) if len(act) < 3 else act[2]
                if act[0] == "status":
                    extra = {"Retry-After": str(act[2])} if len(act) > 2 else {}
                    self._json(act[1], {"error": {"message": f"status {act[1]}"}}, extra)
                elif act[0] == "malformed":
                    self._json(200, {"choices": []})
                elif act[0] == "huge":
                    self._huge(act[1], act[2])
                elif act[0] == "drip":
                    self._drip(act[1])
                else:
                    self._json(200, {
                        "id": "chatcmpl-stub", "object": "chat.completion",
                        "model": body.get("model", ""),
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": act[1]}}],
                        "usage": {"prompt_tokens": 50, "completion_tokens": 12}})

            def _huge(self, n: int, with_length: bool) -> None:
                """A chat completion whose content is 'home\\n' repeated to ~n bytes, written
                piece by piece (close-delimited unless with_length)."""
                head = b'{"choices": [{"index": 0, "finish_reason": "stop", "message": ' \
                    b'{"role": "assistant", "content": "'
                tail = b'end"}}]}'
                piece = b"home\\n" * 10923  # 65538 bytes of JSON: 10923 lines of the plan
                count = max(1, (n - len(head) - len(tail)) // len(piece))
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    if with_length:
                        self.send_header("Content-Length",
                                         str(len(head) + count * len(piece) + len(tail)))
                    self.end_headers()
                    self.wfile.write(head)
                    for _ in range(count):
                        self.wfile.write(piece)
                    self.wfile.write(tail)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client stopped reading (what it should do)

            def _drip(self, every_s: float) -> None:
                """Headers, then one body byte every every_s until the client goes (or 60 s)."""
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.end_headers()
                    for _ in range(int(60 / every_s)):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(every_s)
                except (BrokenPipeError, ConnectionResetError):
                    pass

            def _json(self, code: int, obj: dict, headers: dict | None = None) -> None:
                data = json.dumps(obj).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    for k, v in (headers or {}).items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client timed out and closed

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def _next(self, body: dict, headers: dict) -> tuple:
        with self._lock:
            self.requests.append(body)
            self.headers.append(headers)
            if self.log is not None:
                self._log(body, headers)
            if self.script:
                return self.script.pop(0) if len(self.script) > 1 else self.script[0]
            _, task = _prompt(body)
            if "busy" in task:
                n = self._busy.get(task, 0)
                self._busy[task] = n + 1
                if n < 2:
                    return ("status", 503 if n == 0 else 429, 0)
            if "slow" in task:
                return ("sleep", self.slow_s)
        return model_reply(body)

    def _log(self, body: dict, headers: dict) -> None:
        user = [m for m in body.get("messages", []) if m.get("role") == "user"]
        parts = user[0].get("content") if user else []
        image = isinstance(parts, list) and any(p.get("type") == "image_url" for p in parts)
        line = {"task": _prompt(body)[1], "authorization": headers.get("Authorization", ""),
                "image": image, "response_format": "response_format" in body,
                "model": body.get("model", "")}
        with open(self.log, "a") as f:  # type: ignore[arg-type]
            f.write(json.dumps(line) + "\n")

    def start(self) -> OpenAIStub:
        self._thread.start()
        return self

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> OpenAIStub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file", type=Path, required=True, help="the URL is written here")
    ap.add_argument("--slow-s", type=float, default=2.0)
    ap.add_argument("--log", type=Path, default=None, help="one JSON line per request")
    args = ap.parse_args()
    stub = OpenAIStub(port=args.port, slow_s=args.slow_s, log=args.log).start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    tmp = args.port_file.with_suffix(".tmp")
    tmp.write_text(stub.url)
    tmp.rename(args.port_file)  # atomic: a reader never sees a partial URL
    print(f"listening on {stub.url}", flush=True)
    while not stop.wait(0.2):
        pass
    stub.close()
    print(f"served {len(stub.requests)} requests", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
