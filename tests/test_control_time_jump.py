"""The control node in this process (its real-time loop thread, no executor, no DDS traffic)
across a backwards jump of its clock (sim time: /clock from 1000 s back to 10 s, as at a sim
restart): the joint state and joint targets of before (a speed-limited one's ramp too) are
forgotten, nothing is commanded until a joint state of after the jump, then the arm is held
where it is (never sent to a target of before), and the jump is counted on /diagnostics."""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus
from kestrel_interfaces.msg import ControlTarget
from rclpy.time import Time
from sensor_msgs.msg import JointState

from kestrel_common.conversions import ns_to_stamp

S = 1_000_000_000
JOINTS = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3"]
Q_BEFORE = np.array([0.1, -0.5, 1.0, -0.4, 0.5, 0.0])  # rad: the arm before the jump
TARGET_BEFORE = np.array([0.6, -0.2, 0.8, -0.9, 0.3, 0.4])  # the joint target before it
Q_AFTER = np.array([0.0, -0.3, 0.7, -0.2, 0.2, 0.1])  # the restarted sim's arm
PARAMS = {"controller": "ik", "use_sim_time": True, "loop.mode": "thread",
          "loop.rate_hz": 500.0, "loop.rt_priority": 0, "safety.max_obs_age": 0.5,
          "autostart": False, "gc_freeze": False, "joint_names": JOINTS}


class Commands:
    """Stands in for the joint-command publisher (the loop thread publishes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.positions: list[np.ndarray] = []

    def publish(self, msg: JointState) -> None:
        with self.lock:
            self.positions.append(np.array(msg.position[:6]))

    def snapshot(self) -> list[np.ndarray]:
        with self.lock:
            return list(self.positions)


def wait_until(pred, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.005)  # polling the condition, bounded by the deadline
    return pred()


@contextlib.contextmanager
def local_node(ros_domain: int):
    import rclpy
    from rclpy.parameter import Parameter

    from kestrel_control.control_node import ControlNode

    ctx = rclpy.Context()
    rclpy.init(context=ctx, domain_id=ros_domain)
    node = ControlNode(context=ctx, parameter_overrides=[
        Parameter(k, value=v) for k, v in PARAMS.items()])
    try:
        yield node
    finally:
        node.stop_workers()
        node.trigger_cleanup()
        node.destroy_node()
        rclpy.try_shutdown(context=ctx)


def set_clock(node, t_ns: int) -> None:  # noqa: ANN001
    """The node's sim time, as /clock would set it (the loop thread reads the same clock)."""
    clock = node.get_clock()
    clock._set_ros_time_is_active(True)
    clock.set_ros_time_override(Time(nanoseconds=t_ns))


def joint_state(q: np.ndarray, stamp_ns: int) -> JointState:
    msg = JointState(name=JOINTS, position=q.tolist(), velocity=[0.0] * 6)
    msg.header.stamp = ns_to_stamp(stamp_ns)
    return msg


def test_a_backwards_jump_forgets_the_state_and_target_of_before(ros_domain):
    with local_node(ros_domain) as node:
        set_clock(node, 1000 * S)
        node.trigger_configure()
        commands = Commands()
        node._cmd_pubs = [commands]
        node.trigger_activate()
        stats = node._stats
        node._on_joint_state(0, joint_state(Q_BEFORE, 1000 * S))
        target = ControlTarget(mode=ControlTarget.MODE_JOINT,
                               joint_positions=TARGET_BEFORE.tolist())
        target.header.stamp = ns_to_stamp(1000 * S)
        node._on_target(0, target)
        assert wait_until(lambda: any(np.allclose(c, TARGET_BEFORE)
                                      for c in commands.snapshot())), commands.snapshot()[-3:]
        slow = ControlTarget(mode=ControlTarget.MODE_JOINT, joint_positions=[0.0] * 6,
                             max_speed=0.05)  # rad/s: a ramp the node's timer would advance
        slow.header.stamp = ns_to_stamp(1000 * S)
        node._on_target(0, slow)
        assert node._ramps[0].active

        set_clock(node, 10 * S)  # the sim restarts
        assert wait_until(lambda: stats.time_jumps_back == 1)
        sent = len(commands.snapshot())
        cycles = stats.cycles
        assert wait_until(lambda: stats.cycles >= cycles + 100)  # 100 ticks with no input
        assert len(commands.snapshot()) == sent, "commands from the joint state of before"

        node._on_joint_state(0, joint_state(Q_AFTER, 10 * S))
        assert not node._ramps[0].active  # the ramp of before is dropped by the callbacks
        assert wait_until(lambda: len(commands.snapshot()) >= sent + 20)
        after = commands.snapshot()[sent:]
        assert all(np.allclose(c, Q_AFTER) for c in after), after[:3]  # held where it is
        level, message, values = node._diagnostic_status()
        assert values["loop_time_jumps_back"] == 1
        assert level == DiagnosticStatus.WARN and "time_jumps_back +1" in message
