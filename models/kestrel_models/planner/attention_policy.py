"""Decode-time attention policies: dense, local+global sparse, and H2O KV-cache eviction.

Both non-dense policies attend a STATIC-SIZE key set per (row, kv head), gathered from the
slot-addressed cache (kvmodel.KVModel), so a step costs K keys instead of kv_len, whatever the
sequence length (keys are cached after RoPE, so their order in the gathered set is irrelevant):

- local_global (attention sinks / system prompt + sliding window, StreamingLLM-style): keys
  [0, n_global) and the last `window` positions (p - window, p]; K = n_global + window.
  Exact (the same keys as dense) while p < n_global + window.
- h2o (Zhang et al. 2023, "Heavy-Hitter Oracle"): per (row, layer, kv head) an accumulated
  attention mass over positions (prefill: column sums of the prompt's attention; decode: each
  step's probabilities, summed over the group's query heads); a step attends the `recent`
  newest positions plus the highest-mass older positions that are still alive, K = budget keys.
  A position left out once is evicted for good (alive = False). Exact while p + 1 <= budget.

Shapes: pos [B] long (the query position), cache k, v [B, Hkv, max_len, hd], score [B, Hkv, L]
float32, alive [B, Hkv, L] bool (L = the kv-length bucket).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["AttentionPolicy", "local_global_index", "h2o_select", "h2o_update",
           "attend_gathered", "column_mass"]

MODES = ("dense", "local_global", "h2o")


@dataclass(frozen=True)
class AttentionPolicy:
    """mode: 'dense' | 'local_global' | 'h2o'. Counts in positions (tokens)."""

    mode: str = "dense"
    n_global: int = 64  # local_global: always-attended first positions (sinks, system prompt)
    window: int = 128  # local_global: most recent positions attended
    budget: int = 256  # h2o: keys kept per (row, layer, kv head)
    recent: int = 64  # h2o: newest positions always kept (part of the budget)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"parameter 'attention' = {self.mode!r}: must be one of {MODES}")
        for name in ("n_global", "window", "budget", "recent"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"parameter '{name}' = {v!r}: must be an integer >= 0")
        if self.mode == "local_global" and self.window < 1:
            raise ValueError(f"parameter 'window' = {self.window}: must be >= 1")
        if self.mode == "h2o" and not 1 <= self.recent <= self.budget:
            raise ValueError(f"parameter 'recent' = {self.recent}: must be in "
                             f"[1, budget = {self.budget}]")

    @property
    def keys(self) -> int:
        """Static key-set size of one decode step (0 for dense: kv_len keys)."""
        return {"dense": 0, "local_global": self.n_global + self.window,
                "h2o": self.budget}[self.mode]


def local_global_index(pos: Tensor, n_global: int, window: int) -> tuple[Tensor, Tensor]:
    """pos [B] -> (idx [B, K] long, valid [B, K] bool), K = n_global + window. Window entries
    that fall inside the global block (or before 0) are invalid: no key is counted twice."""
    dev = pos.device
    g = torch.arange(n_global, device=dev).expand(pos.shape[0], n_global)
    w = pos[:, None] - window + 1 + torch.arange(window, device=dev)  # [B, W], <= pos
    idx = torch.cat([g, w.clamp_min(0)], dim=1)
    valid = torch.cat([g <= pos[:, None], w >= n_global], dim=1)
    return idx, valid


def h2o_select(score: Tensor, alive: Tensor, pos: Tensor, budget: int,
               recent: int) -> tuple[Tensor, Tensor]:
    """score [B, Hkv, L], alive [B, Hkv, L], pos [B] -> (idx, valid) [B, Hkv, K], K =
    min(budget, L): the `recent` newest positions, then the heaviest alive older ones."""
    L = score.shape[-1]
    ar = torch.arange(L, device=score.device)
    p = pos[:, None, None]
    filled = ar <= p  # [B, 1, L]
    is_recent = filled & (ar > p - recent)
    cand = torch.where(filled & alive, score, float("-inf"))
    cand = torch.where(is_recent, torch.finfo(torch.float32).max, cand)
    val, idx = cand.topk(min(budget, L), dim=-1, sorted=False)
    return idx, val > float("-inf")


def h2o_update(score: Tensor, alive: Tensor, pos: Tensor, idx: Tensor, valid: Tensor,
               mass: Tensor) -> None:
    """In place: positions <= pos not in idx die; score += this step's mass [B, Hkv, K]."""
    L = score.shape[-1]
    ar = torch.arange(L, device=score.device)
    filled = ar <= pos[:, None, None]
    sel = torch.zeros_like(alive).scatter_(-1, idx, valid)
    alive.copy_(torch.where(filled, sel & alive, alive))
    score.scatter_add_(-1, idx, torch.where(valid, mass, 0.0))


def attend_gathered(q: Tensor, kc: Tensor, vc: Tensor, idx: Tensor,
                    valid: Tensor) -> tuple[Tensor, Tensor]:
    """q [B, 1, H, hd] (pre-scaled), kc, vc [B, Hkv, max_len, hd], idx, valid [B, Hkv, K]
    -> (out [B, 1, H * hd], mass [B, Hkv, K] float32: probabilities summed over the group)."""
    b, _, h, hd = q.shape
    hkv, kk_n = kc.shape[1], idx.shape[-1]
    gi = idx[..., None].expand(b, hkv, kk_n, hd)
    kk, vv = kc.gather(2, gi), vc.gather(2, gi)  # [B, Hkv, K, hd]
    qg = q.view(b, hkv, h // hkv, hd)
    sc = torch.matmul(qg, kk.transpose(-1, -2)).float()  # [B, Hkv, G, K]
    sc = sc + torch.where(valid, 0.0, float("-inf"))[:, :, None]
    p = torch.softmax(sc, dim=-1)
    out = torch.matmul(p.to(vv.dtype), vv)  # [B, Hkv, G, hd]
    return out.reshape(b, 1, h * hd), p.sum(2)


def column_mass(q: Tensor, kk: Tensor, allowed: Tensor) -> Tensor:
    """Prefill attention mass per key: q [B, S, H, hd] (pre-scaled), kk [B, Hkv, L, hd],
    allowed [B, S, L] bool -> [B, Hkv, L] float32 (summed over queries and group heads)."""
    b, s, h, hd = q.shape
    hkv = kk.shape[1]
    qg = q.view(b, s, hkv, h // hkv, hd).permute(0, 2, 3, 1, 4).reshape(b, hkv, -1, hd)
    sc = torch.matmul(qg, kk.transpose(-1, -2)).float().view(b, hkv, h // hkv, s, -1)
    sc = sc + torch.where(allowed, 0.0, float("-inf"))[:, None, None]
    return torch.softmax(sc, dim=-1).sum(dim=(2, 3))
