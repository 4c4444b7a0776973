"""GroupNorm with its statistics taken as per-channel sums (an `optimize.py` transform).

Why: on a channels_last activation [B, C, H, W] (memory order B, H, W, C) a group's elements
are 8-16 contiguous channels out of every pixel's C. Inductor's GroupNorm lowering reduces
each (image, group) over that strided view: on the H200 its reduction kernels read the FCOS
P3 towers' [6, 512, 80, 80] bf16 activations at ~1.8 TB/s, against ~3.6 TB/s for the
normalise + ReLU pass after them (docs/benchmarks/perception_h200.md). Here the reduction is
per (image, channel) over the pixels, sum and sum of squares in fp32 in one pass whose
contiguous axis is the channel, then a [B, C] -> [B, G] sum; the normalisation is one
per-(image, channel) scale and shift, which inductor fuses with the ReLU after it.

Numerics: var = E[x^2] - E[x]^2 in fp32 (clamped at 0) instead of Welford's update. For
activations whose mean is m standard deviations from 0 the variance loses ~m^2 x 6e-8 of its
relative precision: 6e-4 at m = 100, below the bf16 rounding (4e-3) of the data itself. On
the CPU in fp32 it equals nn.GroupNorm to ~1e-5 (tested).
"""

from __future__ import annotations

import torch
from torch import nn


class SumsGroupNorm(nn.GroupNorm):
    """nn.GroupNorm (same parameters, same state dict) with sum-based statistics."""

    @classmethod
    def from_group_norm(cls, gn: nn.GroupNorm) -> SumsGroupNorm:
        new = cls(gn.num_groups, gn.num_channels, gn.eps, gn.affine,
                  device=gn.weight.device if gn.affine else None,
                  dtype=gn.weight.dtype if gn.affine else None)
        if gn.affine:
            with torch.no_grad():
                new.weight.copy_(gn.weight)
                new.bias.copy_(gn.bias)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 4:
            return super().forward(x)
        b, c, h, w = x.shape
        g = self.num_groups
        xf = x.float()
        # per (image, channel): sum and sum of squares over the pixels, [B, C] fp32
        s1 = xf.sum(dim=(2, 3)).view(b, g, c // g)
        s2 = (xf * xf).sum(dim=(2, 3)).view(b, g, c // g)
        n = float(c // g * h * w)
        mean = s1.sum(-1, keepdim=True) / n  # [B, G, 1]
        var = (s2.sum(-1, keepdim=True) / n - mean * mean).clamp_min(0.0)
        rstd = torch.rsqrt(var + self.eps)
        scale = rstd.expand(b, g, c // g)
        if self.affine:
            scale = scale * self.weight.float().view(1, g, c // g)
        shift = -mean * scale
        if self.affine:
            shift = shift + self.bias.float().view(1, g, c // g)
        # y = x * scale + shift, per (image, channel); back to the input's dtype
        return (xf * scale.reshape(b, c, 1, 1) + shift.reshape(b, c, 1, 1)).to(x.dtype)


def use_sums_group_norm(module: nn.Module) -> int:
    """Replace (in place) every nn.GroupNorm under `module` by a `SumsGroupNorm`; returns the
    number replaced."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.GroupNorm:
                setattr(parent, name, SumsGroupNorm.from_group_norm(child))
                count += 1
    return count
