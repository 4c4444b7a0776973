"""An Isaac Lab style policy file in the control node over DDS: the observation terms and the
action mapping come from parameters (policy.obs_layout, action_mode, action_scales, action_clip,
default_joint_positions), in the loop process with its C tick; a layout that does not cover
the file's input fails configure, named; a joint target's max_speed is enforced."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch
from sensor_msgs.msg import JointState

from kestrel_common.base_node import COMMAND_QOS, SENSOR_QOS
from kestrel_common.conversions import ns_to_stamp

pytestmark = pytest.mark.dds

MODULE = "kestrel_control.control_node"
JOINTS = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3"]
N = 6
UPPER = [3.0, 2.0, 2.6, 2.6, 2.6, 0.2]  # wrist_3 at 0.2 rad: the clamp is exercised
LOWER = [-3.0, -2.0, -2.6, -2.6, -2.6, -3.0]
DQ = np.array([0.0, -0.5, 1.0, 0.0, 0.5, 0.0])  # default joint positions, rad
Q = np.array([0.3, -0.2, 0.9, -0.4, 0.6, 0.1])  # positions sent, rad (velocities 0)
BIAS = np.array([0.2, -0.4, 3.0, 0.6, -2.5, 1.0], np.float32)  # |a| > 1: clip_actions acts
SCALE, CLIP = 0.5, 1.0
SCALES = np.array([0.5, 0.5, 0.4, 0.5, 0.3, 0.5])  # action_scales: per joint (a scale dict)
LAYOUT = ["joint_pos_rel", "joint_vel", "last_action"]  # mdp.joint_pos_rel, joint_vel_rel, ...


def _export(path, obs_dim: int = 3 * N) -> None:
    """actions = 0.1 * (q - default_q) + BIAS: reads the joint_pos_rel term only."""
    net = torch.nn.Linear(obs_dim, N)
    with torch.no_grad():
        net.weight.zero_()
        net.weight[:, :N] = 0.1 * torch.eye(N)
        net.bias.copy_(torch.from_numpy(BIAS))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(1, obs_dim),), str(path), dynamo=False,
                          input_names=["obs"], output_names=["actions"])


def _params(path, **extra) -> dict:
    return {"loop.rate_hz": 250.0, "loop.stats_period": 0.1, "diagnostics_period": 0.2,
            "safety.max_obs_age": 0.05, "safety.joint_lower": LOWER,
            "safety.joint_upper": UPPER, "policy.model_path": str(path),
            "policy.backend": "onnxruntime", "policy.obs_dim": 3 * N, "loop.mode": "process",
            "policy.obs_layout": LAYOUT, "policy.action_mode": "position_offset",
            "policy.action_scale": SCALE, "policy.action_scales": SCALES.tolist(),
            "policy.action_clip": CLIP, "policy.default_joint_positions": DQ.tolist()} | extra


def test_isaac_lab_mapping_commands_default_q_plus_scaled_clipped_action(
        launch_node, probe, tmp_path):
    path = tmp_path / "policy.onnx"
    _export(path)
    node = launch_node(MODULE, "control", params=_params(path))
    pub = probe.publisher(JointState, "/control/input/joint_states", SENSOR_QOS)
    cmds = probe.subscribe(JointState, "/control/output/joint_command", COMMAND_QOS)
    stop = threading.Event()

    def source() -> None:
        while not stop.is_set():
            msg = JointState(name=JOINTS, position=Q.tolist(), velocity=[0.0] * N)
            msg.header.stamp = ns_to_stamp(probe.now_ns())
            pub.publish(msg)
            time.sleep(0.005)  # publishing rate, not a synchronisation

    thread = threading.Thread(target=source, daemon=True)
    thread.start()
    try:
        msgs = cmds.wait_for(lambda m: len(m) >= 30, timeout=60.0)
        assert len(msgs) >= 30, node.output()
    finally:
        stop.set()
        thread.join(2.0)
    a = 0.1 * (Q - DQ).astype(np.float32) + BIAS  # float32, as the file computes it
    expected = np.clip(DQ + SCALES * np.clip(a.astype(np.float64), -CLIP, CLIP), LOWER, UPPER)
    assert expected[5] == 0.2  # clamped at wrist_3's limit
    for msg in msgs[-10:]:
        assert list(msg.name) == JOINTS + ["finger_left"]  # the gripper's entry last
        np.testing.assert_allclose(np.asarray(msg.position)[:N], expected, rtol=0, atol=1e-6)
    # the reference mapping would have commanded q + 0.5 tanh(a): far from this
    assert np.abs(np.clip(Q + SCALE * np.tanh(a), LOWER, UPPER) - expected).max() > 0.1
    assert "native tick: on" in node.output(), node.output()
    assert node.stop() == 0, node.output()
    assert "Traceback" not in node.output()


def test_a_layout_short_of_the_files_input_fails_configure(launch_node, tmp_path):
    path = tmp_path / "policy.onnx"
    _export(path, obs_dim=3 * N + 3)  # the file also takes a 3-value command
    node = launch_node(MODULE, "control", params=_params(path, **{"policy.obs_dim": 3 * N + 3}))
    assert node.wait_for_output("autostart: configure failed", timeout=60.0), node.output()
    assert ("parameter 'policy.obs_layout': joint_pos_rel 6 + joint_vel 6 + last_action 6 = 18 "
            "values, and the policy (ONNX") in node.output()
    assert node.proc.wait(10) == 2


def test_joint_target_approached_at_most_at_its_max_speed(launch_node, probe, tmp_path):
    """ControlTarget.max_speed (rad/s) limits how fast the joint target the policy sees moves.
    A policy whose command is its target term (obs_layout [target], position_offset, scale 1,
    identity weights) makes that target visible: after a 1 rad step with max_speed 0.5 rad/s
    the commands start at the joint positions, never run ahead of 0.5 rad/s, and arrive."""
    from kestrel_interfaces.msg import ControlTarget

    path = tmp_path / "policy.onnx"
    net = torch.nn.Linear(N, N)
    with torch.no_grad():
        net.weight.copy_(torch.eye(N))
        net.bias.zero_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.zeros(1, N),), str(path), dynamo=False,
                          input_names=["obs"], output_names=["actions"])
    node = launch_node(MODULE, "control", params={
        "loop.rate_hz": 250.0, "safety.max_obs_age": 0.5, "policy.model_path": str(path),
        "policy.backend": "onnxruntime", "policy.obs_dim": N, "policy.obs_layout": ["target"],
        "policy.action_mode": "position_offset", "policy.action_scale": 1.0,
        "safety.target_rate_hz": 50.0})
    pub = probe.publisher(JointState, "/control/input/joint_states", SENSOR_QOS)
    target_pub = probe.publisher(ControlTarget, "/control/input/target", COMMAND_QOS)
    cmds = probe.subscribe(JointState, "/control/output/joint_command", COMMAND_QOS)
    stop = threading.Event()

    def source() -> None:
        while not stop.is_set():
            msg = JointState(name=JOINTS, position=Q.tolist(), velocity=[0.0] * N)
            msg.header.stamp = ns_to_stamp(probe.now_ns())
            pub.publish(msg)
            time.sleep(0.005)  # publishing rate, not a synchronisation

    thread = threading.Thread(target=source, daemon=True)
    thread.start()
    goal = Q + np.array([1.0, -0.6, 0.0, 0.3, 0.0, 0.0])
    speed = 0.5
    try:
        assert cmds.wait_for(lambda m: len(m) >= 10, timeout=60.0), node.output()
        assert probe.wait_for_subscribers(target_pub), node.output()
        t0 = probe.now_ns()
        target_pub.publish(ControlTarget(mode=ControlTarget.MODE_JOINT,
                                         joint_positions=goal.tolist(), max_speed=speed))
        arrived = cmds.wait_for(
            lambda m: np.abs(np.asarray(m[-1].position)[:N] - goal).max() < 1e-6, timeout=30.0)
        assert arrived, node.output()
    finally:
        stop.set()
        thread.join(2.0)
    # before the target arrives the command is the zero target; from then on the target
    # starts at the joint positions ...
    arm = [(stamp_ns(m), np.asarray(m.position)[:N]) for m in cmds.snapshot()]
    after = [(t, q) for t, q in arm if t > t0 and np.any(q != 0.0)]
    # about 2 s of commands at 250 Hz: enough of them to see the ramp (the probe on a loaded
    # 2-CPU machine has received as few as 48: the count is not what this test measures)
    assert len(after) >= 20
    for t, q in after:
        # ... and moves at most `speed` rad/s per joint since the request, plus one ramp step
        assert np.all(np.abs(q - Q) <= speed * (t - t0) * 1e-9 + speed / 50.0 + 1e-6), \
            (t - t0, q - Q)
    assert (after[-1][0] - t0) * 1e-9 >= 1.0 / speed * 0.9  # 1 rad at 0.5 rad/s: ~2 s
    assert node.stop() == 0, node.output()
    assert "Traceback" not in node.output()


def stamp_ns(msg) -> int:
    return msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec
