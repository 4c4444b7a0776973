"""The Kestrel stack as data: which nodes, their parameter files and topic remappings.

One table serves both ways of starting the stack, so they cannot drift apart:
- the ROS 2 launch files (launch/*.launch.py) turn each entry into a launch_ros Node;
- the launch-free runner (run_stack.py) turns each entry into a process command line.
No rclpy or launch import here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "kestrel_bringup"


@dataclass(frozen=True)
class NodeEntry:
    name: str                               # node name (also the key in its params file)
    package: str                            # ROS package
    executable: str                         # console script in lib/<package>/
    module: str                             # python -m target for the launch-free runner
    params_file: str                        # file in kestrel_bringup/config/
    remappings: tuple[tuple[str, str], ...]  # role-named topic -> stack topic
    use_sim_time: bool = True               # the sim publishes /clock; it runs on its own time
    # Restart the node when it exits by itself (launch's `respawn` / `respawn_delay`; the
    # runner does the same). On for nodes whose state is rebuilt from their inputs (perception,
    # planner); off for the sim (the world's state would be lost) and for control, whose
    # restart under a moving arm is an operator's decision.
    respawn: bool = False
    respawn_delay: float = 2.0              # s between the exit and the restart


STACK: tuple[NodeEntry, ...] = (
    NodeEntry(
        name="sim", package="kestrel_sim", executable="sim_node",
        module="kestrel_sim.sim_node", params_file="sim.yaml", use_sim_time=False,
        remappings=(
            ("~/output/image", "/camera/image_raw"),
            ("~/output/camera_info", "/camera/camera_info"),
            ("~/output/camera_pose", "/camera/pose"),
            ("~/output/depth", "/camera/depth"),
            ("~/output/points", "/lidar/points"),
            ("~/output/joint_states", "/joint_states"),
            ("~/output/ee_position", "/ee_position"),
            ("~/output/ground_truth", "/sim/ground_truth"),
            ("~/output/episode", "/sim/episode"),
            ("~/output/robot_description", "/robot_description"),
            ("~/input/joint_command", "/control/joint_command"),
        )),
    NodeEntry(
        name="perception", package="kestrel_perception", executable="perception_node",
        module="kestrel_perception.perception_node", params_file="perception.yaml",
        respawn=True,
        remappings=(
            ("~/input/camera_0/image", "/camera/image_raw"),
            ("~/input/camera_0/camera_info", "/camera/camera_info"),
            ("~/input/camera_0/pose", "/camera/pose"),
            ("~/input/points", "/lidar/points"),
            ("~/output/result", "/perception/result"),
            ("~/output/debug_image", "/perception/debug_image"),
        )),
    NodeEntry(
        name="planner", package="kestrel_planner", executable="planner_node",
        module="kestrel_planner.planner_node", params_file="planner.yaml",
        respawn=True,
        remappings=(
            ("~/input/image", "/camera/image_raw"),
            ("~/input/perception", "/perception/result"),
            ("~/input/joint_states", "/joint_states"),
            ("~/input/ee_position", "/ee_position"),
            ("~/output/plan", "/planner/plan"),
            ("~/output/step_status", "/planner/step_status"),
            ("~/output/control_target", "/control/target"),
        )),
    NodeEntry(
        name="control", package="kestrel_control", executable="control_node",
        module="kestrel_control.control_node", params_file="control.yaml",
        remappings=(
            ("~/input/joint_states", "/joint_states"),
            ("~/input/target", "/control/target"),
            ("~/output/joint_command", "/control/joint_command"),
            ("~/output/loop_stats", "/control/loop_stats"),
        )),
)

NODE_NAMES = tuple(e.name for e in STACK)


def entry(name: str) -> NodeEntry:
    for e in STACK:
        if e.name == name:
            return e
    raise KeyError(f"no node '{name}' in the stack (nodes: {', '.join(NODE_NAMES)})")


def config_dir() -> Path:
    """The installed config/ (share/kestrel_bringup/config), else the source tree's."""
    override = os.environ.get("KESTREL_CONFIG_DIR")
    if override:
        return Path(override)
    try:
        from ament_index_python.packages import get_package_share_directory
        share = Path(get_package_share_directory(PACKAGE)) / "config"
        if share.is_dir():
            return share
    except Exception:  # noqa: BLE001 - not installed: fall back to the sources
        pass
    return Path(__file__).resolve().parents[1] / "config"


# Fast DDS participant profile for camera-sized samples (64 MiB SHM segment instead of the
# default 512 KB, large UDP buffers): with the defaults, best-effort 640x640 rgb8 images (1.2 MB)
# were mostly lost between two processes (0-46 of 50 per topic at 10 Hz; 50/50 with the profile;
# config/fastdds_large_data.xml has the measurements). Every process of the stack uses it.
DDS_PROFILE = "fastdds_large_data.xml"


def dds_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that give a node process the stack's Fast DDS profile.

    Empty when the caller's environment already names a profile (the user's wins) or when the
    RMW is not Fast DDS."""
    env = os.environ if env is None else env
    rmw = env.get("RMW_IMPLEMENTATION", "rmw_fastrtps_cpp")
    if env.get("FASTDDS_DEFAULT_PROFILES_FILE") or not rmw.startswith("rmw_fastrtps"):
        return {}
    return {"FASTDDS_DEFAULT_PROFILES_FILE": str(config_dir() / DDS_PROFILE)}


def params_path(e: NodeEntry) -> Path:
    return config_dir() / e.params_file


def ros_args(e: NodeEntry, params_file: Path | None = None,
             extra_params: dict[str, str] | None = None) -> list[str]:
    """`--ros-args ...` for one node: name, params file, use_sim_time, remappings."""
    args = ["--ros-args", "-r", f"__node:={e.name}",
            "--params-file", str(params_file or params_path(e)),
            "-p", f"use_sim_time:={'true' if e.use_sim_time else 'false'}"]
    for key, value in (extra_params or {}).items():
        args += ["-p", f"{key}:={value}"]
    for src, dst in e.remappings:
        args += ["-r", f"{src}:={dst}"]
    return args
