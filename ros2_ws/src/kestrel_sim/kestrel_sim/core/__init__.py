"""Pure-Python MuJoCo world core of kestrel_sim (no rclpy)."""

from kestrel_sim.core.scene import CLASS_NAMES, JOINT_NAMES, default_world_file
from kestrel_sim.core.sensors import CameraFrame, CameraSensor, LidarScan, LidarSensor
from kestrel_sim.core.world import JointCommandError, ObjectGT, SimWorld, SimWorldConfig

__all__ = [
    "CLASS_NAMES", "JOINT_NAMES", "default_world_file", "CameraFrame", "CameraSensor",
    "LidarScan", "LidarSensor", "JointCommandError", "ObjectGT", "SimWorld", "SimWorldConfig",
]
