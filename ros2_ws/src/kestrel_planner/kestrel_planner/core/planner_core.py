"""PlannerCore: instruction + image + scene objects -> validated plan, with the VLM in the loop.

prompt = fixed system prompt + the scene's object names + the instruction (data, never rules),
then constrained greedy decoding (constrained.py: only grammar-valid text, targets only from
the scene), parse (plan.py), validate (validator.py). Determinism comes from the seed (random
tiny weights) and greedy decoding. `plan_batch` decodes several requests in one batch (right
padding, per-sequence positions in the KV cache). Not thread-safe: one caller at a time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kestrel_models.planner import ByteTokenizer, StreamDecoder, VisionLanguageModel, VLMConfig
from kestrel_models.planner import generate as generate_tokens
from kestrel_models.planner import get_config
from kestrel_models.planner.engine import DecodeEngine
from kestrel_models.planner.vlm import bigram_state_dict
from kestrel_planner.core.constrained import PlanGrammar, PlanLogitsProcessor
from kestrel_planner.core.plan import Plan, PlanParseError, SceneObject, parse_plan
from kestrel_planner.core.skills import NAME_RE
from kestrel_planner.core.validator import PlanLimits, PlanValidator, ValidationReport

__all__ = ["PlannerConfig", "PlanRequest", "PlanResult", "PlannerCore", "PlannerInputError",
           "SYSTEM_PROMPT"]

SYSTEM_PROMPT = ("You are a robot task planner. Skills: move_to pick place push open_gripper "
                 "close_gripper home. One step per line, then end.\n")

BACKENDS = ("generate", "engine")
OnToken = Callable[[int, str], None]  # (tokens generated so far, partial text)


class PlannerInputError(ValueError):
    """A request the planner cannot serve (bad image, bad instruction); the node reports it as
    VALIDATION_ERROR."""


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
    warmup: bool = True
    # 'generate': generate.py (static batch per call); 'engine': DecodeEngine (slots over a
    # static KV cache, CUDA-graph decode on GPU). Same prompt layout, same outputs.
    backend: str = "generate"

    def __post_init__(self) -> None:
        if self.max_new_tokens < 3:
            raise ValueError(f"parameter 'max_new_tokens' = {self.max_new_tokens}: must be >= 3")
        if self.max_batch < 1:
            raise ValueError(f"parameter 'max_batch' = {self.max_batch}: must be >= 1")
        if self.max_instruction_chars < 1:
            raise ValueError(f"parameter 'max_instruction_chars' = "
                             f"{self.max_instruction_chars}: must be >= 1")
        if not self.temperature >= 0.0:
            raise ValueError(f"parameter 'temperature' = {self.temperature}: must be >= 0")
        if self.backend not in BACKENDS:
            raise ValueError(f"parameter 'backend' = {self.backend!r}: must be one of "
                             f"{list(BACKENDS)}")


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
    """plan None when the text did not parse or the request was cancelled; report.accepted
    only for a plan that passed validation. Times in s from the start of the call."""

    plan: Plan | None
    report: ValidationReport
    ttft_s: float
    total_s: float
    tokens: int
    text: str = ""
    cancelled: bool = False


class PlannerCore:
    def __init__(self, config: PlannerConfig, model: torch.nn.Module | None = None) -> None:
        self.config = config
        self.tokenizer = ByteTokenizer()
        self.validator = PlanValidator(config.limits)
        cfg = config.model if isinstance(config.model, VLMConfig) else get_config(config.model)
        if cfg.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"parameter 'model' vocab_size {cfg.vocab_size} < tokenizer "
                             f"vocab {self.tokenizer.vocab_size}")
        self.model_config = cfg
        if model is None:
            torch.manual_seed(config.seed)
            model = VisionLanguageModel(cfg)
            if config.weights_path:
                self._load(model, config.weights_path)
            elif config.demo_plan:
                model.load_state_dict(self._demo_weights(cfg, config.demo_plan))
        self.model = model.to(config.device).eval()
        self._n_img = cfg.num_image_tokens
        self.engine: DecodeEngine | None = None
        if config.backend == "engine":
            self.engine = DecodeEngine(self.model, config.max_batch, cfg.max_seq_len,
                                       self.tokenizer.eos_id)
        else:
            self.model.setup_cache(config.max_batch, cfg.max_seq_len)
        if config.warmup:
            self.plan("warm up", np.zeros((cfg.image_size, cfg.image_size, 3), np.uint8), [])

    @staticmethod
    def _load(model: torch.nn.Module, path: str) -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            model.load_state_dict(state, strict=True)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ValueError(f"parameter 'weights_path' = {path!r}: cannot load: {exc}") from exc

    def _demo_weights(self, cfg: VLMConfig, text: str) -> dict[str, torch.Tensor]:
        try:
            parse_plan(text)
        except PlanParseError as exc:
            raise ValueError(f"parameter 'demo_plan' = {text!r}: {exc}") from exc
        alphabet = self.tokenizer.encode("abcdefghijklmnopqrstuvwxyz0123456789_ =-.\n")
        # The prompt ends with a newline: lead with one so the first line is chosen from it.
        ids = self.tokenizer.encode("\n" + text)
        return bigram_state_dict(cfg, ids, self.tokenizer.eos_id, alphabet, self.config.seed)

    # ---- prompt ----------------------------------------------------------------------------
    @staticmethod
    def scene_names(objects: Sequence[SceneObject]) -> list[str]:
        """Object names the grammar may use: valid identifiers, de-duplicated, in order."""
        seen: dict[str, None] = {}
        for o in objects:
            if NAME_RE.match(o.name):
                seen.setdefault(o.name, None)
        return list(seen)

    def build_prompt(self, instruction: str, names: Sequence[str]) -> list[int]:
        text = " ".join(instruction.split())[: self.config.max_instruction_chars]
        prompt = (f"{SYSTEM_PROMPT}objects: {' '.join(names) or 'none'}\n"
                  f"task: {text}\nplan:\n")
        ids = self.tokenizer.encode(prompt, add_bos=True)
        room = self.model_config.max_seq_len - self._n_img - self.config.max_new_tokens
        if len(ids) > room:
            raise PlannerInputError(f"prompt of {len(ids)} tokens exceeds the room of {room} "
                                    "(too many scene objects)")
        return ids

    def _image_tensor(self, image: np.ndarray) -> torch.Tensor:
        """uint8 [H, W, 3] -> uint8 [3, S, S] (resized to the model's image size)."""
        if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 \
                or image.shape[2] != 3 or image.shape[0] < 1 or image.shape[1] < 1:
            desc = (f"{image.dtype} {image.shape}" if isinstance(image, np.ndarray)
                    else type(image).__name__)
            raise PlannerInputError(f"image must be uint8 [H, W, 3], got {desc}")
        t = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float()
        s = self.model_config.image_size
        if t.shape[-2:] != (s, s):
            t = torch.nn.functional.interpolate(t, size=(s, s), mode="bilinear",
                                                align_corners=False, antialias=True)
        return t.round().clamp(0, 255).to(torch.uint8)[0]

    # ---- planning --------------------------------------------------------------------------
    def plan(self, instruction: str, image: np.ndarray | None, objects: Sequence[SceneObject],
             max_steps: int = 0, on_token: OnToken | None = None,
             should_cancel: Callable[[], bool] | None = None) -> PlanResult:
        return self.plan_batch([PlanRequest(instruction, image, objects, max_steps, on_token,
                                            should_cancel)])[0]

    def plan_batch(self, requests: Sequence[PlanRequest]) -> list[PlanResult]:
        """Serve up to max_batch requests in one batched decode. PlannerInputError (naming the
        request index) if any request is malformed: nothing is decoded then."""
        t0 = time.monotonic()
        if not 1 <= len(requests) <= self.config.max_batch:
            raise PlannerInputError(f"{len(requests)} requests: must be 1..{self.config.max_batch}")
        prompts, procs, images, names_all, caps = [], [], [], [], []
        for k, r in enumerate(requests):
            if not isinstance(r.instruction, str) or not r.instruction.strip():
                raise PlannerInputError(f"request {k}: instruction must be a non-empty string")
            names = self.scene_names(r.objects)
            cap = self.config.limits.max_steps
            cap = min(cap, r.max_steps) if r.max_steps and r.max_steps > 0 else cap
            prompts.append(self.build_prompt(r.instruction, names))
            grammar = PlanGrammar(names, cap)
            procs.append(PlanLogitsProcessor.for_tokenizer(grammar, self.tokenizer,
                                                           self.config.max_new_tokens))
            images.append(None if r.image is None else self._image_tensor(r.image))
            names_all.append(names)
            caps.append(cap)
        image, image_mask = None, None
        if any(im is not None for im in images):
            s = self.model_config.image_size
            blank = torch.zeros(3, s, s, dtype=torch.uint8)
            image = torch.stack([blank if im is None else im for im in images])
            image = image.to(self.config.device)
            image_mask = torch.tensor([im is not None for im in images])

        streams = [StreamDecoder(self.tokenizer) for _ in requests]
        counts = [0] * len(requests)

        def on_token(row: int, tok: int) -> None:
            counts[row] += 1
            streams[row].push(tok)
            cb = requests[row].on_token
            if cb is not None:
                cb(counts[row], streams[row].text)

        gen = torch.Generator().manual_seed(self.config.seed)
        if self.engine is not None:
            res = self.engine.generate(
                prompts, self.config.max_new_tokens,
                images=[None if im is None else im.to(self.config.device) for im in images],
                temperature=self.config.temperature, logits_processor=procs, generator=gen,
                on_token=on_token, should_stop=[r.should_cancel for r in requests])
        else:
            res = generate_tokens(
                self.model, prompts, self.tokenizer.eos_id, self.tokenizer.pad_id,
                self.config.max_new_tokens, image=image, image_mask=image_mask,
                temperature=self.config.temperature, generator=gen, logits_processor=procs,
                on_token=on_token, should_stop=[r.should_cancel for r in requests])
        total = time.monotonic() - t0
        out = []
        for k, r in enumerate(requests):
            text = self.tokenizer.decode(res.tokens[k])
            ttft = res.ttft_rows[k] if k < len(res.ttft_rows) else res.ttft_s
            if res.stop_reasons[k] == "cancelled":
                out.append(PlanResult(None, ValidationReport(False, ["cancelled"]), ttft, total,
                                      len(res.tokens[k]), text, cancelled=True))
                continue
            try:
                plan = parse_plan(text, r.instruction)
            except PlanParseError as exc:
                out.append(PlanResult(None, ValidationReport(False, [f"parse error: {exc}"]),
                                      ttft, total, len(res.tokens[k]), text))
                continue
            report = self.validator.validate(plan, r.objects, caps[k])
            out.append(PlanResult(plan, report, ttft, total, len(res.tokens[k]), text))
        return out
