"""PlannerCore: instruction + image + scene objects -> validated plan, whatever model decodes.

Per batch: check every request (instruction, image format, scene names, step cap), hand the
jobs to the decoding backend (backend.py: our VLM 'generate' | 'engine', a local Hugging Face
VLM 'hf', an OpenAI-compatible server 'remote', or the instruction read as the plan
'plan_text'), then, for every backend alike, parse the text (plan.py) and validate the plan
(validator.py: skills enum, targets in the current scene, numeric limits). Only an accepted
report may reach control. Determinism (local backends) comes from the seed and greedy
decoding. Not thread-safe: one caller at a time.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kestrel_models.planner import VLMConfig
from kestrel_models.planner.hf import DTYPES
from kestrel_models.planner.remote import RemoteConfig
from kestrel_planner.core.backend import (BACKENDS, DecodeJob, DecodeOutput, OnToken,
                                          PlanBackend, PlannerInputError)
from kestrel_planner.core.backend_local import SYSTEM_PROMPT
from kestrel_planner.core.constrained_llg import GRAMMAR_ENGINES
from kestrel_planner.core.plan import (
    Plan,
    PlanParseError,
    SceneObject,
    fill_defaults,
    parse_plan,
)
from kestrel_planner.core.prompting import OUTPUT_FORMATS
from kestrel_planner.core.skills import NAME_RE
from kestrel_planner.core.validator import PlanLimits, PlanValidator, ValidationReport

__all__ = ["PlannerConfig", "PlanRequest", "PlanResult", "PlannerCore", "PlannerInputError",
           "SYSTEM_PROMPT", "BACKENDS", "make_backend"]

HF_TOKENIZERS = ("auto", "byte")


@dataclass(frozen=True)
class PlannerConfig:
    model: str | VLMConfig = "tiny"
    weights_path: str = ""  # state dict (torch.save); '' = random weights from `seed`
    # Demo/test weights when weights_path is '': the VLM parameterised as a bigram model of
    # this plan text (vlm.bigram_state_dict); decoding, grammar and validation are unchanged.
    demo_plan: str = ""
    device: str = "cpu"
    seed: int = 0
    max_new_tokens: int = 160
    max_batch: int = 4
    max_instruction_chars: int = 200
    temperature: float = 0.0
    limits: PlanLimits = field(default_factory=PlanLimits)
    # m/s: a step that takes a speed and gives none gets this one before validation (the
    # robot's default); 0 = the skill schema's default (skills.py)
    default_speed: float = 0.0
    warmup: bool = True
    # 'generate': generate.py (static batch per call); 'engine': DecodeEngine (slots over a
    # static KV cache, CUDA-graph decode on GPU); 'hf': a local HF directory; 'remote': an
    # OpenAI-compatible server. model/weights_path/demo_plan are the local backends' only.
    backend: str = "generate"
    engine_compile: bool = False  # engine on CUDA: whole decode step compiled (DecodeEngine)
    hf_model_path: str = ""  # directory with config.json + weights (save_pretrained)
    hf_dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    hf_tokenizer: str = "auto"  # auto (the directory's) | byte (Kestrel's byte tokenizer)
    hf_grammar: bool = True  # constrain decoding to the plan grammar (engine: grammar_engine)
    # frame size (width, height) px whose CUDA graphs configure captures (HFPlanBackend.
    # warm_graphs); (0, 0) = none: the first goal of each frame size captures its own
    hf_warmup_image_size: tuple[int, int] = (0, 0)
    # plan-grammar engine of the local backends: 'llguidance' (token masks for any tokenizer,
    # BPE too) | 'automaton' (constrained.py: single-character tokens only)
    grammar_engine: str = "llguidance"
    remote: RemoteConfig | None = None  # backend 'remote': URL, model, key, timeout, retries
    remote_send_image: bool = True
    remote_response_format: str = "json_schema"  # json_schema | text
    # engine: request prefixes ([image][<bos> objects line]) whose KV is kept; 0 = none
    prefix_cache_entries: int = 0
    # speculative decoding of the local backends: draft tokens per round (0 = off); the draft
    # is draft_weights_path (preset draft_model) or, when '', the model's first draft_layers
    speculative_k: int = 0
    draft_weights_path: str = ""
    draft_model: str | VLMConfig = "draft"
    draft_layers: int = 1

    def __post_init__(self) -> None:
        if self.max_new_tokens < 8:  # the shortest plan, 'home\nend'
            raise ValueError(f"parameter 'max_new_tokens' = {self.max_new_tokens}: must be >= 8")
        if self.max_batch < 1:
            raise ValueError(f"parameter 'max_batch' = {self.max_batch}: must be >= 1")
        if self.max_instruction_chars < 1:
            raise ValueError(f"parameter 'max_instruction_chars' = "
                             f"{self.max_instruction_chars}: must be >= 1")
        if not (math.isfinite(self.default_speed) and
                0.0 <= self.default_speed <= self.limits.max_speed):
            raise ValueError(f"parameter 'default_speed' = {self.default_speed}: must be in "
                             f"[0, max_speed = {self.limits.max_speed}] m/s (0 = the skills' "
                             "default)")
        if not self.temperature >= 0.0:
            raise ValueError(f"parameter 'temperature' = {self.temperature}: must be >= 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"parameter 'backend' = {self.backend!r}: must be one of "
                             f"{list(BACKENDS)}")
        if self.grammar_engine not in GRAMMAR_ENGINES:
            raise ValueError(f"parameter 'grammar_engine' = {self.grammar_engine!r}: must be one "
                             f"of {list(GRAMMAR_ENGINES)}")
        if self.backend == "hf":
            self._check_hf()
        if self.backend == "remote" and self.remote is None:
            raise ValueError("parameter 'remote.base_url' = '': backend 'remote' needs the "
                             "server URL, e.g. http://127.0.0.1:8000/v1")
        if self.remote_response_format not in OUTPUT_FORMATS:
            raise ValueError(f"parameter 'remote.response_format' = "
                             f"{self.remote_response_format!r}: must be one of "
                             f"{list(OUTPUT_FORMATS)}")
        if self.prefix_cache_entries < 0:
            raise ValueError(f"parameter 'prefix_cache_entries' = {self.prefix_cache_entries}: "
                             "must be >= 0")
        if self.speculative_k < 0 or self.speculative_k and self.backend not in (
                "generate", "engine"):
            raise ValueError(f"parameter 'speculative.k' = {self.speculative_k}: must be >= 0, "
                             f"and 0 with backend {self.backend!r} (speculative decoding runs "
                             "our VLM: backends generate and engine)")

    def _check_hf(self) -> None:
        path = self.hf_model_path
        if not path:
            raise ValueError("parameter 'hf.model_path' = '': backend 'hf' needs a local model "
                             "directory (save_pretrained output with config.json)")
        if not os.path.isdir(path):
            raise ValueError(f"parameter 'hf.model_path' = {path!r}: not a directory")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"parameter 'hf.model_path' = {path!r}: no config.json there "
                             "(a directory saved with save_pretrained is needed)")
        if self.hf_dtype not in DTYPES:
            raise ValueError(f"parameter 'hf.dtype' = {self.hf_dtype!r}: must be one of "
                             f"{list(DTYPES)}")
        if self.hf_tokenizer not in HF_TOKENIZERS:
            raise ValueError(f"parameter 'hf.tokenizer' = {self.hf_tokenizer!r}: must be one of "
                             f"{list(HF_TOKENIZERS)}")
        size = tuple(self.hf_warmup_image_size)
        if len(size) != 2 or min(size) < 0 or (min(size) == 0) != (max(size) == 0):
            raise ValueError(f"parameter 'hf.warmup_image_size' = {list(size)}: must be "
                             "[width, height] px, both > 0, or [0, 0] for none")


@dataclass
class PlanRequest:
    """image: uint8 [H, W, 3] RGB or None; max_steps 0 = the limits' max_steps."""

    instruction: str
    image: np.ndarray | None
    objects: Sequence[SceneObject]
    max_steps: int = 0
    on_token: OnToken | None = None
    should_cancel: Callable[[], bool] | None = None


