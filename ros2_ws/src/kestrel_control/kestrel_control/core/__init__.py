"""Pure-Python core of the control node (no rclpy): buffers, real-time loop, safety, policy."""

from kestrel_control.core.double_buffer import LatestValueBuffer
from kestrel_control.core.loop_process import LoopProcess, LoopProcessError, LoopSettings
from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig, StepInfo, padded_batch
from kestrel_control.core.rt_loop import RealtimeLoop, apply_realtime_settings
from kestrel_control.core.safety import SafetyCounters, SafetyFilter, SafetyStatus, validate_limits
from kestrel_control.core.shm_control import (SharedLatestValue, SharedLoopStats, ShmLayout,
                                              ShmSegment, ShmViews)
from kestrel_control.core.stats import LoopStats, LoopStatsSnapshot, Ring
from kestrel_models.control.registry import BACKENDS

__all__ = [
    "BACKENDS", "LatestValueBuffer", "LoopProcess", "LoopProcessError", "LoopSettings",
    "LoopStats", "LoopStatsSnapshot", "PolicyRunner", "RealtimeLoop", "Ring", "RunnerConfig",
    "SafetyCounters", "SafetyFilter", "SafetyStatus", "SharedLatestValue", "SharedLoopStats",
    "ShmLayout", "ShmSegment", "ShmViews", "StepInfo", "apply_realtime_settings",
    "padded_batch", "validate_limits",
]
