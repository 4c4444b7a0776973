"""The Kestrel control node alone, with config/control.yaml and the stack's remappings.

    ros2 launch kestrel_bringup control.launch.py [use_sim_time:=true] [log_level:=info]
"""

from launch import LaunchDescription

from kestrel_bringup.launch_nodes import declare_common_arguments, node_action


def generate_launch_description() -> LaunchDescription:
    return LaunchDescription(declare_common_arguments() + [node_action("control")])
