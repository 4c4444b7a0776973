"""Backends 'generate' and 'engine': our own VLM (kestrel_models.planner) in this process.

prompt = fixed system prompt + the scene's object names + the instruction, byte tokens; then
decoding constrained to the plan grammar (only grammar-valid text, targets only from the scene)
by the engine of `grammar_engine`: 'llguidance' (constrained_llg.py, default) or 'automaton'
(constrained.py). 'generate': generate.py (right-padded batch per call, per-sequence
positions in the KV cache); 'engine': DecodeEngine (slots over a static KV cache, CUDA-graph
decode on GPU). Same prompt layout, same outputs. Not thread-safe: one caller at a time.

engine + prefix_cache_entries: the KV of [image][<bos> objects line] is kept per (image pixels
digest, object line), so a goal on the same frame and scene prefills only its task line.
speculative_k > 0 (either backend): SpeculativeDecoder replaces the decode loop; the draft is a
model of its own (draft_weights_path, preset draft_model) or the model's first draft_layers
layers; the grammar masks the draft's picks and the model's verification alike, so the plan
is the model's own (greedy) and each row reports its drafted and accepted tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kestrel_models.planner import ByteTokenizer, StreamDecoder, VisionLanguageModel, VLMConfig
from kestrel_models.planner import generate as generate_tokens
from kestrel_models.planner import get_config
from kestrel_models.planner.engine import DecodeEngine
from kestrel_models.planner.engine_request import pow2_ladder
from kestrel_models.planner.speculative import SpeculativeDecoder, truncated_draft
from kestrel_models.planner.vlm import bigram_state_dict
from kestrel_planner.core.backend import DecodeJob, DecodeOutput, PlannerInputError
from kestrel_planner.core.constrained import PlanGrammar, PlanLogitsProcessor
from kestrel_planner.core.constrained_llg import LLGuidancePlanProcessor, lltokenizer
from kestrel_planner.core.plan import PlanParseError, parse_plan

if TYPE_CHECKING:
    from kestrel_planner.core.planner_core import PlannerConfig

__all__ = ["LocalVLMBackend", "SYSTEM_PROMPT", "plain_prompt", "scene_prompt"]

# The longest prompt bucket captured at configure: a scene line of a few dozen objects and the
# task; a model whose context allows far longer prompts does not prefill them all at configure.
WARM_PROMPT_TOKENS = 512

# The chat backends' rules (prompting.py) are for general models. Models trained on the Kestrel
# layout learn the skills from their training pairs, so their prompt carries only the scene and
# the task: every prompt byte is a token that the small models attend over.
SYSTEM_PROMPT = ""


def scene_prompt(names: Sequence[str]) -> str:
    """The start of plain_prompt that depends on the scene only (kept by the prefix cache)."""
    return f"{SYSTEM_PROMPT}objects: {' '.join(names) or 'none'}\n"


def plain_prompt(instruction: str, names: Sequence[str]) -> str:
    """The prompt text of models trained on the Kestrel layout (no chat template)."""
    return f"{scene_prompt(names)}task: {instruction}\nplan:\n"


class LocalVLMBackend:
    warmup = True

    def __init__(self, config: PlannerConfig, model: torch.nn.Module | None = None) -> None:
        self.name = config.backend
        self.config = config
        self.tokenizer = ByteTokenizer()
        self._lltok = lltokenizer(self.tokenizer) if config.grammar_engine == "llguidance" else None
        cfg = config.model if isinstance(config.model, VLMConfig) else get_config(config.model)
        if cfg.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"parameter 'model' vocab_size {cfg.vocab_size} < tokenizer "
                             f"vocab {self.tokenizer.vocab_size}")
        self.model_config = cfg
        if model is None:
            torch.manual_seed(config.seed)
            model = VisionLanguageModel(cfg)
            if config.demo_plan:  # explicit demo weights win over a (default) weights file
                model.load_state_dict(self._demo_weights(cfg, config.demo_plan))
            elif config.weights_path:
                self._load(model, config.weights_path)
        self.model = model.to(config.device).eval()
        self._n_img = cfg.num_image_tokens
        self._reserve = 0  # positions past the plan budget that decoding needs
        self.engine: DecodeEngine | None = None
        self.spec: SpeculativeDecoder | None = None
        if config.speculative_k > 0:
            draft = self._draft(cfg)
            self._n_img = max(self._n_img, draft.cfg.num_image_tokens)
            self._reserve = config.speculative_k + 1
            self.spec = SpeculativeDecoder(self.model, draft, config.speculative_k,
                                           config.max_batch, cfg.max_seq_len,
                                           self.tokenizer.eos_id)
        elif config.backend == "engine":
            fast = config.engine_compile and str(config.device).startswith("cuda")
            self.engine = DecodeEngine(self.model, config.max_batch, cfg.max_seq_len,
                                       self.tokenizer.eos_id, compile_step=fast,
                                       coordinate_descent=fast,
                                       prefix_entries=config.prefix_cache_entries)
        else:
            self.model.setup_cache(config.max_batch, cfg.max_seq_len)

    def _draft(self, cfg: VLMConfig) -> VisionLanguageModel:
        """The speculative draft: weights of its own, or the model's first layers."""
        c = self.config
        if not c.draft_weights_path:
            if not 1 <= c.draft_layers < cfg.n_layers:
                raise ValueError(f"parameter 'speculative.draft_layers' = {c.draft_layers}: "
                                 f"must be < the model's {cfg.n_layers} decoder layers (or give "
                                 "speculative.draft_weights_path)")
            return truncated_draft(self.model, c.draft_layers)
        name = "speculative.draft_model_config"
        if isinstance(c.draft_model, VLMConfig):
            dcfg = c.draft_model
        else:
            try:
                dcfg = get_config(c.draft_model)
            except ValueError:
                raise ValueError(f"parameter '{name}' = {c.draft_model!r}: not a preset") from None
        if dcfg.vocab_size != cfg.vocab_size or dcfg.max_seq_len < cfg.max_seq_len:
            raise ValueError(f"parameter '{name}' = {c.draft_model!r}: the draft needs the "
                             f"model's vocabulary ({cfg.vocab_size}, has {dcfg.vocab_size}) "
                             f"and at least its max_seq_len ({cfg.max_seq_len}, has "
                             f"{dcfg.max_seq_len})")
        draft = VisionLanguageModel(dcfg)
        self._load(draft, c.draft_weights_path, "speculative.draft_weights_path", name)
        return draft.to(c.device).eval()

    @staticmethod
    def _load(model: torch.nn.Module, path: str, name: str = "weights_path",
              config_name: str = "model_config") -> None:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - missing, truncated, not a state dict, ...
            # the first line only: PyTorch's text goes on to suggest unsafe loading
            why = (str(exc).strip().splitlines() or [""])[0]
            if "weights_only" in why or not why:
                why = "not a state dict saved with torch.save"
            raise ValueError(f"parameter '{name}' = {path!r}: cannot load: "
                             f"{type(exc).__name__}: {why}") from None
        try:
            model.load_state_dict(state, strict=True)
        except (RuntimeError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"parameter '{name}' = {path!r}: cannot load: the file does "
                             f"not fit {config_name}: {exc}") from None

    def _demo_weights(self, cfg: VLMConfig, text: str) -> dict[str, torch.Tensor]:
        try:
            parse_plan(text)
        except PlanParseError as exc:
            raise ValueError(f"parameter 'demo_plan' = {text!r}: {exc}") from exc
        alphabet = self.tokenizer.encode("abcdefghijklmnopqrstuvwxyz0123456789_ =-.\n")
        # The prompt ends with a newline: lead with one so the first line is chosen from it.
        ids = self.tokenizer.encode("\n" + text)
        return bigram_state_dict(cfg, ids, self.tokenizer.eos_id, alphabet, self.config.seed)

    def close(self) -> None:
        pass

    # ---- CUDA graphs -----------------------------------------------------------------------
    def warm_graphs(self) -> int:
        """Capture now (at configure) the graphs that goals replay, so that no goal pays for
        a capture: the prefill of 1..max_batch goals with an image at each prompt bucket
        (powers of two from 16 up to the prompt room, at most WARM_PROMPT_TOKENS: a longer
        prompt's graph is captured when it comes), then the decode step (engine) or the
        speculative passes per batch and kv bucket up to what those prompts and the plan
        budget reach; with a prefix store, the prefill of a task line after a kept scene per
        slot, task-line bucket and kv bucket. Returns the graphs captured (0 without CUDA
        graphs: on the CPU)."""
        dec = self.spec if self.spec is not None else self.engine
        if dec is None or not dec.cuda_graph:
            return 0
        before = self.graph_count()
        cfg, s = self.config, self.model_config
        room = min(s.max_seq_len - self._n_img - cfg.max_new_tokens - self._reserve,
                   WARM_PROMPT_TOKENS)
        image = torch.zeros(3, s.image_size, s.image_size, dtype=torch.uint8,
                            device=cfg.device)
        length = 16
        while length <= room:
            prompt = self.tokenizer.encode("x" * (length - 1), add_bos=True)
            for n in range(1, cfg.max_batch + 1):  # one token: the prefill alone
                dec.generate([prompt] * n, 1, images=[image] * n)
            length *= 2
        # the positions those prompts reach: image + the longest prompt bucket captured
        # (length // 2: the loop ends one doubling past it) + the plan budget
        longest = min(self._n_img + max(16, length // 2) + cfg.max_new_tokens + self._reserve,
                      s.max_seq_len)
        kv_lens = pow2_ladder(128, longest)
        if self.spec is not None:
            self.spec.warmup(range(1, cfg.max_batch + 1), kv_lens)
            return self.graph_count() - before
        # the step samples on device where the temperature is > 0
        self.engine.warmup(range(1, cfg.max_batch + 1), kv_lens, cfg.temperature > 0)
        if self.engine.store.capacity > 0:  # prefix hits: the task line after a kept scene
            head = len(self.tokenizer.encode(scene_prompt([]), add_bos=True))
            rest = len(self.tokenizer.encode(plain_prompt("x" * cfg.max_instruction_chars,
                                                          []), add_bos=True)) - head
            self.engine.warmup_kept(pow2_ladder(16, rest), kv_lens, self._n_img + head)
        return self.graph_count() - before

    def graph_count(self) -> int:
        """CUDA graphs captured so far (prefill, decode step, speculative passes)."""
        dec = self.spec if self.spec is not None else self.engine
        return 0 if dec is None else dec.graph_count()

    # ---- prompt ----------------------------------------------------------------------------
    def build_prompt(self, instruction: str, names: Sequence[str]) -> list[int]:
        ids = self.tokenizer.encode(plain_prompt(instruction, names), add_bos=True)
        room = (self.model_config.max_seq_len - self._n_img - self.config.max_new_tokens
                - self._reserve)
        if len(ids) > room:
            raise PlannerInputError(f"prompt of {len(ids)} tokens exceeds the room of {room} "
                                    "(too many scene objects)")
        return ids

    def image_tensor(self, image: np.ndarray) -> torch.Tensor:
        """uint8 [H, W, 3] (checked by PlannerCore) -> uint8 [3, S, S] (resized)."""
        t = torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1)[None].float()
        s = self.model_config.image_size
        if t.shape[-2:] != (s, s):
            t = torch.nn.functional.interpolate(t, size=(s, s), mode="bilinear",
                                                align_corners=False, antialias=True)
        return t.round().clamp(0, 255).to(torch.uint8)[0]

    # ---- decoding --------------------------------------------------------------------------
    def processor(self, job: DecodeJob) -> LLGuidancePlanProcessor | PlanLogitsProcessor:
        """The plan-grammar logits processor of one job (engine per `grammar_engine`)."""
        n = self.config.max_new_tokens
        if self._lltok is not None:
            return LLGuidancePlanProcessor(self._lltok, job.names, job.cap, n)
        return PlanLogitsProcessor.for_tokenizer(PlanGrammar(job.names, job.cap), self.tokenizer, n)

    def decode(self, jobs: Sequence[DecodeJob]) -> list[DecodeOutput]:
        cfg = self.config
        prompts = [self.build_prompt(j.instruction, j.names) for j in jobs]
        procs = [self.processor(j) for j in jobs]
        images = [None if j.image is None else self.image_tensor(j.image) for j in jobs]
        streams = [StreamDecoder(self.tokenizer) for _ in jobs]
        counts = [0] * len(jobs)

        def on_token(row: int, tok: int) -> None:
            counts[row] += 1
            streams[row].push(tok)
            cb = jobs[row].on_token
            if cb is not None:
                cb(counts[row], streams[row].text)

        gen = torch.Generator().manual_seed(cfg.seed)
        stops = [j.should_cancel for j in jobs]
        dev_images = [None if im is None or self.spec is None and self.engine is None
                      else im.to(cfg.device) for im in images]
        if self.spec is not None:
            sres = self.spec.generate(prompts, cfg.max_new_tokens, images=dev_images,
                                      temperature=cfg.temperature, generator=gen,
                                      logits_processor=procs, on_token=on_token,
                                      should_stop=stops)
            return [DecodeOutput(self.tokenizer.decode(sres.tokens[k]), sres.stop_reasons[k],
                                 sres.ttft_rows[k], len(sres.tokens[k]),
                                 drafted=sres.drafted_rows[k], accepted=sres.accepted_rows[k])
                    for k in range(len(jobs))]
        keep = self.engine is not None and self.engine.store.capacity > 0
        if self.engine is not None:
            res = self.engine.generate(
                prompts, cfg.max_new_tokens, images=dev_images,
                temperature=cfg.temperature, logits_processor=procs, generator=gen,
                on_token=on_token, should_stop=stops,
                image_keys=[_digest(im) if keep and im is not None else None for im in images],
                prefix_tokens=[self._scene_tokens(j.names, p) if keep else 0
                               for j, p in zip(jobs, prompts, strict=True)])
        else:
            image, image_mask = None, None
            if any(im is not None for im in images):
                s = self.model_config.image_size
                blank = torch.zeros(3, s, s, dtype=torch.uint8)
                image = torch.stack([blank if im is None else im for im in images])
                image = image.to(cfg.device)
                image_mask = torch.tensor([im is not None for im in images])
            res = generate_tokens(
                self.model, prompts, self.tokenizer.eos_id, self.tokenizer.pad_id,
                cfg.max_new_tokens, image=image, image_mask=image_mask,
                temperature=cfg.temperature, generator=gen, logits_processor=procs,
                on_token=on_token, should_stop=stops)
        out = []
        for k in range(len(jobs)):
            ttft = res.ttft_rows[k] if k < len(res.ttft_rows) else res.ttft_s
            hit = res.prefix_hits[k] if k < len(res.prefix_hits) and keep else None
            out.append(DecodeOutput(self.tokenizer.decode(res.tokens[k]), res.stop_reasons[k],
                                    ttft, len(res.tokens[k]), prefix_hit=hit))
        return out

    def _scene_tokens(self, names: Sequence[str], prompt: list[int]) -> int:
        """Leading prompt tokens that depend on the scene only (0 if they do not tokenize
        as a prefix of the prompt)."""
        head = self.tokenizer.encode(scene_prompt(names), add_bos=True)
        return len(head) if prompt[:len(head)] == head and len(head) < len(prompt) else 0


def _digest(image: torch.Tensor) -> bytes:
    """The identity of a model-input image (uint8 [3, S, S] on the CPU): its pixels' digest."""
    return hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=16).digest()
