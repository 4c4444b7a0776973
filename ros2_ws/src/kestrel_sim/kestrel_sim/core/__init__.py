"""Pure-Python MuJoCo world core of kestrel_sim (no rclpy)."""

from kestrel_sim.core.episode import SuccessCriteria, TaskStatus
from kestrel_sim.core.scene import CLASS_NAMES, GRIPPER_JOINT, JOINT_NAMES, default_world_file
from kestrel_sim.core.sensors import CameraFrame, CameraSensor, LidarScan, LidarSensor
from kestrel_sim.core.world import JointCommandError, ObjectGT, SimWorld, SimWorldConfig

__all__ = [
    "CLASS_NAMES", "GRIPPER_JOINT", "JOINT_NAMES", "SuccessCriteria", "TaskStatus",
    "default_world_file", "CameraFrame", "CameraSensor",
    "LidarScan", "LidarSensor", "JointCommandError", "ObjectGT", "SimWorld", "SimWorldConfig",
]
