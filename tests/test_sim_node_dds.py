"""The sim node (kestrel_sim.sim_node) as its own process, checked over DDS.

Outputs are checked by content: the camera image is checked against the ground truth through
the published CameraInfo and camera pose (the red cube's projection is red), the LiDAR cloud
against the table height, joint states against the commanded targets.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import PointStamped, PoseStamped
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import CameraInfo, Image, JointState, PointCloud2

from ros_harness import diagnostics_values

pytestmark = pytest.mark.dds

MODULE = "kestrel_sim.sim_node"
JOINTS = ["shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3"]
FINGERS = ["finger_left", "finger_right"]  # finger_left is the gripper's driven joint, m
HOME = np.array([0.0, -0.2, 1.4, 1.2, 0.0, 0.0])  # SimWorldConfig.home_joint_positions, rad
RED_CUBE_DEFAULT = np.array([0.5, -0.15, 0.425])  # m
FAST = {"diagnostics_period": 0.3, "lidar_n_vertical": 16}  # lighter on the shared CPU


# Tests take (probe, launch_node) in this order so that the node process is stopped before the
# probe is torn down (no high-rate traffic into a probe that is being destroyed).


def _qos():
    from kestrel_common.base_node import COMMAND_QOS, LATCHED_QOS, SENSOR_QOS
    return SENSOR_QOS, COMMAND_QOS, LATCHED_QOS


def _ns(stamp) -> int:
    return stamp.sec * 1_000_000_000 + stamp.nanosec


def _latest_q(js) -> np.ndarray:
    msg = js.snapshot()[-1]
    return np.array([msg.position[msg.name.index(n)] for n in JOINTS])


def _gt_pos(msg, name: str) -> np.ndarray:
    o = next(o for o in msg.objects if o.name == name)
    return np.array([o.pose.position.x, o.pose.position.y, o.pose.position.z])


def test_streams_clock_camera_lidar_joints(probe, launch_node):
    from kestrel_interfaces.msg import GroundTruth

    from kestrel_common.conversions import camera_info_to_k, image_to_numpy, pointcloud2_to_xyz
    sensor, _, latched = _qos()
    node = launch_node(MODULE, "sim", params={**FAST, "publish_depth": True})
    clock = probe.subscribe(Clock, "/clock", sensor)
    img = probe.subscribe(Image, "/sim/output/image", sensor)
    depth = probe.subscribe(Image, "/sim/output/depth", sensor)
    info = probe.subscribe(CameraInfo, "/sim/output/camera_info", sensor)
    pose = probe.subscribe(PoseStamped, "/sim/output/camera_pose", latched)
    pts = probe.subscribe(PointCloud2, "/sim/output/points", sensor)
    js = probe.subscribe(JointState, "/sim/output/joint_states", sensor)
    ee = probe.subscribe(PointStamped, "/sim/output/ee_position", sensor)
    gt = probe.subscribe(GroundTruth, "/sim/output/ground_truth", latched)
    diag = probe.subscribe(DiagnosticArray, "/diagnostics")

    assert img.wait_for(lambda m: len(m) >= 3, timeout=40.0), node.output()
    for col in (info, pose, pts, js, gt, depth, ee):
        assert col.wait_for(timeout=10.0), (col.topic, node.output())
    # tool centre point (forward kinematics): world frame, sim-time stamp, above the floor
    e = ee.snapshot()[-1]
    assert e.header.frame_id == "world" and _ns(e.header.stamp) > 0
    tcp = np.array([e.point.x, e.point.y, e.point.z])
    assert np.all(np.isfinite(tcp)) and 0.0 < tcp[2] < 2.0 and np.linalg.norm(tcp[:2]) < 1.5
    # /clock advances, at about real time (loose: the CPU is shared)
    c0 = clock.snapshot()[-1]
    w0 = time.monotonic()
    msgs = clock.wait_for(lambda m: _ns(m[-1].clock) - _ns(c0.clock) > 1_000_000_000, 20.0)
    ratio = (_ns(msgs[-1].clock) - _ns(c0.clock)) / 1e9 / (time.monotonic() - w0)
    assert 0.3 < ratio < 1.5, ratio
    stamps = [_ns(m.clock) for m in msgs]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    latest_clock = stamps[-1]

    # image + matching CameraInfo (same stamp, K from fovy 50 deg)
    images = img.snapshot()
    infos = {_ns(m.header.stamp): m for m in info.snapshot()}
    im = next(m for m in reversed(images) if _ns(m.header.stamp) in infos)
    ci = infos[_ns(im.header.stamp)]
    assert (im.width, im.height, im.encoding, im.step) == (320, 256, "rgb8", 960)
    assert len(im.data) == 960 * 256
    assert im.header.frame_id == ci.header.frame_id == "camera_optical_frame"
    # sim time, not wall time: the image's stamp is one /clock reaches (the image may arrive
    # before the /clock message of the same instant: they travel on different topics)
    im_ns = _ns(im.header.stamp)
    assert 0 < im_ns < 10**15
    clocks = clock.wait_for(lambda m: _ns(m[-1].clock) >= im_ns, timeout=5.0)
    assert _ns(clocks[-1].clock) >= im_ns > latest_clock - 10**10
    f = 128.0 / math.tan(math.radians(25.0))
    k = camera_info_to_k(ci)
    np.testing.assert_allclose(k, [[f, 0, 159.5], [0, f, 127.5], [0, 0, 1]], rtol=1e-9)
    assert ci.distortion_model == "plumb_bob" and list(ci.d) == [0.0] * 5
    np.testing.assert_allclose(np.array(ci.p).reshape(3, 4)[:, :3], k)
    assert (ci.width, ci.height) == (320, 256)

    # content: the red cube's top face projects onto red pixels (K + camera pose + ground truth)
    ps = pose.snapshot()[-1]
    assert ps.header.frame_id == "world"
    q = ps.pose.orientation
    w, x, y, z = q.w, q.x, q.y, q.z
    rot = np.array([[1 - 2 * (y * y + z * z), 2 * (x * y - z * w), 2 * (x * z + y * w)],
                    [2 * (x * y + z * w), 1 - 2 * (x * x + z * z), 2 * (y * z - x * w)],
                    [2 * (x * z - y * w), 2 * (y * z + x * w), 1 - 2 * (x * x + y * y)]])
    cam_pos = np.array([ps.pose.position.x, ps.pose.position.y, ps.pose.position.z])
    red = _gt_pos(gt.snapshot()[-1], "red_cube")
    np.testing.assert_allclose(red, RED_CUBE_DEFAULT, atol=2e-3)
    p_cam = rot.T @ (red + [0, 0, 0.024] - cam_pos)
    u, v = (k @ p_cam)[:2] / p_cam[2]
    rgb = image_to_numpy(im, accept=("rgb8",)).astype(int)
    r, g, b = rgb[int(round(v)), int(round(u))]
    assert r > 100 and r > 2 * g and r > 2 * b, (u, v, (r, g, b))
    assert np.count_nonzero((rgb[..., 0] > 100) & (rgb[..., 0] > 2 * rgb[..., 1])) > 20
    # depth (32FC1, m along the optical axis) at that pixel = the cube top's optical depth
    dm = depth.snapshot()[-1]
    assert (dm.encoding, dm.width, dm.height) == ("32FC1", 320, 256)
    assert dm.header.frame_id == "camera_optical_frame"
    d = image_to_numpy(dm, accept=("32FC1",))
    assert d[int(round(v)), int(round(u))] == pytest.approx(p_cam[2], abs=0.01)

    # LiDAR: finite points in the world frame, the table top at z = 0.40 m
    cloud = pts.snapshot()[-1]
    xyz = pointcloud2_to_xyz(cloud)
    assert cloud.header.frame_id == "world" and len(xyz) > 1000
    assert np.all(np.isfinite(xyz))
    assert np.count_nonzero(np.abs(xyz[:, 2] - 0.40) < 1e-3) > 200
    assert np.min(np.linalg.norm(xyz - (red + [0, 0, 0.025]), axis=1)) < 0.03
    # camera and LiDAR at the same rate are triggered together: one snapshot, one stamp
    # (the perception node pairs them within sync_slop)
    assert {_ns(m.header.stamp) for m in img.snapshot()} & \
        {_ns(m.header.stamp) for m in pts.snapshot()}, "no image and cloud share a stamp"

    # joint states: the 6 arm joints at the home pose, then both fingers (open)
    jm = js.snapshot()[-1]
    assert list(jm.name) == JOINTS + FINGERS and len(jm.position) == len(jm.velocity) == 8
    assert max(abs(v) for v in jm.position[6:]) < 2e-3
    np.testing.assert_allclose(_latest_q(js), HOME, atol=0.02)

    vals = diagnostics_values(diag.wait_for(
        lambda m: float(diagnostics_values(m, "sim").get("physics_steps_per_s", 0)) > 0), "sim")
    assert float(vals["physics_steps_per_s"]) > 200, vals
    assert node.alive()
    # Ctrl-C while the physics and sensor threads publish: a clean exit
    assert node.stop() == 0
    assert "Traceback" not in node.output(), node.output()


def test_joint_commands_and_bad_commands(probe, launch_node):
    sensor, command, _ = _qos()
    node = launch_node(MODULE, "sim", params={**FAST, "camera_rate_hz": 1.0,
                                              "lidar_rate_hz": 1.0})
    js = probe.subscribe(JointState, "/sim/output/joint_states", sensor)
    diag = probe.subscribe(DiagnosticArray, "/diagnostics")
    pub = probe.publisher(JointState, "/sim/input/joint_command", command)
    assert probe.wait_for_subscribers(pub, timeout=30.0), node.output()
    assert js.wait_for(timeout=20.0), node.output()

    # a named command, names in another order: matched by name
    target = HOME + np.array([0.4, 0.3, -0.3, 0.2, 0.3, -0.5])
    order = [5, 2, 0, 4, 1, 3]
    good = JointState(name=[JOINTS[i] for i in order], position=[target[i] for i in order])
    pub.publish(good)

    def at(q_goal, tol=0.03):
        return lambda m: len(m) > 0 and np.max(np.abs(_latest_q(js) - q_goal)) < tol

    assert js.wait_for(at(target), timeout=20.0), (_latest_q(js), target)

    # bad commands: each is counted and ignored, the last good targets are kept
    bad = [
        JointState(name=JOINTS, position=[0.0] * 5),  # wrong length (named)
        JointState(position=[0.0] * 5),  # wrong length (unnamed)
        JointState(name=JOINTS, position=[0.0, math.nan, 0.0, 0.0, 0.0, 0.0]),  # NaN
        JointState(name=JOINTS[:5] + ["gripper"], position=[0.0] * 6),  # unknown joint
    ]
    for msg in bad:
        pub.publish(msg)
    want = {"joint_command_bad_length": "2", "joint_command_nonfinite": "1",
            "joint_command_unknown_joint": "1", "joint_command_applied": "1"}
    msgs = diag.wait_for(lambda m: all(diagnostics_values(m, "sim").get(k) == v
                                       for k, v in want.items()), timeout=20.0)
    vals = diagnostics_values(msgs, "sim")
    assert all(vals.get(k) == v for k, v in want.items()), vals
    t_after = _ns(js.snapshot()[-1].header.stamp)
    js.wait_for(lambda m: _ns(m[-1].header.stamp) > t_after + 300_000_000, timeout=10.0)
    np.testing.assert_allclose(_latest_q(js), target, atol=0.03)  # did not move to zeros
    assert "dropped input (joint_command_" in node.output()  # logged (throttled)

    # still working: an unnamed full command is applied
    pub.publish(JointState(position=HOME.tolist()))
    assert js.wait_for(at(HOME), timeout=20.0), _latest_q(js)
    # the gripper: its driven finger joint by name (m); both fingers close
    pub.publish(JointState(name=["finger_left"], position=[0.03]))
    assert js.wait_for(lambda m: len(m) > 0 and all(
        abs(m[-1].position[m[-1].name.index(f)] - 0.03) < 2e-3 for f in FINGERS),
        timeout=20.0), js.snapshot()[-1]
    assert node.alive()


def test_reset_service(probe, launch_node):
    from kestrel_interfaces.msg import EpisodeStatus, GroundTruth
    from kestrel_interfaces.srv import ResetWorld
    _, _, latched = _qos()
    node = launch_node(MODULE, "sim", params={**FAST, "camera_rate_hz": 1.0,
                                              "lidar_rate_hz": 1.0})
    gt = probe.subscribe(GroundTruth, "/sim/output/ground_truth", latched)
    ep = probe.subscribe(EpisodeStatus, "/sim/output/episode", latched)
    cli = probe.node.create_client(ResetWorld, "/sim/reset")
    assert cli.wait_for_service(timeout_sec=30.0), node.output()
    assert gt.wait_for(timeout=20.0)
    np.testing.assert_allclose(_gt_pos(gt.snapshot()[-1], "red_cube"), RED_CUBE_DEFAULT,
                               atol=2e-3)

    def call(seed: int, goal: str = "") -> tuple[ResetWorld.Response, int]:
        fut = cli.call_async(ResetWorld.Request(seed=seed, goal_object=goal))
        deadline = time.monotonic() + 15.0
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert fut.done(), "reset service did not answer"
        return fut.result(), _ns(gt.snapshot()[-1].header.stamp)

    resp, t_before = call(5, "green_cube")
    assert resp.success, resp.message
    assert resp.seed == 5 and list(resp.objects) == ["red_cube", "green_cube", "blue_cylinder"]
    status = ep.wait_for(lambda m: len(m) > 0 and m[-1].seed == 5, timeout=10.0)[-1]
    assert status.goal_object == "green_cube" and status.episode == 1
    assert not status.success and list(status.objects_in_bin) == []
    assert list(status.objects_present) == list(resp.objects)
    assert status.header.frame_id == "world"
    bad, _ = call(6, "purple_unicorn")  # not a task object: refused, nothing reset
    assert not bad.success and "goal_object" in bad.message
    msgs = gt.wait_for(lambda m: _ns(m[-1].header.stamp) > t_before, timeout=10.0)
    moved = _gt_pos(msgs[-1], "red_cube")
    assert np.linalg.norm(moved[:2] - RED_CUBE_DEFAULT[:2]) > 0.01, moved
    assert abs(moved[2] - RED_CUBE_DEFAULT[2]) < 3e-3  # on the table
    assert _ns(msgs[-1].header.stamp) > t_before  # the clock did not go back

    resp, t_before = call(0)
    assert resp.success, resp.message
    msgs = gt.wait_for(lambda m: _ns(m[-1].header.stamp) > t_before, timeout=10.0)
    np.testing.assert_allclose(_gt_pos(msgs[-1], "red_cube"), RED_CUBE_DEFAULT, atol=2e-3)
    assert node.alive()


@pytest.mark.parametrize("params,fragment", [
    ({"physics_rate_hz": 50.0}, "parameter 'physics_rate_hz' = 50.0: must be >= 100.0"),
    ({"world_file": "/nonexistent/world.xml"},
     "parameter 'world_file' = '/nonexistent/world.xml': file not found"),
    ({"clock_rate_hz": 2000.0}, "parameter 'clock_rate_hz' = 2000.0: must be <= physics_rate_hz"),
])
def test_bad_parameter_fails_configure(launch_node, params, fragment):
    node = launch_node(MODULE, "sim", params=params)
    assert node.wait_for_output("autostart: configure failed", timeout=30.0), node.output()
    assert fragment in node.output()
    assert node.proc.wait(15) == 2
    assert "Traceback" not in node.output()
