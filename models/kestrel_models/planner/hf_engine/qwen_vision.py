"""The Qwen2-VL / Qwen2.5-VL vision tower with static shapes, so that the engine's prefill
(vision tower, merger, decoder pass) can be captured as one CUDA graph per image shape.

transformers' forward does per request, on the host, what depends only on the image grid: the
rotary angles of every patch, Qwen2.5-VL's window order and window boundaries (`.tolist()`
syncs), and one attention call per window. Here that bookkeeping is computed once per grid
(`plan`) and kept on the device; attention runs as one batched SDPA per block: the images of a
batch in the batch dimension, equal windows as more batch rows (a block-diagonal mask when the
windows differ in size). Every layer is still the checkpoint's own module (patch_embed, each
block's norm1 / attn.qkv / attn.proj / norm2 / mlp, the merger): no weight is copied.

The decoder (qwen2_vl.py, `_checked_tower`) compares it with transformers' own forward on two
synthetic patch grids at load and uses it only where they agree, so a transformers release that
changes the tower's semantics falls back to the eager path instead of computing garbage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["QwenVision", "window_order"]

BLOCK_PARTS = ("norm1", "norm2", "attn", "mlp")


def window_order(lh: int, lw: int, win: int) -> tuple[Tensor, list[int]]:
    """Qwen2.5-VL's window layout of a merged grid lh x lw with windows of win x win merged
    units: (order [lh * lw] long: the merged units in window order, sizes: units per non-empty
    window, in that order), as transformers' get_window_index computes it."""
    index = torch.arange(lh * lw).reshape(lh, lw)
    ph, pw = win - lh % win, win - lw % win
    nh, nw = (lh + ph) // win, (lw + pw) // win
    pad = F.pad(index, (0, pw, 0, ph), "constant", -100)
    pad = pad.reshape(nh, win, nw, win).permute(0, 2, 1, 3).reshape(nh * nw, win * win)
    sizes = [int(s) for s in (pad != -100).sum(1).tolist() if s > 0]
    return pad[pad != -100], sizes


@dataclass
class _Plan:
    """What one patch grid needs (device tensors; patches in window order)."""

    cos: Tensor  # [S, 1, head_dim] float32
    sin: Tensor
    order: Tensor | None  # [S / unit] merged units in window order (None: no windows)
    back: Tensor | None  # its inverse permutation
    win: int  # patches per window when all windows are equal, else 0
    mask: Tensor | None  # [S, S] bool block-diagonal (windows of unequal size)


class QwenVision:
    """visual: the checkpoint's vision tower (model.visual / model.model.visual)."""

    def __init__(self, visual: nn.Module, vcfg: Any) -> None:
        blocks = getattr(visual, "blocks", None)
        if blocks is None or not all(hasattr(b, p) for b in blocks for p in BLOCK_PARTS) or \
                not all(hasattr(b.attn, "qkv") and hasattr(b.attn, "proj") for b in blocks):
            raise ValueError("the vision tower's blocks are not (norm1, attn.qkv, attn.proj, "
                             "norm2, mlp)")
        for name in ("patch_embed", "merger", "rotary_pos_emb"):
            if not hasattr(visual, name):
                raise ValueError(f"the vision tower has no {name}")
        self.v, self.blocks = visual, list(blocks)
        self.merge = int(getattr(vcfg, "spatial_merge_size", 2))
        self.unit = self.merge ** 2
        self.patch = int(vcfg.patch_size)
        self.heads = int(vcfg.num_heads)
        self.head_dim = self.blocks[0].attn.qkv.in_features // self.heads
        self.window = int(getattr(vcfg, "window_size", 0) or 0)  # pixels (Qwen2.5-VL)
        full = getattr(vcfg, "fullatt_block_indexes", None)
        self.full = (set(range(len(self.blocks))) if not self.window or full is None
                     else {int(i) for i in full})
        self.inv_freq = visual.rotary_pos_emb.inv_freq.detach().float()
        self._plans: dict[tuple[int, int], _Plan] = {}

    @property
    def device(self) -> torch.device:
        return self.inv_freq.device

    def plan(self, gh: int, gw: int) -> _Plan:
        """The plan of a gh x gw patch grid (computed once; call outside a graph capture)."""
        key = (gh, gw)
        if key in self._plans:
            return self._plans[key]
        m, dev = self.merge, self.device
        hpos = torch.arange(gh)[:, None].expand(gh, gw)
        wpos = torch.arange(gw)[None].expand(gh, gw)

        def blockwise(p: Tensor) -> Tensor:  # patches in merge-block order (as the processor)
            return p.reshape(gh // m, m, gw // m, m).permute(0, 2, 1, 3).flatten()

        inv = self.inv_freq.cpu()
        freqs = torch.cat([blockwise(hpos)[:, None].float() * inv,
                           blockwise(wpos)[:, None].float() * inv], dim=-1)
        emb = torch.cat([freqs, freqs], dim=-1)  # [S, head_dim]
        order = back = mask = None
        win = 0
        if self.window:
            order, sizes = window_order(gh // m, gw // m, self.window // m // self.patch)
            emb = emb.reshape(-1, self.unit, emb.shape[-1])[order].reshape(emb.shape)
            back = torch.argsort(order)
            if len(set(sizes)) == 1:
                win = sizes[0] * self.unit
            else:
                seg = torch.repeat_interleave(torch.arange(len(sizes)),
                                              torch.tensor(sizes) * self.unit)
                mask = (seg[:, None] == seg[None, :]).to(dev)
            order, back = order.to(dev), back.to(dev)
        p = _Plan(emb.cos()[:, None].to(dev), emb.sin()[:, None].to(dev), order, back, win,
                  mask)
        self._plans[key] = p
        return p

    def _rope(self, x: Tensor, p: _Plan) -> Tensor:
        """x [n, S, H, hd] -> rotated (float32 arithmetic, as transformers)."""
        xf = x.float()
        half = xf.shape[-1] // 2
        rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        return (xf * p.cos + rot * p.sin).to(x.dtype)

    def _attention(self, blk: nn.Module, x: Tensor, p: _Plan, full: bool) -> Tensor:
        n, s, d = x.shape
        h, hd = self.heads, self.head_dim
        q, k, v = blk.attn.qkv(x).view(n, s, 3, h, hd).unbind(2)
        q, k = self._rope(q, p), self._rope(k, p)
        mask = None
        if not full and p.win:  # equal windows: one batch row each
            q, k, v = (t.reshape(n * s // p.win, p.win, h, hd) for t in (q, k, v))
        elif not full:
            mask = p.mask
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), attn_mask=mask)
        return blk.attn.proj(a.transpose(1, 2).reshape(n, s, d))

    def __call__(self, pixel_values: Tensor, n: int, gh: int, gw: int) -> Tensor:
        """pixel_values [n * gh * gw, C * T * p * p] (Qwen2VLImageProcessor's layout, n images
        of one grid) -> merged features [n, gh * gw / unit, out_dim]. Static shapes for a given
        (n, gh, gw) once plan(gh, gw) exists."""
        p = self.plan(gh, gw)
        s = gh * gw
        x = self.v.patch_embed(pixel_values).reshape(n, s, -1)
        if p.order is not None:
            x = x.reshape(n, s // self.unit, self.unit, -1)[:, p.order].reshape(n, s, -1)
        for i, blk in enumerate(self.blocks):
            x = x + self._attention(blk, blk.norm1(x), p, i in self.full)
            x = x + blk.mlp(blk.norm2(x))
        out = self.v.merger(x.reshape(n * s, -1)).reshape(n, s // self.unit, -1)
        return out if p.back is None else out[:, p.back]
