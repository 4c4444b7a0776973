"""The whole Kestrel stack: embedded MuJoCo sim + perception + planner + control.

    ros2 launch kestrel_bringup stack.launch.py [use_sim_time:=true] [log_level:=info]

Each node reads config/<node>.yaml; topics are remapped per kestrel_bringup/stack.py (the same
table the launch-free runner `ros2 run kestrel_bringup run_stack` uses). Nodes are lifecycle
nodes that configure+activate themselves (parameter autostart: true in their YAML).
"""

from launch import LaunchDescription

from kestrel_bringup.launch_nodes import declare_common_arguments, node_action
from kestrel_bringup.stack import STACK


def generate_launch_description() -> LaunchDescription:
    return LaunchDescription(declare_common_arguments() + [node_action(e) for e in STACK])
