"""A Hugging Face image-text-to-text model from a LOCAL directory behind the planner's
generation interface (the generate.py contract: per-row logits_processor, on_token,
should_stop, greedy or seeded temperature sampling, the same stop reasons).

Loads with `AutoModelForImageTextToText.from_pretrained(path, local_files_only=True)`: nothing
is downloaded; any failure while loading is a ValueError naming 'hf.model_path' and the cause.
The planner's hf backend runs the families of hf_engine/ on the decode engine; this is its
transformers fallback. Supported: LLaVA-style models whose config gives `image_token_id` and a
CLIP-like `vision_config` (image_size, patch_size; `vision_feature_select_strategy` 'default'
drops the CLS token, 'full' keeps it); the number of image placeholder tokens is
(image_size / patch_size)^2 (+1 for 'full'), else `config.image_seq_length`. Families whose
image inputs differ (NEEDS_ENGINE: tiles, pixel shuffle, patch lists) are refused here.
Images: uint8 [3, H, W] -> resized (bilinear, antialias) to image_size, scaled to [0, 1] and
normalised with the directory's preprocessor_config.json mean/std (CLIP's when absent).
Prompts are token ids of the model's own tokenizer (the caller's concern, as with our VLM).
Decoding: one prefill, then one cached forward per token (past_key_values), row by row.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from kestrel_models.planner.generate import GenerationResult, _per_row, _pick

__all__ = ["HFVisionLanguageModel", "DTYPES", "parse_dtype"]

# hf_dtype parameter -> torch dtype ('auto': the checkpoint's own, as saved)
DTYPES: dict[str, torch.dtype | None] = {"auto": None, "float32": torch.float32,
                                         "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype | None:
    """'bfloat16' -> torch.bfloat16 ('auto' -> None); ValueError naming 'hf.dtype'."""
    if name not in DTYPES:
        raise ValueError(f"parameter 'hf.dtype' = {name!r}: must be one of {list(DTYPES)}")
    return DTYPES[name]

# image inputs this path cannot build (the engine's family modules do: hf_engine/)
NEEDS_ENGINE = ("llava_next", "idefics3", "smolvlm", "qwen2_vl", "qwen2_5_vl")
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class HFVisionLanguageModel:
    kind = "transformers"
    image_marker: int | None = None  # the image tokens go before the prompt
    image_prompt_ids: list[int] = []

    def __init__(self, path: str | Path, device: str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        p = Path(path)
        if not (p / "config.json").is_file():
            raise ValueError(f"parameter 'hf.model_path' = {str(path)!r}: no config.json there "
                             "(a local directory saved with save_pretrained is needed)")
        try:
            from transformers import AutoModelForImageTextToText
        except ImportError as exc:
            raise ValueError("parameter 'hf.model_path' is set but transformers is not "
                             "installed") from exc
        where = f"parameter 'hf.model_path' = {str(path)!r}"
        try:
            mt = json.loads((p / "config.json").read_text()).get("model_type")
        except Exception as exc:  # noqa: BLE001 - unreadable or not JSON
            raise ValueError(f"{where}: cannot read config.json: {type(exc).__name__}: "
                             f"{exc}") from exc
        if mt in NEEDS_ENGINE:
            raise ValueError(f"{where}: model_type {mt!r} needs the decode engine's image "
                             "inputs; the transformers path runs LLaVA-style checkpoints only")
        try:
            kw = {"dtype": dtype} if dtype is not None else {}
            model = AutoModelForImageTextToText.from_pretrained(str(p), local_files_only=True,
                                                                **kw)
        except Exception as exc:  # noqa: BLE001 - whatever the loader raises, say what
            why = (str(exc).strip().splitlines() or [""])[0][:400]
            raise ValueError(f"{where}: cannot load: {type(exc).__name__}: {why}") from exc
        self.model = model.to(device).eval()
        self.device = torch.device(device)
        cfg = model.config
        self.image_token_id = getattr(cfg, "image_token_id", None)
        vc = getattr(cfg, "vision_config", None)
        if (self.image_token_id is None or vc is None or not getattr(vc, "image_size", None)):
            raise ValueError(f"{where}: {type(cfg).__name__} has no image_token_id or no "
                             "vision_config.image_size (the transformers path runs "
                             "LLaVA-style checkpoints only)")
        self.image_size = int(vc.image_size)
        if getattr(vc, "patch_size", None):
            n = (vc.image_size // vc.patch_size) ** 2
            n += int(getattr(cfg, "vision_feature_select_strategy", "default") == "full")
        else:
            n = getattr(cfg, "image_seq_length", 0)
        self.num_image_tokens = int(n)
        tc = getattr(cfg, "text_config", cfg)
        self.vocab_size = int(getattr(tc, "vocab_size", 0) or 0)  # output logits width
        self.max_positions = int(getattr(tc, "max_position_embeddings", 0) or 0)  # 0: unknown
        mean, std = CLIP_MEAN, CLIP_STD
        pre = p / "preprocessor_config.json"
        if pre.is_file():
            pc = json.loads(pre.read_text())
            mean, std = pc.get("image_mean", mean), pc.get("image_std", std)
        # transformers >= 5.2x names the cache argument `cache` (`past_key_values` before).
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._mean = torch.tensor(mean, device=self.device).view(1, 3, 1, 1)
        self._std = torch.tensor(std, device=self.device).view(1, 3, 1, 1)

    def image_tokens(self, shape: tuple[int, ...]) -> int:
        """Image placeholder tokens of one image (any shape: it is resized)."""
        return self.num_image_tokens

    def pixel_values(self, image: Tensor) -> Tensor:
        """uint8 [3, H, W] -> normalised float [1, 3, S, S] in the model's dtype."""
        if image.ndim != 3 or image.shape[0] != 3 or image.dtype != torch.uint8:
            raise ValueError(f"image must be uint8 [3, H, W], got {image.dtype} "
                             f"{tuple(image.shape)}")
        x = image[None].to(self.device).float() / 255.0
        s = self.image_size
        if x.shape[-2:] != (s, s):
            x = F.interpolate(x, size=(s, s), mode="bilinear", align_corners=False,
                              antialias=True)
        dtype = next(self.model.parameters()).dtype
        return ((x - self._mean) / self._std).to(dtype)

    def input_ids(self, prompt: Sequence[int], with_image: bool) -> Tensor:
        ids = ([self.image_token_id] * self.num_image_tokens if with_image else []) + list(prompt)
        return torch.tensor([ids], dtype=torch.long, device=self.device)

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], eos_id: int, max_new_tokens: int,
                 images: Sequence[Tensor | None] | None = None, temperature: float = 0.0,
                 generator: torch.Generator | None = None,
                 logits_processor: object = None,
                 on_token: Callable[[int, int], None] | None = None,
                 should_stop: object = None) -> GenerationResult:
        """Same contract as generate.generate (rows decoded one after another)."""
        t0 = time.monotonic()
        b = len(prompts)
        if b == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs prompts of at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
        procs = _per_row(logits_processor, b, "logits_processor")
        stops = _per_row(should_stop, b, "should_stop")
        imgs = list(images) if images is not None else [None] * b
        out: list[list[int]] = [[] for _ in range(b)]
        reasons = [""] * b
        ttft_rows = [0.0] * b
        steps = 0
        for i in range(b):
            kw = {}
            if imgs[i] is not None:
                kw["pixel_values"] = self.pixel_values(imgs[i])
            res = self.model(input_ids=self.input_ids(prompts[i], imgs[i] is not None),
                             use_cache=True, **kw)
            while True:
                row = res.logits[0, -1].float().cpu()
                if stops[i] is not None and stops[i]():
                    reasons[i] = "cancelled"
                    break
                if procs[i] is not None:
                    row = procs[i](out[i], row)
                    if not torch.isfinite(row).any():
                        reasons[i] = "no_allowed_token"
                        break
                tok = _pick(row, temperature, generator)
                if not out[i] and not ttft_rows[i]:
                    ttft_rows[i] = time.monotonic() - t0
                if tok == eos_id:
                    reasons[i] = "eos"
                    break
                out[i].append(tok)
                if on_token is not None:
                    on_token(i, tok)
                if len(out[i]) >= max_new_tokens:
                    reasons[i] = "max_new_tokens"
                    break
                # Newer outputs name it `cache` (reading `past_key_values` there only warns).
                cache = res.cache if self._cache_kw == "cache" else res.past_key_values
                res = self.model(input_ids=torch.tensor([[tok]], device=self.device),
                                 use_cache=True, **{self._cache_kw: cache})
                steps += 1
        ttft = min(t for t in ttft_rows if t) if any(ttft_rows) else 0.0
        return GenerationResult(out, reasons, ttft, time.monotonic() - t0, steps, ttft_rows)
