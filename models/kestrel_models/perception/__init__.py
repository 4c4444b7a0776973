"""Multi-task camera perception model (detection, segmentation, depth) and LiDAR geometry.

No ROS inside. Typical use:
    cfg = PerceptionConfig.tiny()
    model = MultiTaskPerceptionModel(cfg).eval()
    raw = model(images_uint8)                       # images: [B,3,H,W] uint8
    dets = decode_detections(raw, (H, W), cfg.score_threshold, cfg.nms_iou,
                             cfg.max_detections, class_offset=cfg.det_class_offset)
"""

from .backbone import ResNetBackbone
from .config import HEAD_NAMES, PerceptionConfig
from .external import ExternalPerceptionModel, OutputContract
from .fpn import FPN
from .lidar import (
    DEFAULT_BUCKETS,
    PositionSource,
    box_position,
    box_positions,
    bucket_points,
    project_points,
)
from .model import DET_STRIDES, MultiTaskPerceptionModel, count_parameters
from .postprocess import ImageDetections, batched_nms, box_iou, decode_detections, nms

__all__ = [
    "DEFAULT_BUCKETS",
    "DET_STRIDES",
    "ExternalPerceptionModel",
    "FPN",
    "HEAD_NAMES",
    "ImageDetections",
    "MultiTaskPerceptionModel",
    "OutputContract",
    "PerceptionConfig",
    "PositionSource",
    "ResNetBackbone",
    "batched_nms",
    "box_iou",
    "box_position",
    "box_positions",
    "bucket_points",
    "count_parameters",
    "decode_detections",
    "nms",
    "project_points",
]
