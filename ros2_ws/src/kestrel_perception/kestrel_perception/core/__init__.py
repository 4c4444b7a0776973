"""Pure-Python perception core (no rclpy): FrameSet -> PerceptionOutput."""

from .perception_core import STAGES, PerceptionCore, PerceptionCoreConfig
from .types import (
    DEFAULT_CLASS_NAMES,
    REASON_CODES,
    CameraModel,
    Detection,
    FrameSet,
    InputError,
    PerceptionOutput,
)

__all__ = [
    "DEFAULT_CLASS_NAMES",
    "REASON_CODES",
    "STAGES",
    "CameraModel",
    "Detection",
    "FrameSet",
    "InputError",
    "PerceptionCore",
    "PerceptionCoreConfig",
    "PerceptionOutput",
]
