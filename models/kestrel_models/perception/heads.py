"""Task heads: FCOS-style anchor-free detection, semantic segmentation, dense depth."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def conv_gn_relu(cin: int, cout: int) -> nn.Sequential:
    """3x3 conv + GroupNorm (32 groups or fewer, dividing cout) + ReLU."""
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.GroupNorm(math.gcd(32, cout), cout),
        nn.ReLU(inplace=True),
    )


class Scale(nn.Module):
    """Learnable per-level scalar (FCOS) applied to the box regression."""

    def __init__(self, init: float = 1.0) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(init)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class FCOSHead(nn.Module):
    """Anchor-free detection head shared over the FPN levels (Tian et al. 2019).

    forward(list of P_l [B,C,H_l,W_l], strides) -> (cls, ltrb, ctr), each a list over levels:
      cls:  [B, num_classes, H_l, W_l] logits (sigmoid; background excluded)
      ltrb: [B, 4, H_l, W_l] px, distances from the location to the box sides (>= 0)
      ctr:  [B, 1, H_l, W_l] centerness logits
    """

    def __init__(self, channels: int, num_classes: int, num_convs: int, num_levels: int,
                 prior_prob: float = 0.01) -> None:
        super().__init__()
        self.cls_tower = nn.Sequential(*(conv_gn_relu(channels, channels)
                                         for _ in range(num_convs)))
        self.reg_tower = nn.Sequential(*(conv_gn_relu(channels, channels)
                                         for _ in range(num_convs)))
        self.cls_logits = nn.Conv2d(channels, num_classes, 3, padding=1)
        self.bbox_pred = nn.Conv2d(channels, 4, 3, padding=1)
        self.centerness = nn.Conv2d(channels, 1, 3, padding=1)
        self.scales = nn.ModuleList(Scale() for _ in range(num_levels))
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.normal_(m.weight, std=0.01)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        # focal-loss prior: every location starts as background with probability 1 - prior_prob
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - prior_prob) / prior_prob))

    def forward(self, feats: list[torch.Tensor], strides: tuple[int, ...],
                levels: tuple[int, ...] | None = None
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """levels: the level index of each feats entry (its Scale); default 0, 1, ..."""
        return fcos_levels(self, feats, strides, levels or tuple(range(len(feats))))

    def forward_level(self, p: torch.Tensor, stride: int, level: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One FPN level (index `level` picks its Scale): (cls, ltrb, ctr) as in forward."""
        c = self.cls_tower(p)
        r = self.reg_tower(p)
        return self.cls_logits(c), box_distances(self.bbox_pred(r), self.scales[level],
                                                 stride), self.centerness(r)


def box_distances(box: torch.Tensor, scale: nn.Module, stride: int) -> torch.Tensor:
    """Box regression [B,4,H,W] -> ltrb distances px: exp keeps them positive; the exponent is
    clamped so fp16/bf16 cannot overflow."""
    return torch.exp(scale(box).clamp(max=8.0)) * stride


def fcos_levels(head: nn.Module, feats: list[torch.Tensor], strides: tuple[int, ...],
                levels: tuple[int, ...]
                ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """`head.forward_level` over the given FPN levels (feats[i] is level levels[i]): the
    lists (cls, ltrb, ctr) of FCOSHead.forward. The runtime's branched forward calls it with
    a subset of the levels on each CUDA stream."""
    cls, ltrb, ctr = [], [], []
    for p, stride, level in zip(feats, strides, levels, strict=True):
        c, b, z = head.forward_level(p, stride, level)
        cls.append(c)
        ltrb.append(b)
        ctr.append(z)
    return cls, ltrb, ctr


class DenseNeck(nn.Module):
    """Merges the pyramid into one map at the finest level (Panoptic-FPN style sum).

    forward({"p{s}": ...}) -> [B, C, H/s0, W/s0], s0 = finest stride (4 or 8).
    """

    def __init__(self, channels: int, levels: list[str]) -> None:
        super().__init__()
        self.levels = levels
        self.convs = nn.ModuleList(conv_gn_relu(channels, channels) for _ in levels)

    def forward(self, pyramid: dict[str, torch.Tensor]) -> torch.Tensor:
        base = pyramid[self.levels[0]]
        out = self.convs[0](base)
        for name, conv in zip(self.levels[1:], self.convs[1:], strict=True):
            up = F.interpolate(conv(pyramid[name]), size=base.shape[-2:], mode="bilinear",
                               align_corners=False)
            out = out + up
        return out


class DenseHead(nn.Module):
    """conv+GN+ReLU then a 1x1 conv to `out_channels`, at the neck's stride."""

    def __init__(self, channels: int, out_channels: int) -> None:
        super().__init__()
        self.tower = conv_gn_relu(channels, channels)
        self.pred = nn.Conv2d(channels, out_channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pred(self.tower(x))


def upsample_crop(x: torch.Tensor, padded_hw: tuple[int, int], hw: tuple[int, int]
                  ) -> torch.Tensor:
    """Bilinear upsampling to the padded input size, then crop to the real image size."""
    x = F.interpolate(x, size=padded_hw, mode="bilinear", align_corners=False)
    return x[..., : hw[0], : hw[1]]
