"""Property-based tests of the planner core's input paths (hypothesis): whatever plan text a
model writes and whatever a remote server replies (arbitrary JSON, bytes, deep nesting, huge
strings, odd `usage`), nothing raises out of the core: the text is a Plan or a PlanParseError
with a reason, a parsed plan is accepted or rejected with reasons, and a reply is a plan text, a
counted rejection (DecodeOutput.reject) or a typed RemoteError."""

from __future__ import annotations

import json
import math
import threading
import urllib.request

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel_models.planner.remote import RemoteBackend, RemoteCompletion, RemoteConfig, \
    RemoteError
from kestrel_planner.core import backend_remote
from kestrel_planner.core.backend import DecodeJob
from kestrel_planner.core.plan import Plan, PlanParseError, SceneObject, parse_plan
from kestrel_planner.core.prompting import reply_to_plan_text
from kestrel_planner.core.validator import PlanLimits, PlanValidator

SETTINGS = settings(max_examples=200, deadline=None)
NAMES = ["red_cube", "bin", "green_cube"]
SCENE = [SceneObject("red_cube", (0.4, 0.0, 0.02)), SceneObject("bin", (0.2, 0.3, 0.0)),
         SceneObject("green_cube", None)]
# words a plan is made of, near misses, and garbage: the parser sees mostly almost-plans
WORDS = st.one_of(
    st.sampled_from(["move_to", "pick", "place", "push", "end", "refuse", "absent_object",
                     "red_cube", "bin", "green_cube", "Red_Cube", "speed=0.2", "height=0.1",
                     "distance=0.05", "speed=nan", "speed=inf", "speed=-1", "height=1e400",
                     "speed=", "=0.2", "speed=0.2=0.3", "speed=0x10", "height=99999",
                     "", " ", "\t", "\r", "\x00", "é", "speed=１"]),
    st.text(max_size=12))
LINES = st.lists(WORDS, max_size=6).map(" ".join)
PLAN_TEXT = st.one_of(st.lists(LINES, max_size=10).map("\n".join),
                      st.lists(LINES, min_size=1, max_size=10).map(lambda ls: "\n".join(
                          [*ls, "end"])),
                      st.text(max_size=300))
VALIDATOR = PlanValidator(PlanLimits(max_steps=8))


@SETTINGS
@given(text=PLAN_TEXT, cap=st.one_of(st.none(), st.integers(1, 16)))
def test_any_plan_text_is_a_plan_or_a_reasoned_parse_error(text, cap) -> None:
    try:
        plan = parse_plan(text, "task", max_steps=cap)
    except PlanParseError as exc:
        assert exc.reason  # a typed rejection with its reason
        return
    assert isinstance(plan, Plan) and (plan.steps or plan.refusal)
    report = VALIDATOR.validate(plan, SCENE, max_steps=cap)  # never raises
    assert report.accepted or report.reasons
    if report.accepted:
        for step in plan.steps:
            assert all(math.isfinite(v) for v, _unit in step.arguments.values())


@settings(max_examples=5, deadline=None)
@given(n=st.integers(10_000, 50_000))
def test_huge_plan_text_is_refused_before_parsing(n) -> None:
    with pytest.raises(PlanParseError, match="more than max_steps"):
        parse_plan("move_to red_cube\n" * n + "end", max_steps=8)


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20))
JSON = st.recursive(JSON_LEAF, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
    max_leaves=20)
STEP = st.fixed_dictionaries({"skill": st.one_of(st.sampled_from(["move_to", "pick", "fly"]),
                                                 JSON_LEAF),
                              "target": st.one_of(st.sampled_from(NAMES), JSON_LEAF)},
                             optional={"speed": JSON_LEAF, "height": JSON_LEAF,
                                       "extra": JSON_LEAF})
PLAN_JSON = st.one_of(JSON, st.fixed_dictionaries({"steps": st.lists(STEP, max_size=12)},
                                                  optional={"refusal": JSON_LEAF}))


@SETTINGS
@given(data=PLAN_JSON, fence=st.booleans(), cap=st.integers(1, 16))
def test_any_json_reply_is_plan_text_or_a_parse_error(data, fence, cap) -> None:
    reply = json.dumps(data)
    if fence:
        reply = f"```json\n{reply}\n```"
    try:
        text = reply_to_plan_text(reply, cap)
    except PlanParseError as exc:
        assert exc.reason
        return
    assert isinstance(text, str)
    try:  # what the core does next
        parse_plan(text, max_steps=cap)
    except PlanParseError:
        pass


DEEP = ["{" * 50_000, "[" * 50_000, "{\"steps\": " + "[" * 50_000]  # nested past the stack


@SETTINGS
@given(reply=st.one_of(st.text(max_size=200), st.sampled_from(DEEP)))
def test_any_text_reply_is_plan_text_or_a_parse_error(reply) -> None:
    try:
        assert isinstance(reply_to_plan_text(reply, 8), str)
    except PlanParseError as exc:
        assert exc.reason


# ---- remote replies: raw HTTP bodies through RemoteBackend, then the backend's handling ----

class _Resp:
    headers: dict = {}

    def __enter__(self) -> _Resp:
        return self

    def __exit__(self, *exc) -> None:
        pass


def _completion(content: object, usage: object, finish: object) -> bytes:
    return json.dumps({"choices": [{"message": {"content": content}, "finish_reason": finish}],
                       "usage": usage}).encode()


RAW = st.one_of(
    st.binary(max_size=300),
    JSON.map(lambda d: json.dumps(d).encode()),
    st.builds(_completion, st.one_of(st.text(max_size=50), JSON), JSON, JSON),
    st.just(b"[" * 100_000), st.just(b"{\"choices\": " + b"[" * 100_000),
    st.just(_completion("x" * 60_000, {}, "length")),
    st.just(b"\xff\xfe" * 1000))


@pytest.fixture(scope="module")
def remote() -> RemoteBackend:
    return RemoteBackend(RemoteConfig(base_url="http://127.0.0.1:9/v1", model="m",
                                      max_retries=0))


@SETTINGS
@given(raw=RAW)
def test_any_http_body_is_a_completion_or_a_typed_error(remote, raw, monkeypatch_module) -> None:
    monkeypatch_module.setattr(urllib.request, "urlopen", lambda *a, **k: _Resp())
    monkeypatch_module.setattr(RemoteBackend, "_read_capped", lambda self, resp, dl: raw)
    try:
        c = remote.complete("system", "user")
    except RemoteError as exc:
        assert exc.kind in ("malformed", "unavailable", "too_large")
        return
    assert isinstance(c.text, str) and isinstance(c.usage, dict)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


class _Call:
    def __init__(self, reply: RemoteCompletion | None, error: Exception | None) -> None:
        self.done = threading.Event()
        self.done.set()
        self.reply, self.error = reply, error


class _Backend:
    _max_wait = 1.0


@SETTINGS
@given(text=st.one_of(st.text(max_size=100), PLAN_JSON.map(json.dumps)),
       usage=st.dictionaries(st.sampled_from(["completion_tokens", "prompt_tokens"]), JSON),
       finish=st.sampled_from(["stop", "length", ""]))
def test_any_completion_is_plan_text_or_a_rejection(text, usage, finish) -> None:
    job = DecodeJob("task", NAMES, 8, None)
    call = _Call(RemoteCompletion(text, finish, 1, 0.1, usage), None)
    out = backend_remote.RemotePlanBackend._wait(_Backend(), job, call, 0.0)  # never raises
    assert out.reject or isinstance(out.text, str)
    assert out.tokens >= 0
