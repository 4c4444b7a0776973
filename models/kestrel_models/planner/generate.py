"""Batched autoregressive generation with the VLM's KV cache.

One prefill over right-padded prompts, then one `decode_step` per new token for all rows.
Per row: greedy (temperature 0) or temperature sampling from a seeded torch.Generator, an
optional `logits_processor(prefix_tokens, logits) -> logits` (prefix_tokens = the tokens this
row generated so far, logits [vocab] float; constrained decoding masks with -inf), stop on
<eos>, max_new_tokens or should_stop(); `on_token(row, token_id)` streams every new token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from collections.abc import Callable, Sequence
from typing import Optional, Union

import torch
from torch import Tensor

__all__ = ["GenerationResult", "generate", "LogitsProcessor"]

LogitsProcessor = Callable[[list[int], Tensor], Tensor]
StopFn = Callable[[], bool]


@dataclass
class GenerationResult:
    """tokens[b]: generated ids of row b (the <eos> excluded); stop_reasons[b] in
    {'eos', 'max_new_tokens', 'cancelled', 'no_allowed_token'}; times in s (monotonic)."""

    tokens: list[list[int]]
    stop_reasons: list[str]
    ttft_s: float
    total_s: float
    steps: int = 0
    ttft_rows: list[float] = field(default_factory=list)
    prefix_hits: list[bool] = field(default_factory=list)  # DecodeEngine: prefix reused, per row


def _per_row(value: object, b: int, name: str) -> list:
    if value is None or callable(value):
        return [value] * b
    rows = list(value)  # type: ignore[arg-type]
    if len(rows) != b:
        raise ValueError(f"{name}: {len(rows)} entries for a batch of {b}")
    return rows


def _pick(logits: Tensor, temperature: float, gen: Optional[torch.Generator]) -> int:
    """logits [vocab] -> token id."""
    if temperature <= 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


def generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], eos_id: int, pad_id: int,
             max_new_tokens: int, image: Tensor | None = None,
             image_mask: Tensor | None = None, temperature: float = 0.0,
             generator: torch.Generator | None = None,
             logits_processor: Union[LogitsProcessor, Sequence[Optional[LogitsProcessor]],
                                     None] = None,
             on_token: Callable[[int, int], None] | None = None,
             should_stop: Union[StopFn, Sequence[Optional[StopFn]], None] = None,
             ) -> GenerationResult:
    """prompts: B token lists (each >= 1 token); image [B,3,H,W] uint8 or None."""
    t0 = time.monotonic()
    b = len(prompts)
    if b == 0:
        raise ValueError("generate() needs at least one prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens}: must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    procs = _per_row(logits_processor, b, "logits_processor")
    stops = _per_row(should_stop, b, "should_stop")
    dev = next(iter(model.parameters()), torch.empty(0)).device
    t = max(len(p) for p in prompts)
    toks = torch.full((b, t), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        toks[i, :len(p)] = torch.as_tensor(list(p), dtype=torch.long)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=dev)
    logits = model.prefill(image, toks.to(dev), lengths, image_mask)  # [B, T, V]
    last = logits[torch.arange(b, device=dev), lengths - 1].float().cpu()  # [B, V]

    out: list[list[int]] = [[] for _ in range(b)]
    reasons: list[str] = [""] * b
    ttft_rows = [0.0] * b
    ttft = 0.0
    step = 0
    feed = torch.full((b, 1), pad_id, dtype=torch.long)
    while True:
        for i in range(b):
            if reasons[i]:
                continue
            if stops[i] is not None and stops[i]():
                reasons[i] = "cancelled"
                continue
            row = last[i]
            if procs[i] is not None:
                row = procs[i](out[i], row)
                if not torch.isfinite(row).any():
                    reasons[i] = "no_allowed_token"
                    continue
            tok = _pick(row, temperature, generator)
            if step == 0:
                ttft_rows[i] = time.monotonic() - t0
                ttft = ttft or ttft_rows[i]
            if tok == eos_id:
                reasons[i] = "eos"
                continue
            out[i].append(tok)
            feed[i, 0] = tok
            if on_token is not None:
                on_token(i, tok)
            if len(out[i]) >= max_new_tokens:
                reasons[i] = "max_new_tokens"
        step += 1
        if all(reasons):
            break
        # Finished rows keep decoding their last token (cheap, output ignored): one batch shape.
        last = model.decode_step(feed.to(dev))[:, -1].float().cpu()
    return GenerationResult(out, reasons, ttft, time.monotonic() - t0, step, ttft_rows)
