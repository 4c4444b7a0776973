"""The control node batching two robots over DDS: each robot's commands follow its own joint
states on its own topic; a Cartesian target is held (not read as zeros); a user's ONNX policy
with the wrong action count fails configure with a clear message."""

from __future__ import annotations

import threading
import time
import warnings

import numpy as np
import pytest
import torch
from diagnostic_msgs.msg import DiagnosticArray
from kestrel_interfaces.msg import ControlTarget
from sensor_msgs.msg import JointState

from kestrel_common.base_node import COMMAND_QOS, SENSOR_QOS
from kestrel_common.conversions import ns_to_stamp
from ros_harness import diagnostics_values

pytestmark = pytest.mark.dds

MODULE = "kestrel_control.control_node"
JOINTS = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3"]
SCALE = 0.05
QS = {"left": np.full(6, 0.4), "right": np.full(6, -0.6)}
PARAMS = {"loop.rate_hz": 250.0, "loop.stats_period": 0.1, "diagnostics_period": 0.2,
          "safety.max_obs_age": 0.05, "policy.action_scale": SCALE, "robots": ["left", "right"]}


@pytest.mark.parametrize("loop_mode", ["thread", "process"])
def test_two_robots_own_topics_and_cartesian_target_held(launch_node, probe, loop_mode):
    node = launch_node(MODULE, "control", params=PARAMS | {"loop.mode": loop_mode})
    pubs = {ns: probe.publisher(JointState, f"/control/{ns}/input/joint_states", SENSOR_QOS)
            for ns in QS}
    cmds = {ns: probe.subscribe(JointState, f"/control/{ns}/output/joint_command", COMMAND_QOS)
            for ns in QS}
    target_pub = probe.publisher(ControlTarget, "/control/left/input/target", COMMAND_QOS)
    diag = probe.subscribe(DiagnosticArray, "/diagnostics")
    stop = threading.Event()

    def source() -> None:
        while not stop.is_set():
            for ns, q in QS.items():
                msg = JointState(name=JOINTS, position=q.tolist(), velocity=[0.0] * 6)
                msg.header.stamp = ns_to_stamp(probe.now_ns())
                pubs[ns].publish(msg)
            time.sleep(0.005)  # publishing rate, not a synchronisation

    thread = threading.Thread(target=source, daemon=True)
    thread.start()
    try:
        for ns, q in QS.items():
            msgs = cmds[ns].wait_for(lambda m: len(m) >= 50, timeout=30.0)
            assert len(msgs) >= 50, node.output()
            for msg in msgs[-20:]:
                np.testing.assert_array_less(np.abs(np.asarray(msg.position)[:6] - q), SCALE + 1e-9)
        assert probe.wait_for_subscribers(target_pub, timeout=10.0)
        assert probe.publish_until(
            target_pub, lambda: ControlTarget(mode=ControlTarget.MODE_CARTESIAN),
            lambda: int(diagnostics_values(diag.snapshot(), "control").get(
                "target_cartesian_held", "0")) >= 1, period=0.1, timeout=10.0), node.output()
        assert "target_bad_length" not in diagnostics_values(diag.snapshot(), "control")
    finally:
        stop.set()
        thread.join(2.0)
    assert node.stop() == 0, node.output()
    assert "Traceback" not in node.output()


def test_onnx_policy_with_too_few_actions_fails_configure(launch_node, tmp_path):
    path = tmp_path / "policy.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.nn.Linear(64, 4), (torch.zeros(1, 64),), str(path),
                          dynamo=False, input_names=["obs"], output_names=["actions"])
    node = launch_node(MODULE, "control", params={
        "policy.model_path": str(path), "policy.backend": "onnxruntime", "policy.obs_dim": 64})
    assert node.wait_for_output("autostart: configure failed", timeout=30.0), node.output()
    assert "parameter 'policy.model_path': the policy (ONNX" in node.output()
    assert "outputs 4 actions and the robot has 6 joints" in node.output()
    assert node.proc.wait(10) == 2
