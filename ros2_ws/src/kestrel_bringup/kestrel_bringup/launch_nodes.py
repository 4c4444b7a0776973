"""launch_ros Node actions built from the stack table (stack.py). Used by launch/*.launch.py.

Imports launch/launch_ros (present in a ROS 2 distro, absent from PyPI): only launch files
and launch tests import this module.
"""

from __future__ import annotations

from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import Node
from launch_ros.parameter_descriptions import ParameterValue

from kestrel_bringup.stack import NodeEntry, dds_environment, entry, params_path


def declare_common_arguments() -> list[DeclareLaunchArgument]:
    return [
        DeclareLaunchArgument("use_sim_time", default_value="true",
                              description="Use /clock from the simulator (or a bag)."),
        DeclareLaunchArgument("log_level", default_value="info",
                              description="Logging level of every node."),
    ]


def node_action(e: NodeEntry | str) -> Node:
    """One Node action: its params file, use_sim_time, remappings, autostart (lifecycle),
    respawn policy."""
    e = entry(e) if isinstance(e, str) else e
    sim_time = (ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool)
                if e.use_sim_time else False)
    return Node(
        package=e.package,
        executable=e.executable,
        name=e.name,
        output="screen",
        emulate_tty=True,
        parameters=[str(params_path(e)), {"use_sim_time": sim_time}],
        remappings=list(e.remappings),
        arguments=["--ros-args", "--log-level", LaunchConfiguration("log_level")],
        additional_env=dds_environment(),  # the large-data Fast DDS profile (stack.py)
        respawn=e.respawn,
        respawn_delay=e.respawn_delay,
    )
