"""A Hugging Face checkpoint behind the planner's generation interface (hf.py's contract:
generate(prompts, eos_id, max_new_tokens, images, temperature, generator, logits_processor,
on_token, should_stop) -> GenerationResult), on the decode engine when the architecture is one
it runs, else on transformers.

`open_hf` returns (runner, note): note says which runs it and, for transformers, why the
engine does not (the caller logs it). Both runners give vocab_size, max_positions (positions a
request may take), image_tokens(shape) (positions one image of that shape takes),
image_marker (the token id where a prompt places its image; None: before the prompt) and
image_prompt_ids (the tokens one image takes in a prompt text).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from kestrel_models.planner.engine import DecodeEngine
from kestrel_models.planner.generate import GenerationResult, _per_row
from kestrel_models.planner.hf_engine import HFDecoder, HFLoadError, Unsupported, load

__all__ = ["EngineRunner", "open_hf", "MAX_LEN"]

MAX_LEN = 4096  # KV-cache positions per slot (capped by the model's max_position_embeddings)


class EngineRunner:
    """An HFDecoder on a DecodeEngine (max_batch slots of max_len positions). compile_step on
    CUDA: the whole decode step compiled (inductor, coordinate-descent tuned) in the graph."""

    kind = "engine"

    def __init__(self, dec: HFDecoder, eos_id: int, max_batch: int, max_len: int,
                 compile_step: bool = False, **engine_kw: Any) -> None:
        fast = compile_step and dec.device.type == "cuda"
        self.dec = dec
        self.engine = DecodeEngine(dec, max_batch, max_len, eos_id, compile_step=fast,
                                   coordinate_descent=fast, **engine_kw)
        self.eos_id = eos_id
        self.vocab_size = dec.cfg.vocab_size
        self.max_positions = max_len
        self.image_marker = dec.image_marker
        self.image_prompt_ids = list(dec.image_prompt_ids)

    def image_tokens(self, shape: tuple[int, ...]) -> int:
        return self.dec.image_tokens(tuple(shape))

    def generate(self, prompts: Sequence[Sequence[int]], eos_id: int, max_new_tokens: int,
                 images: Sequence[Tensor | None] | None = None, temperature: float = 0.0,
                 generator: torch.Generator | None = None, logits_processor: object = None,
                 on_token: Callable[[int, int], None] | None = None,
                 should_stop: object = None) -> GenerationResult:
        """hf.py's contract; the rows decode together (continuous batching)."""
        if eos_id != self.eos_id:
            raise ValueError(f"eos_id {eos_id}: this engine stops at {self.eos_id}")
        b = len(prompts)
        if b == 0 or any(len(p) == 0 for p in prompts):
            raise ValueError("generate() needs prompts of at least one token")
        return self.engine.generate(prompts, max_new_tokens, images=images,
                                    temperature=temperature,
                                    logits_processor=_per_row(logits_processor, b,
                                                              "logits_processor"),
                                    generator=generator, on_token=on_token,
                                    should_stop=_per_row(should_stop, b, "should_stop"))


def open_hf(path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
            eos_id: int = 0, max_batch: int = 4, compile_step: bool = False,
            tokenizer: Any = None, max_len: int = MAX_LEN) -> tuple[Any, str]:
    """(runner, note). The engine when `load` maps the checkpoint; transformers (hf.py) when
    it raises Unsupported (note: why); HFLoadError (a checkpoint that does not load, or an
    engine that cannot be built for it) and the transformers path's own errors propagate
    (ValueErrors naming hf.model_path)."""
    try:
        dec = load(path, device, dtype, tokenizer)
    except Unsupported as why:
        from kestrel_models.planner.hf import HFVisionLanguageModel
        vlm = HFVisionLanguageModel(path, device, dtype)
        return vlm, f"transformers, row by row (the engine does not run it: {why})"
    n = min(dec.cfg.max_seq_len, max_len)
    try:
        runner = EngineRunner(dec, eos_id, max_batch, n, compile_step)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory for the KV cache: say where
        raise HFLoadError(f"parameter 'hf.model_path' = {str(path)!r}: the decode engine for "
                          f"it could not be built ({max_batch} slots x {n} positions): "
                          f"{type(exc).__name__}: {exc}") from exc
    return runner, f"engine: {dec.describe()}; {max_batch} slots x {n} positions"
