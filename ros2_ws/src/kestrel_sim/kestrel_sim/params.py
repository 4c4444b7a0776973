"""The sim node's parameters (ParamSpec table, no rclpy): rates, image and LiDAR sizes, the
world and robot files, the episodes' layout, frame ids; and the check across them."""

from __future__ import annotations

from typing import Any

from kestrel_common.params import ParamError, ParamSpec

__all__ = ["SPECS", "validate_sim_params"]

SPECS = [
    ParamSpec("physics_rate_hz", 1000.0, "Physics steps per sim second (timestep = 1/rate).",
              min=100.0, max=10000.0, read_only=True),
    ParamSpec("real_time_factor", 1.0, "Sim seconds per wall second (live).",
              min=0.05, max=20.0),
    ParamSpec("physics_batch_s", 0.004, "Wall period of one physics batch, s.",
              min=0.001, max=0.05, read_only=True),
    ParamSpec("camera_rate_hz", 5.0, "Camera frames per sim second (0 = off).",
              min=0.0, max=60.0, read_only=True),
    ParamSpec("camera_width", 320, "Image width, px.", min=16, max=1920, read_only=True),
    ParamSpec("camera_height", 256, "Image height, px.", min=16, max=1080, read_only=True),
    ParamSpec("publish_depth", False, "Also publish ~/output/depth (32FC1, m).",
              read_only=True),
    ParamSpec("lidar_rate_hz", 5.0, "LiDAR scans per sim second (0 = off).",
              min=0.0, max=50.0, read_only=True),
    ParamSpec("lidar_n_vertical", 32, "LiDAR rings.", min=1, max=256, read_only=True),
    ParamSpec("lidar_n_horizontal", 360, "LiDAR azimuth steps.", min=1, max=4096,
              read_only=True),
    ParamSpec("lidar_max_range", 5.0, "LiDAR range, m.", min=0.1, max=100.0, read_only=True),
    ParamSpec("joint_state_rate_hz", 250.0, "Joint states per sim second.",
              min=1.0, max=10000.0, read_only=True),
    ParamSpec("clock_rate_hz", 250.0, "/clock messages per sim second.",
              min=1.0, max=10000.0, read_only=True),
    ParamSpec("ground_truth_rate_hz", 10.0, "Ground truth per sim second (0 = off).",
              min=0.0, max=1000.0, read_only=True),
    ParamSpec("seed", 0, "Initial layout: 0 = default, else random object placement.",
              min=0, max=2**31 - 1, read_only=True),
    ParamSpec("world_file", "", "MJCF file; '' = the packaged tabletop.xml.", read_only=True),
    ParamSpec("robot_file", "", "URDF of the arm attached at the world's robot_mount site; '' = "
              "kestrel_description's kestrel_arm.urdf.", read_only=True),
    ParamSpec("episode.min_objects", 3, "Episodes (seed != 0): at least this many of the task "
              "objects are on the table (uniform up to all of them), the others parked.",
              min=1, max=64, read_only=True),
    ParamSpec("episode.max_distractors", 0, "Episodes (seed != 0): distractors (objects of no "
              "perception class) on the table, uniform in [0, this].", min=0, max=64,
              read_only=True),
    ParamSpec("world_frame", "world", "Frame of points, poses and ground truth.",
              read_only=True),
    ParamSpec("camera_frame", "camera_optical_frame", "Camera optical frame id.",
              read_only=True),
]


def validate_sim_params(values: dict[str, Any]) -> None:
    """ParamError naming the first output rate above physics_rate_hz (the physics thread
    publishes these outputs after its steps, so none can be due more often than a step)."""
    for name in ("clock_rate_hz", "joint_state_rate_hz", "ground_truth_rate_hz"):
        if values[name] > values["physics_rate_hz"]:
            raise ParamError(name, values[name], "must be <= physics_rate_hz "
                             f"({values['physics_rate_hz']})")
