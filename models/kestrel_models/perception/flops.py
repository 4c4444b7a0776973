"""FLOP count of the perception model, split by part (trunk / FPN / each head / BEV).

Counted with `torch.utils.flop_counter.FlopCounterMode` on the meta device (no memory, no
compute: the ResNet-50 reference at 6 x 640 x 640 counts in about a second on a CPU).
FLOPs are 2 x multiply-accumulates (the convention of the ~1 TFLOP reference figure); only
matmul/conv-like ops are counted (pointwise ops, norms, interpolation are not).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from .config import PerceptionConfig
from .model import MultiTaskPerceptionModel

# model attribute -> part name in the report
PARTS: tuple[tuple[str, str], ...] = (("backbone", "trunk"), ("fpn", "fpn"),
                                      ("det_head", "detection"), ("dense_neck", "dense_neck"),
                                      ("seg_head", "segmentation"), ("depth_head", "depth"),
                                      ("bev", "bev"))


@dataclass(frozen=True)
class FlopReport:
    """FLOPs of one forward: total and per part (GFLOP), with the bf16 time floor."""

    images: int  # images in the batch (cameras x batch)
    image_hw: tuple[int, int]  # (H, W) px
    total_gflop: float
    parts_gflop: dict[str, float]  # part name -> GFLOP (parts absent from the model omitted)

    def floor_ms(self, tflops: float) -> float:
        """Time floor at `tflops` TFLOP/s (a device's dense peak for the precision), ms."""
        if tflops <= 0:
            raise ValueError(f"parameter 'tflops' = {tflops!r}: must be > 0")
        return self.total_gflop / tflops  # GFLOP / (TFLOP/s) = ms

    def as_dict(self, tflops: float = 790.0) -> dict:
        return {"images": self.images, "image_hw": list(self.image_hw),
                "total_gflop": round(self.total_gflop, 2),
                "parts_gflop": {k: round(v, 2) for k, v in self.parts_gflop.items()},
                "parts_share": {k: round(v / self.total_gflop, 4)
                                for k, v in self.parts_gflop.items()},
                "floor_ms_at_tflops": {str(tflops): round(self.floor_ms(tflops), 3)}}


def count_flops(config: PerceptionConfig, images: int = 6, image_hw: tuple[int, int] = (640, 640),
                lidar_points: int = 0) -> FlopReport:
    """FLOPs of `MultiTaskPerceptionModel(config)` on `images` uint8 images of `image_hw`,
    every built head enabled (BEV only with config.bev and lidar_points > 0: one sample)."""
    if images < 1:
        raise ValueError(f"parameter 'images' = {images!r}: must be >= 1")
    if len(image_hw) != 2 or min(image_hw) < 32:
        raise ValueError(f"parameter 'image_hw' = {image_hw!r}: must be (H, W) >= 32 px")
    with torch.device("meta"):
        model = MultiTaskPerceptionModel(config).eval()
        x = torch.zeros((images, 3, *image_hw), dtype=torch.uint8)
        pts = torch.zeros((1, lidar_points, 3)) if config.bev and lidar_points > 0 else None
        counter = FlopCounterMode(display=False)
        with counter, torch.no_grad():
            model(x, points=pts)
    counts = counter.get_flop_counts()
    root = type(model).__name__
    total = sum(counts.get(root, counts.get("Global", {})).values()) / 1e9
    parts = {}
    for attr, name in PARTS:
        key = f"{root}.{attr}"
        if getattr(model, attr, None) is not None and key in counts:
            parts[name] = sum(counts[key].values()) / 1e9
    return FlopReport(images, (int(image_hw[0]), int(image_hw[1])), total, parts)