@dataclass
class PlanResult:
    """plan None when the text did not parse, the request was cancelled or planning failed;
    report.accepted only for a plan that passed validation. error: planning failed without a
    reply (e.g. the server is unreachable): the node answers VALIDATION_ERROR with it.
    Times in s from the start of the call; text: the backend's raw text."""

    plan: Plan | None
    report: ValidationReport
    ttft_s: float
    total_s: float
    tokens: int
    text: str = ""
    cancelled: bool = False
    error: str = ""
    started: float | None = None  # time.monotonic() when its batch started (set by a caller)
    drafted: int = 0  # speculative decoding: draft tokens proposed / accepted (DecodeOutput)
    accepted: int = 0
    prefix_hit: bool | None = None  # the prefix cache's KV was reused (None: no cache)


def make_backend(config: PlannerConfig, model: torch.nn.Module | None = None) -> PlanBackend:
    """The backend named by config.backend (imports only what it needs)."""
    if config.backend in ("generate", "engine"):
        from kestrel_planner.core.backend_local import LocalVLMBackend
        return LocalVLMBackend(config, model)
    if model is not None:
        raise ValueError(f"parameter 'backend' = {config.backend!r}: a model object is only "
                         "used by the local backends (generate, engine)")
    if config.backend == "hf":
        from kestrel_planner.core.backend_hf import HFPlanBackend
        return HFPlanBackend(config)
    if config.backend == "plan_text":
        from kestrel_planner.core.backend_text import PlanTextBackend
        return PlanTextBackend()
    from kestrel_planner.core.backend_remote import RemotePlanBackend
    return RemotePlanBackend(config)


def check_image(k: int, image: object) -> None:
    if image is None:
        return
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 \
            or image.shape[2] != 3 or image.shape[0] < 1 or image.shape[1] < 1:
        desc = (f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray)
                else type(image).__name__)
        raise PlannerInputError(f"request {k}: image must be uint8 [H, W, 3], got {desc}")


class PlannerCore:
    def __init__(self, config: PlannerConfig, model: torch.nn.Module | None = None,
                 backend: PlanBackend | None = None) -> None:
        self.config = config
        self.validator = PlanValidator(config.limits)
        self.backend = backend if backend is not None else make_backend(config, model)
        # The local backends' model and tokenizer (None for hf/remote).
        self.model = getattr(self.backend, "model", None)
        self.tokenizer = getattr(self.backend, "tokenizer", None)
        self.graphs_at_configure = 0  # CUDA graphs captured before the first goal
        self.graphs_capture_s = 0.0  # and the time that took (compiles included)
        if config.warmup and self.backend.warmup:
            self.plan("warm up", np.zeros((32, 32, 3), np.uint8), [])
            warm = getattr(self.backend, "warm_graphs", None)
            if warm is not None:
                t0 = time.monotonic()
                self.graphs_at_configure = warm()
                self.graphs_capture_s = time.monotonic() - t0

    def close(self) -> None:
        self.backend.close()

    @staticmethod
    def scene_names(objects: Sequence[SceneObject]) -> list[str]:
        """Object names the grammar/schema may use: valid identifiers, de-duplicated, in order."""
        seen: dict[str, None] = {}
        for o in objects:
            if NAME_RE.match(o.name):
                seen.setdefault(o.name, None)
        return list(seen)

    def plan(self, instruction: str, image: np.ndarray | None, objects: Sequence[SceneObject],
             max_steps: int = 0, on_token: OnToken | None = None,
             should_cancel: Callable[[], bool] | None = None) -> PlanResult:
        return self.plan_batch([PlanRequest(instruction, image, objects, max_steps, on_token,
                                            should_cancel)])[0]

    def _job(self, k: int, r: PlanRequest) -> DecodeJob:
        if not isinstance(r.instruction, str) or not r.instruction.strip():
            raise PlannerInputError(f"request {k}: instruction must be a non-empty string")
        check_image(k, r.image)
        cap = self.config.limits.max_steps
        cap = min(cap, r.max_steps) if r.max_steps and r.max_steps > 0 else cap
        text = " ".join(r.instruction.split())[: self.config.max_instruction_chars]
        return DecodeJob(text, self.scene_names(r.objects), cap, r.image, r.on_token,
                         r.should_cancel)

    def plan_batch(self, requests: Sequence[PlanRequest]) -> list[PlanResult]:
        """Serve up to max_batch requests in one batched decode. PlannerInputError (naming the
        request index) if any request is malformed: nothing is decoded then."""
        t0 = time.monotonic()
        if not 1 <= len(requests) <= self.config.max_batch:
            raise PlannerInputError(f"{len(requests)} requests: must be 1..{self.config.max_batch}")
        jobs = [self._job(k, r) for k, r in enumerate(requests)]
        outputs = self.backend.decode(jobs)
        total = time.monotonic() - t0
        results = [self._result(r, j, o, total)
                   for r, j, o in zip(requests, jobs, outputs, strict=True)]
        for res, o in zip(results, outputs, strict=True):
            res.drafted, res.accepted, res.prefix_hit = o.drafted, o.accepted, o.prefix_hit
        return results

    def _result(self, r: PlanRequest, job: DecodeJob, o: DecodeOutput, total: float) -> PlanResult:
        """The same parse + validation for every backend's output."""
        if o.stop_reason == "cancelled":
            return PlanResult(None, ValidationReport(False, ["cancelled"]), o.ttft_s, total,
                              o.tokens, o.text, cancelled=True)
        if o.error:
            return PlanResult(None, ValidationReport(False, [o.error]), o.ttft_s, total,
                              o.tokens, o.text, error=o.error)
        if o.reject:
            return PlanResult(None, ValidationReport(False, [o.reject]), o.ttft_s, total,
                              o.tokens, o.text)
        try:
            plan = parse_plan(o.text, r.instruction, job.cap)
        except PlanParseError as exc:
            return PlanResult(None, ValidationReport(False, [f"parse error: {exc}"]), o.ttft_s,
                              total, o.tokens, o.text)
        if self.config.default_speed > 0.0:
            fill_defaults(plan, {"speed": self.config.default_speed})
        report = self.validator.validate(plan, r.objects, job.cap)
        return PlanResult(plan, report, o.ttft_s, total, o.tokens, o.text)
