"""Closed loop over DDS: the sim node and the control node with the differential-IK reference
controller (`controller: ik`), on sim time. A Cartesian target is reached by the simulated arm,
the gripper closes from ControlTarget.gripper, MODE_HOLD holds."""

from __future__ import annotations

import numpy as np
import pytest
from geometry_msgs.msg import Point, PointStamped
from kestrel_interfaces.msg import ControlTarget
from sensor_msgs.msg import JointState

from kestrel_common.base_node import COMMAND_QOS, SENSOR_QOS

pytestmark = pytest.mark.dds

SIM = {"camera_rate_hz": 0.0, "lidar_rate_hz": 0.0, "diagnostics_period": 0.5,
       "joint_state_rate_hz": 500.0, "clock_rate_hz": 500.0}
CONTROL = {"controller": "ik", "loop.rate_hz": 250.0, "use_sim_time": True,
           "safety.max_obs_age": 0.2, "diagnostics_period": 0.5}
REMAPS = {"~/input/joint_states": "/sim/output/joint_states",
          "~/output/joint_command": "/sim/input/joint_command"}


def test_cartesian_target_and_gripper_over_dds(probe, launch_node):
    sim = launch_node("kestrel_sim.sim_node", "sim", params=SIM)
    ctl = launch_node("kestrel_control.control_node", "control", params=CONTROL, remaps=REMAPS)
    ee = probe.subscribe(PointStamped, "/sim/output/ee_position", SENSOR_QOS)
    js = probe.subscribe(JointState, "/sim/output/joint_states", SENSOR_QOS)
    pub = probe.publisher(ControlTarget, "/control/input/target", COMMAND_QOS)
    assert probe.wait_for_subscribers(pub, timeout=60.0), ctl.output()
    assert ee.wait_for(timeout=60.0), sim.output()

    target = np.array([0.45, -0.10, 0.55])
    msg = ControlTarget(mode=ControlTarget.MODE_CARTESIAN, max_speed=0.4, gripper=1.0,
                        position=Point(x=target[0], y=target[1], z=target[2]))
    msg.header.frame_id = "world"
    pub.publish(msg)

    def ee_at(m) -> bool:
        p = m[-1].point
        return len(m) > 0 and np.linalg.norm([p.x - target[0], p.y - target[1],
                                               p.z - target[2]]) < 0.01

    assert ee.wait_for(ee_at, timeout=90.0), (ee.snapshot()[-1], ctl.output())

    def fingers_closed(m) -> bool:  # closed on nothing: both fingers at the limit
        last = m[-1]
        return all(last.position[last.name.index(f)] > 0.04
                   for f in ("finger_left", "finger_right"))

    assert js.wait_for(fingers_closed, timeout=30.0), js.snapshot()[-1]
    # hold: the arm stays where it is
    pub.publish(ControlTarget(mode=ControlTarget.MODE_HOLD, gripper=1.0))
    p0 = ee.snapshot()[-1]
    t0 = p0.header.stamp.sec + p0.header.stamp.nanosec * 1e-9

    def later(m) -> bool:
        s = m[-1].header.stamp
        return s.sec + s.nanosec * 1e-9 > t0 + 0.5

    last = ee.wait_for(later, timeout=30.0)[-1].point
    assert np.linalg.norm([last.x - target[0], last.y - target[1], last.z - target[2]]) < 0.01
    assert sim.alive() and ctl.alive()
    assert "Traceback" not in ctl.output(), ctl.output()
