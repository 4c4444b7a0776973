"""MultiTaskPerceptionModel: ResNet + FPN + detection / segmentation / depth heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .backbone import ResNetBackbone
from .bev import BEVFusion
from .config import HEAD_NAMES, PerceptionConfig
from .fpn import FPN
from .heads import DenseHead, DenseNeck, FCOSHead, upsample_crop

DET_STRIDES: tuple[int, ...] = (8, 16, 32)  # strides of P3, P4, P5
PAD_MULTIPLE = 32  # input H, W are padded to a multiple of the coarsest stride


class MultiTaskPerceptionModel(nn.Module):
    """Camera perception network with run-time selectable heads.

    forward(images: [B,3,H,W] uint8 RGB (B = cameras x batch), heads: frozenset[str] | None)
      -> dict with, for the requested heads only:
         "det_cls":  list over P3-P5 of [B, num_det_classes, H_l, W_l] logits
         "det_ltrb": list over P3-P5 of [B, 4, H_l, W_l] px (distances to the box sides)
         "det_ctr":  list over P3-P5 of [B, 1, H_l, W_l] centerness logits
         "seg":      [B, num_classes, H, W] class logits
         "depth":    [B, 1, H, W] m along the optical axis, in (0, max_depth]
         "bev_occ":  [S, 1, G, G] BEV occupancy logits, only with config.bev and `points`
                     [S, N, 3] m (S samples; B = S x cameras, images grouped per sample)
    H_l, W_l are the feature sizes of the padded input (ceil(H / 32) * 32 / stride).
    Normalisation (mean/std buffers) and padding happen inside, so uint8 goes to the device.
    """

    def __init__(self, config: PerceptionConfig) -> None:
        super().__init__()
        self.config = config
        mean = torch.tensor(config.image_mean, dtype=torch.float32).view(1, 3, 1, 1)
        std = torch.tensor(config.image_std, dtype=torch.float32).view(1, 3, 1, 1)
        # x_norm = x_uint8 * scale + shift  ==  (x / 255 - mean) / std
        self.register_buffer("in_scale", 1.0 / (255.0 * std), persistent=False)
        self.register_buffer("in_shift", -mean / std, persistent=False)
        self.backbone = ResNetBackbone(config.backbone_depth, config.base_width)
        dense = {"segmentation", "depth"} & config.heads
        with_p2 = bool(dense) and config.dense_stride == 4
        self.fpn = FPN(self.backbone.out_channels, config.fpn_channels, with_p2=with_p2)
        c = config.fpn_channels
        self.det_head = (FCOSHead(c, config.num_det_classes, config.head_convs, len(DET_STRIDES))
                         if "detection" in config.heads else None)
        levels = (["p2"] if with_p2 else []) + ["p3", "p4", "p5"]
        self.dense_neck = DenseNeck(c, levels) if dense else None
        self.seg_head = (DenseHead(c, config.num_classes)
                         if "segmentation" in config.heads else None)
        self.depth_head = DenseHead(c, 1) if "depth" in config.heads else None
        self.bev = (BEVFusion(c, config.bev_grid, config.bev_range, config.bev_z_range,
                              config.bev_heads) if config.bev else None)

    @property
    def enabled_heads(self) -> frozenset[str]:
        return self.config.heads

    def _check_heads(self, heads: frozenset[str] | None) -> frozenset[str]:
        if heads is None:
            return self.config.heads
        heads = frozenset(heads)
        missing = heads - self.config.heads
        if missing or not heads:
            raise ValueError(f"heads {sorted(heads)}: must be a non-empty subset of the built "
                             f"heads {sorted(self.config.heads)} (known: {HEAD_NAMES})")
        return heads

    def normalise(self, images: torch.Tensor) -> torch.Tensor:
        """[B,3,H,W] uint8 -> float normalised, padded to multiples of 32 (zeros = mean)."""
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images: expected [B,3,H,W], got {tuple(images.shape)}")
        x = images.float() * self.in_scale.float() + self.in_shift.float()
        h, w = image_hw(images)
        ph, pw = padded_size((h, w))
        if (ph, pw) != (h, w):
            x = F.pad(x, (0, pw - w, 0, ph - h))
        if self.backbone.conv1.weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        return x.to(self.backbone.conv1.weight.dtype)  # weights cast to bf16/fp16: same

    def forward(self, images: torch.Tensor, heads: frozenset[str] | None = None,
                points: torch.Tensor | None = None,
                cameras: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        """cameras = (T_cam_from_base [cams, 4, 4], K [cams, 3, 3] px): the BEV block's
        geometric lift (bev.py); without them its image attention is learned only."""
        heads = self._check_heads(heads)
        pyramid = self.trunk(images)
        out: dict[str, torch.Tensor | list[torch.Tensor]] = {}
        if "detection" in heads:
            out.update(self.detection(pyramid))
        out.update(self.dense(pyramid, heads, image_hw(images)))
        if self.bev is not None and points is not None:
            out["bev_occ"] = self.bev_occupancy(points, pyramid["p5"], cameras,
                                                image_hw(images))
        return out

    def bev_occupancy(self, points: torch.Tensor, p5: torch.Tensor,
                      cameras: tuple[torch.Tensor, torch.Tensor] | None,
                      hw: tuple[int, int]) -> torch.Tensor:
        """The BEV block on P5 [B*cams, C, h, w] (padded input: 32 px per token)."""
        assert self.bev is not None
        geo = None
        if cameras is not None:
            geo = (cameras[0], cameras[1], hw, float(padded_size(hw)[1]) / p5.shape[-1])
        return self.bev(points, p5, geo)

    # The parts of forward, in its order. The runtime's branched forward (branches.py) runs
    # them as separately compiled regions on their own CUDA streams; forward is their sum.
    def trunk(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """[B,3,H,W] uint8 -> the FPN pyramid {"p3", "p4", "p5" (, "p2")} (normalisation and
        padding to a multiple of 32 inside)."""
        return self.fpn(self.backbone(self.normalise(images)))

    def detection(self, pyramid: dict[str, torch.Tensor], levels: tuple[int, ...] = (0, 1, 2)
                  ) -> dict[str, list[torch.Tensor]]:
        """FCOS outputs of the given detection levels (indices into DET_STRIDES: 0 = P3)."""
        assert self.det_head is not None
        cls, ltrb, ctr = self.det_head([pyramid[f"p{3 + i}"] for i in levels],
                                       tuple(DET_STRIDES[i] for i in levels), levels)
        return {"det_cls": cls, "det_ltrb": ltrb, "det_ctr": ctr}

    def dense(self, pyramid: dict[str, torch.Tensor], heads: frozenset[str],
              hw: tuple[int, int]) -> dict[str, torch.Tensor]:
        """"seg" / "depth" (those in `heads`) at the input size hw = (H, W) px."""
        out: dict[str, torch.Tensor] = {}
        if not heads & {"segmentation", "depth"}:
            return out
        assert self.dense_neck is not None
        padded_hw = padded_size(hw)
        dense = self.dense_neck(pyramid)
        if "segmentation" in heads:
            assert self.seg_head is not None
            out["seg"] = upsample_crop(self.seg_head(dense), padded_hw, hw)
        if "depth" in heads:
            assert self.depth_head is not None
            d = upsample_crop(self.depth_head(dense), padded_hw, hw)
            if self.config.depth_activation == "sigmoid":
                d = torch.sigmoid(d) * self.config.max_depth
            else:
                d = F.softplus(d).clamp(min=1e-3, max=self.config.max_depth)
            out["depth"] = d
        return out


def image_hw(images: torch.Tensor) -> tuple[int, int]:
    """(H, W) px of an image batch [B,3,H,W]."""
    return int(images.shape[-2]), int(images.shape[-1])


def padded_size(hw: tuple[int, int]) -> tuple[int, int]:
    """(H, W) padded up to multiples of PAD_MULTIPLE, as `normalise` pads."""
    return hw[0] + -hw[0] % PAD_MULTIPLE, hw[1] + -hw[1] % PAD_MULTIPLE


def load_weights(model: nn.Module, path: str) -> None:
    """Load a state dict file (or a checkpoint {"state_dict": ...}) into `model`, strictly:
    the node's `weights_path`, the benchmark's and the engine build's --weights."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state:
        state = state["state_dict"]
    model.load_state_dict(state, strict=True)


def count_parameters(module: nn.Module) -> int:
    """Number of parameters (works for modules built on the meta device)."""
    return sum(p.numel() for p in module.parameters())
