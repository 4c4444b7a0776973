"""Configuration of the multi-task perception model (validated up front, no torch import)."""

from __future__ import annotations

from dataclasses import dataclass, field

HEAD_NAMES = ("detection", "segmentation", "depth")
BACKBONE_DEPTHS = (18, 34, 50)
DEPTH_ACTIVATIONS = ("softplus", "sigmoid")


def _fail(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"parameter '{name}' = {value!r}: {why}")


@dataclass(frozen=True)
class PerceptionConfig:
    """Architecture and post-processing settings of `MultiTaskPerceptionModel`.

    The defaults are the reference architecture (ResNet-50, 256-channel FPN, FCOS heads with
    4 shared convs). `PerceptionConfig.tiny()` is the small CPU configuration for tests/demos.
    """

    backbone_depth: int = 50  # ResNet depth: 18/34 (BasicBlock) or 50 (Bottleneck)
    base_width: int = 64  # channels of the stem and layer1 (64 = real ResNet)
    fpn_channels: int = 256  # channels of P3-P5 (and of the heads' towers)
    num_classes: int = 7  # segmentation classes, including background (index 0 if present)
    background_class: bool = True  # class 0 is background: never a detection class
    heads: frozenset[str] = field(default_factory=lambda: frozenset(HEAD_NAMES))
    head_convs: int = 4  # 3x3 conv+GN+ReLU layers in each FCOS tower (cls and reg)
    dense_stride: int = 8  # stride of the seg/depth features: 4 (uses C2/P2) or 8 (P3)
    depth_activation: str = "softplus"  # "softplus" (unbounded) or "sigmoid" (* max_depth)
    max_depth: float = 20.0  # m, upper bound of the depth output (clamp / sigmoid scale)
    score_threshold: float = 0.3  # detection score threshold, in [0, 1]
    nms_iou: float = 0.5  # class-wise NMS IoU threshold, in [0, 1]
    max_detections: int = 100  # per image, after NMS
    pre_nms_top_k: int = 1000  # best (location, class) candidates over all levels before NMS
    image_mean: tuple[float, float, float] = (0.485, 0.456, 0.406)  # RGB, of x / 255
    image_std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    # optional BEV fusion block (bev.py): LiDAR pillars + camera features -> BEV occupancy
    bev: bool = False
    bev_grid: int = 64  # BEV cells per side (square grid centred on the base frame origin)
    bev_range: float = 25.6  # m, half extent of the BEV grid (cell = 2 * range / grid)
    bev_z_range: tuple[float, float] = (-2.0, 4.0)  # m, points outside this height are dropped
    bev_heads: int = 4  # attention heads of the BEV <- image cross-attention

    def __post_init__(self) -> None:
        if self.backbone_depth not in BACKBONE_DEPTHS:
            raise _fail("backbone_depth", self.backbone_depth, f"must be one of {BACKBONE_DEPTHS}")
        if not 8 <= self.base_width <= 128 or self.base_width % 4:
            raise _fail("base_width", self.base_width, "must be a multiple of 4 in [8, 128]")
        if not 8 <= self.fpn_channels <= 1024 or self.fpn_channels % 8:
            raise _fail("fpn_channels", self.fpn_channels, "must be a multiple of 8 in [8, 1024]")
        min_classes = 2 if self.background_class else 1
        if not min_classes <= self.num_classes <= 1000:
            raise _fail("num_classes", self.num_classes, f"must be in [{min_classes}, 1000]")
        heads = frozenset(self.heads)
        object.__setattr__(self, "heads", heads)
        unknown = heads - set(HEAD_NAMES)
        if not heads or unknown:
            raise _fail("heads", sorted(heads), f"must be a non-empty subset of {HEAD_NAMES}")
        if not 0 <= self.head_convs <= 8:
            raise _fail("head_convs", self.head_convs, "must be in [0, 8]")
        if self.dense_stride not in (4, 8):
            raise _fail("dense_stride", self.dense_stride, "must be 4 or 8")
        if self.depth_activation not in DEPTH_ACTIVATIONS:
            raise _fail("depth_activation", self.depth_activation,
                        f"must be one of {DEPTH_ACTIVATIONS}")
        if not 0.0 < self.max_depth <= 1000.0:
            raise _fail("max_depth", self.max_depth, "must be in (0, 1000] m")
        if not 0.0 <= self.score_threshold <= 1.0:
            raise _fail("score_threshold", self.score_threshold, "must be in [0, 1]")
        if not 0.0 <= self.nms_iou <= 1.0:
            raise _fail("nms_iou", self.nms_iou, "must be in [0, 1]")
        if not 1 <= self.max_detections <= 1000:
            raise _fail("max_detections", self.max_detections, "must be in [1, 1000]")
        if not 1 <= self.pre_nms_top_k <= 10000:
            raise _fail("pre_nms_top_k", self.pre_nms_top_k, "must be in [1, 10000]")
        if len(self.image_mean) != 3 or len(self.image_std) != 3:
            raise _fail("image_mean/image_std", (self.image_mean, self.image_std),
                        "must have 3 values (RGB)")
        if min(self.image_std) <= 0.0:
            raise _fail("image_std", self.image_std, "must be > 0")
        if not 4 <= self.bev_grid <= 512:
            raise _fail("bev_grid", self.bev_grid, "must be in [4, 512]")
        if not 0.0 < self.bev_range <= 200.0:
            raise _fail("bev_range", self.bev_range, "must be in (0, 200] m")
        if len(self.bev_z_range) != 2 or not self.bev_z_range[0] < self.bev_z_range[1]:
            raise _fail("bev_z_range", self.bev_z_range, "must be (low, high) with low < high")
        if self.bev_heads < 1 or self.fpn_channels % self.bev_heads:
            raise _fail("bev_heads", self.bev_heads, "must be >= 1 and divide fpn_channels")

    @property
    def num_det_classes(self) -> int:
        """Channels of the detection class logits (background excluded)."""
        return self.num_classes - (1 if self.background_class else 0)

    @property
    def det_class_offset(self) -> int:
        """Add to a detection logit channel to get the class index (1 with a background)."""
        return 1 if self.background_class else 0

    @classmethod
    def tiny(cls, **overrides: object) -> PerceptionConfig:
        """Small CPU config: ResNet-18 at 1/4 width, 64-channel FPN, 1-conv towers."""
        kw: dict[str, object] = dict(backbone_depth=18, base_width=16, fpn_channels=64,
                                     head_convs=1)
        kw.update(overrides)
        return cls(**kw)  # type: ignore[arg-type]
