"""Engine request record and on-device sampling (used by engine.py; no rclpy)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["EngineRequest", "LogitsProcessor", "greedy_pick", "sample_on_device"]

LogitsProcessor = Callable[[list[int], Tensor], Tensor]


def sample_on_device(logits: Tensor, temperature: Tensor, noise: Tensor | None = None) -> Tensor:
    """logits [B, V] float, temperature [B] float (0 = greedy) -> token ids [B] long.
    Gumbel-max: argmax(logits / T + G) is a sample of softmax(logits / T). noise: uniform
    [B, V] drawn by the caller (None: drawn here; all-greedy callers may pass zeros)."""
    t = temperature[:, None]
    u = (torch.rand_like(logits) if noise is None else noise).clamp(1e-20, 1.0)
    gumbel = -torch.log(-torch.log(u))
    scores = torch.where(t > 0, logits / t.clamp_min(1e-6) + gumbel, logits)
    return torch.argmax(scores, dim=-1)


def greedy_pick(logits: Tensor) -> Tensor:
    """logits [B, V] -> argmax ids [B] (the all-greedy decode step's sampling)."""
    return torch.argmax(logits, dim=-1)


@dataclass
class EngineRequest:
    """One sequence. tokens: generated ids (<eos> excluded); stop_reason '' while running."""

    prompt: list[int]
    max_new_tokens: int
    image: Tensor | None = None  # [3, H, W] uint8
    temperature: float = 0.0
    logits_processor: LogitsProcessor | None = None
    generator: torch.Generator | None = None
    on_token: Callable[[int], None] | None = None
    should_stop: Callable[[], bool] | None = None
    tokens: list[int] = field(default_factory=list)
    stop_reason: str = ""
    slot: int = -1
    t_submit: float = 0.0
    ttft_s: float = 0.0
    t_done: float = 0.0


def _pow2_at_least(n: int, lo: int, hi: int) -> int:
    b = lo
    while b < n:
        b *= 2
    return min(b, hi)
