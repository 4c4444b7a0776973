"""Feature pyramid network: C3-C5 (optionally C2) -> P3-P5 (optionally P2), one channel count."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FPN(nn.Module):
    """Top-down FPN (Lin et al. 2017) with nearest-neighbour upsampling.

    forward([C2, C3, C4, C5]) -> {"p2"?, "p3", "p4", "p5"}: [B, channels, H/s, W/s], s = 4..32.
    P2 is built only with `with_p2` (dense heads at stride 4).
    """

    def __init__(self, in_channels: list[int], channels: int, with_p2: bool = False) -> None:
        super().__init__()
        self.with_p2 = with_p2
        self.first = 0 if with_p2 else 1  # index into [C2..C5] of the finest level used
        used = in_channels[self.first:]
        self.lateral = nn.ModuleList(nn.Conv2d(c, channels, 1) for c in used)
        self.output = nn.ModuleList(nn.Conv2d(channels, channels, 3, padding=1) for _ in used)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_uniform_(m.weight, a=1)
                nn.init.zeros_(m.bias)

    def forward(self, feats: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        feats = feats[self.first:]
        lat = [conv(f) for conv, f in zip(self.lateral, feats, strict=True)]
        out = [self.output[-1](lat[-1])]
        top = lat[-1]
        for i in range(len(lat) - 2, -1, -1):
            top = lat[i] + F.interpolate(top, size=lat[i].shape[-2:], mode="nearest")
            out.insert(0, self.output[i](top))
        first_level = 2 if self.with_p2 else 3
        return {f"p{first_level + i}": p for i, p in enumerate(out)}
