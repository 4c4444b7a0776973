"""Engine request record and on-device sampling (used by engine.py; no rclpy)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["EngineRequest", "pow2_ladder", "LogitsProcessor", "greedy_pick", "sample_on_device",
           "two_stage_argmax", "GREEDY", "TWO_STAGE_MIN_VOCAB"]

# DecodeEngine(greedy=...): the all-greedy step's pick
GREEDY = ("argmax", "two_stage", "auto")
# greedy='auto': two_stage from this vocabulary size up (inductor reduces a whole row of the
# argmax in one program), argmax below it
TWO_STAGE_MIN_VOCAB = 32768

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


def _block(v: int) -> int:
    """The divisor of v closest to sqrt(v) (block length of the two-stage argmax)."""
    r = int(v ** 0.5)
    for d in range(0, r + 1):
        for c in (r - d, r + d):
            if 1 <= c <= v and v % c == 0:
                return c
    return v


def two_stage_argmax(logits: Tensor) -> Tensor:
    """logits [B, V] -> argmax ids [B] long, as torch.argmax (first index among equal
    maxima): a max over [B, V / n, n] blocks (many parallel reductions), then the argmax of
    the B x V / n block maxima; n = the divisor of V closest to sqrt(V) (151,936 -> 1,187)."""
    b, v = logits.shape
    n = _block(v)
    m, i = logits.view(b, v // n, n).max(dim=-1)  # [B, V / n]: block max, its first index
    j = torch.argmax(m, dim=-1, keepdim=True)  # [B, 1]: the first block holding the max
    return (j * n + i.gather(1, j))[:, 0]


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
    # reusable prefix (DecodeEngine prefix_entries): the image's identity (e.g. a digest of
    # its pixels; None: an image prefix is not kept) and the prompt tokens that belong to it
    image_key: Hashable | None = None
    prefix_tokens: int = 0
    prefix_hit: bool = False  # set: the prefix's KV came from the store
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


def pow2_ladder(first: int, last: int) -> list[int]:
    """Lengths first, 2 first, 4 first, ... below last, then last: one per power-of-two
    bucket up to last's (the lengths a warm-up captures graphs for)."""
    out = []
    while first < last:
        out.append(first)
        first *= 2
    return out + [last]
