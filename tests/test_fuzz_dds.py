"""Smoke fuzz of every node over DDS: a bounded burst of malformed and random messages on each
of its inputs, then the process is alive, still publishes /diagnostics, and the drops were
counted there (rule 7: degrade visibly, never crash)."""

from __future__ import annotations

import math
import random
import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from kestrel_interfaces.msg import ControlTarget, PerceptionResult
from sensor_msgs.msg import CameraInfo, Image, JointState, PointCloud2, PointField

from kestrel_common.base_node import COMMAND_QOS, SENSOR_QOS
from ros_harness import diagnostics_values

pytestmark = [pytest.mark.dds, pytest.mark.slow]

BURST = 60  # messages per input
BAD_WORDS = ("drop", "reject", "bad", "nonfinite", "unknown", "stale", "implausible")
VALUES = [math.nan, math.inf, -math.inf, 0.0, 1e9, -1e9, 0.1]


def _image(rng: random.Random) -> Image:
    enc = rng.choice(["rgb8", "bgr8", "mono8", "yuv422", "", "32FC1"])
    w, h = rng.randint(0, 64), rng.randint(0, 48)
    step = rng.choice([w * 3, w, 0, 7])
    return Image(encoding=enc, width=w, height=h, step=step,
                 data=bytes(rng.randint(0, 255) for _ in range(rng.choice([step * h, 5, 0]))))


def _cloud(rng: random.Random) -> PointCloud2:
    names = rng.sample(["x", "y", "z", "i"], rng.randint(0, 4))
    fields = [PointField(name=n, offset=4 * i, datatype=rng.choice([7, 8, 0, 3]), count=1)
              for i, n in enumerate(names)]
    w = rng.randint(0, 50)
    step = rng.choice([12, 16, 0, 5])
    n = rng.choice([w * step, 3, 0])
    return PointCloud2(width=w, height=1, point_step=step, row_step=w * step, fields=fields,
                       data=bytes(rng.randint(0, 255) for _ in range(n)))


def _camera_info(rng: random.Random) -> CameraInfo:
    return CameraInfo(k=[rng.choice(VALUES) for _ in range(9)],
                      d=[rng.choice(VALUES) for _ in range(rng.randint(0, 8))])


def _joint_state(rng: random.Random) -> JointState:
    n = rng.randint(0, 9)
    names = [rng.choice(["shoulder_pan", "elbow", "wrist_3", "nope", "finger_left", ""])
             for _ in range(rng.choice([n, 0]))]
    return JointState(name=names, position=[rng.choice(VALUES) for _ in range(n)],
                      velocity=[rng.choice(VALUES) for _ in range(rng.randint(0, n))])


def _target(rng: random.Random) -> ControlTarget:
    return ControlTarget(joint_positions=[rng.choice(VALUES) for _ in range(rng.randint(0, 8))],
                         max_speed=rng.choice(VALUES), gripper=rng.choice(VALUES))


# node -> (module, params, [(type, topic, qos, make)])
NODES = {
    "perception": ("kestrel_perception.perception_node",
                   {"num_cameras": 1, "model.base_width": 8, "model.fpn_channels": 32,
                    "runtime.torch_threads": 1, "warmup_size": [64, 48],
                    "receive.mode": "executor", "diagnostics_period": 0.2},
                   [(Image, "input/camera_0/image", SENSOR_QOS, _image),
                    (CameraInfo, "input/camera_0/camera_info", SENSOR_QOS, _camera_info),
                    (PointCloud2, "input/points", SENSOR_QOS, _cloud)]),
    "control": ("kestrel_control.control_node",
                {"loop.rate_hz": 200.0, "loop.mode": "thread", "diagnostics_period": 0.2},
                [(JointState, "input/joint_states", SENSOR_QOS, _joint_state),
                 (ControlTarget, "input/target", COMMAND_QOS, _target)]),
    "sim": ("kestrel_sim.sim_node", {"diagnostics_period": 0.2, "lidar_n_vertical": 16},
            [(JointState, "input/joint_command", COMMAND_QOS, _joint_state)]),
    "planner": ("kestrel_planner.planner_node",
                {"model_config": "tiny", "demo_plan": "move_to red_cube speed=0.2; end",
                 "diagnostics_period": 0.2},
                [(Image, "input/image", SENSOR_QOS, _image),
                 (JointState, "input/joint_states", SENSOR_QOS, _joint_state),
                 (PerceptionResult, "input/perception", SENSOR_QOS,
                  lambda rng: PerceptionResult())]),
}


def _dropped(values: dict[str, str]) -> int:
    total = 0
    for key, value in values.items():
        if any(w in key for w in BAD_WORDS):
            try:
                total += int(float(value))
            except ValueError:
                continue
    return total


@pytest.mark.parametrize("which", list(NODES))
def test_a_burst_of_malformed_inputs_is_counted_and_survived(launch_node, probe, which):
    module, params, inputs = NODES[which]
    diag = probe.subscribe(DiagnosticArray, "/diagnostics")
    node = launch_node(module, which, params=params)
    assert diag.wait_for(lambda m: bool(diagnostics_values(m, which)) or not node.alive(),
                         120.0) and node.alive(), node.output()[-3000:]
    before = _dropped(diagnostics_values(diag.snapshot(), which))
    pubs = [(probe.publisher(t, f"/{which}/{topic}", qos), make) for t, topic, qos, make in inputs]
    for pub, _ in pubs:
        assert probe.wait_for_subscribers(pub, timeout=20.0), node.output()[-3000:]
    rng = random.Random(7)
    deadline = time.monotonic() + 10.0  # bounded in count and in time
    for _ in range(BURST):
        for pub, make in pubs:
            pub.publish(make(rng))
        if time.monotonic() > deadline:
            break
        time.sleep(0.005)  # pacing the burst (best-effort depth 1 would overwrite)
    n = len(diag.snapshot())
    ok = diag.wait_for(lambda m: len(m) > n + 2 and
                       _dropped(diagnostics_values(m, which)) > before, 20.0)
    assert node.alive(), node.output()[-3000:]
    assert ok, (diagnostics_values(diag.snapshot(), which), node.output()[-2000:])
    assert "Traceback" not in node.output()
