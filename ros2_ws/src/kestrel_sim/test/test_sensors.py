"""CameraSensor and LidarSensor: geometry checked against the world (no ROS).

The camera test projects known world points with K and T_world_from_cam and checks the pixel
colours; depth is checked against MuJoCo ray casts through the same pixels.
"""

from __future__ import annotations

import os
import threading
import time

import mujoco
import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "osmesa")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

from kestrel_sim.core import CLASS_NAMES, CameraSensor, LidarSensor, SimWorld  # noqa: E402

W, H = 320, 256


@pytest.fixture(scope="module")
def world() -> SimWorld:
    return SimWorld()


@pytest.fixture(scope="module")
def camera(world: SimWorld):
    cam = CameraSensor(world, W, H)
    yield cam
    cam.close()


def project(cam: CameraSensor, p_world: np.ndarray) -> np.ndarray:
    """World point(s) [..., 3] -> pixel (u, v) [..., 2] with K and T_world_from_cam."""
    t = cam.extrinsics()
    p_cam = (np.asarray(p_world) - t[:3, 3]) @ t[:3, :3]  # R^T (p - c)
    assert np.all(p_cam[..., 2] > 0)
    uvw = p_cam @ cam.intrinsics().T
    return uvw[..., :2] / uvw[..., 2:3]


def colour_mask(rgb: np.ndarray, name: str) -> np.ndarray:
    r, g, b = (rgb[..., i].astype(int) for i in range(3))
    return {"red_cube": (r > 100) & (r > 2 * g) & (r > 2 * b),
            "green_cube": (g > 100) & (g > 2 * r) & (g > 2 * b),
            "blue_cylinder": (b > 100) & (b > 2 * r) & (b > 2 * g)}[name]


def test_intrinsics_and_extrinsics(world: SimWorld, camera: CameraSensor) -> None:
    k = camera.intrinsics()
    f = (H / 2) / np.tan(np.deg2rad(50.0) / 2)  # fovy 50 deg in tabletop.xml
    np.testing.assert_allclose(k, [[f, 0, (W - 1) / 2], [0, f, (H - 1) / 2], [0, 0, 1]])
    t = camera.extrinsics()
    r = t[:3, :3]
    np.testing.assert_allclose(r.T @ r, np.eye(3), atol=1e-9)
    assert np.linalg.det(r) == pytest.approx(1.0)
    np.testing.assert_allclose(t[:3, 3], [1.35, 0, 1.05], atol=1e-9)
    np.testing.assert_allclose(t[3], [0, 0, 0, 1])
    # optical z looks from the camera down at the table centre; image y (down) has -z in world;
    # image x (right) is world +y (the camera faces -x)
    fwd = np.array([0.58, 0, 0.40]) - t[:3, 3]
    np.testing.assert_allclose(r[:, 2], fwd / np.linalg.norm(fwd), atol=1e-3)
    assert r[2, 1] < -0.5
    np.testing.assert_allclose(r[:, 0], [0, 1, 0], atol=1e-3)


def test_projection_hits_object_colours(world: SimWorld, camera: CameraSensor) -> None:
    world.reset(0)
    frame = camera.render()
    assert frame.rgb.shape == (H, W, 3) and frame.rgb.dtype == np.uint8
    assert frame.depth.shape == (H, W) and frame.depth.dtype == np.float32
    assert frame.stamp_ns == world.sim_time_ns
    for o in world.ground_truth():
        if o.name not in ("red_cube", "green_cube", "blue_cylinder"):
            continue
        top = o.position + np.array([0, 0, o.size[2] / 2 - 1e-3])  # centre of the top face
        u, v = np.round(project(camera, top)).astype(int)
        assert 0 <= u < W and 0 <= v < H
        assert colour_mask(frame.rgb, o.name)[v, u], (o.name, (u, v), frame.rgb[v, u])
        # the object's blob is where the projection of its centre says (<= 3 px)
        vs, us = np.nonzero(colour_mask(frame.rgb, o.name))
        assert len(us) > 20
        uc, vc = project(camera, o.position)
        assert abs(us.mean() - uc) < 3.0 and abs(vs.mean() - vc) < 3.0, o.name
        # depth at the top-face pixel is the optical-axis depth of that point
        t = camera.extrinsics()
        z_expected = (top - t[:3, 3]) @ t[:3, 2]
        assert frame.depth[v, u] == pytest.approx(z_expected, abs=0.01)


def test_depth_matches_ray_casts(world: SimWorld, camera: CameraSensor) -> None:
    """Depth = distance along the optical axis of the surface the pixel's ray hits.

    The tolerance allows half a pixel of position (llvmpipe evaluates depth ~0.4 px away from
    the pixel centre; a GPU does not): 1 mm + 0.5 x the local depth change per pixel.
    """
    world.reset(0)
    frame = camera.render()
    k_inv = np.linalg.inv(camera.intrinsics())
    t = camera.extrinsics()
    origin = t[:3, 3].copy()
    errs, n_checked = [], 0
    geomid = np.zeros(1, dtype=np.int32)
    for v in range(4, H - 1, 7):
        for u in range(4, W - 1, 7):
            ray_w = t[:3, :3] @ (k_inv @ np.array([u, v, 1.0]))  # optical z component = 1
            dist = mujoco.mj_ray(world.model, world.data, origin, ray_w, None, 1, -1, geomid)
            if dist < 0:
                assert not np.isfinite(frame.depth[v, u])
                continue
            patch = frame.depth[v - 1:v + 2, u - 1:u + 2]
            if np.ptp(patch) > 0.03:  # skip depth edges
                continue
            c = patch[1, 1]  # skip one-pixel features (a thin wall's top seen edge-on)
            if not (min(patch[0, 1], patch[2, 1]) <= c <= max(patch[0, 1], patch[2, 1])):
                continue
            grad = max(abs(patch[2, 1] - patch[0, 1]), abs(patch[1, 2] - patch[1, 0])) / 2
            err = abs(frame.depth[v, u] - dist)  # unit optical z: ray parameter = depth
            assert err <= 1e-3 + 0.5 * grad, ((u, v), err, grad)
            errs.append(err)
            n_checked += 1
    assert n_checked > 1000
    assert np.median(errs) < 2e-3


def test_render_follows_state_changes(world: SimWorld, camera: CameraSensor) -> None:
    world.reset(0)
    before = camera.render()
    red_before = colour_mask(before.rgb, "red_cube").sum()
    world.reset(7)  # the cubes move
    world.step(1)
    after = camera.render()
    assert after.stamp_ns > before.stamp_ns
    assert not np.array_equal(before.rgb, after.rgb)
    assert red_before > 20 and colour_mask(after.rgb, "red_cube").sum() > 20
    red = next(o for o in world.ground_truth() if o.name == "red_cube")
    vs, us = np.nonzero(colour_mask(after.rgb, "red_cube"))
    uc, vc = project(camera, red.position)
    assert abs(us.mean() - uc) < 3.0 and abs(vs.mean() - vc) < 3.0
    world.reset(0)


def test_triggered_together_camera_and_lidar_share_the_snapshot(world: SimWorld,
                                                                 camera: CameraSensor) -> None:
    """A snapshot taken once (world.take_snapshot) and given to both sensors: the image and the
    scan carry its stamp and show its state, even after the world moved on (what the sim node
    does when both are due: the perception node pairs them by stamp)."""
    lidar = LidarSensor(world)
    world.reset(0)
    snap, stamp = world.take_snapshot()
    ref_frame, ref_scan = camera.render(), lidar.scan()  # the same state, own snapshots
    world.reset(7)  # the cubes move
    world.step(5)
    frame, scan = camera.render(snap, stamp), lidar.scan(snap, stamp)
    assert frame.stamp_ns == scan.stamp_ns == stamp < world.sim_time_ns
    np.testing.assert_array_equal(frame.rgb, ref_frame.rgb)
    np.testing.assert_array_equal(scan.points, ref_scan.points)
    assert not np.array_equal(camera.render().rgb, frame.rgb)  # the world did move
    world.reset(0)


def test_render_on_other_thread_while_stepping(world: SimWorld, camera: CameraSensor) -> None:
    world.reset(0)
    stop = threading.Event()

    def physics() -> None:
        while not stop.is_set():
            world.step(5)

    frames = []
    th = threading.Thread(target=physics)
    th.start()
    try:
        deadline = time.monotonic() + 10.0
        while len(frames) < 3 and time.monotonic() < deadline:
            frames.append(camera.render())
    finally:
        stop.set()
        th.join(timeout=5.0)
    assert len(frames) == 3
    stamps = [f.stamp_ns for f in frames]
    assert stamps == sorted(stamps) and stamps[-1] > stamps[0]
    for f in frames:
        assert colour_mask(f.rgb, "green_cube").sum() > 20


def test_lidar_points_on_surfaces(world: SimWorld) -> None:
    world.reset(0)
    lidar = LidarSensor(world, n_vertical=32, n_horizontal=360, max_range=5.0)
    scan = lidar.scan()
    n = len(scan.points)
    assert scan.points.dtype == np.float32 and scan.points.shape == (n, 3)
    assert 0 < n <= lidar.n_rays == 32 * 360
    assert np.all(np.isfinite(scan.points))
    assert scan.ranges.shape == scan.rings.shape == scan.class_index.shape == (n,)
    assert np.all(scan.ranges <= 5.0) and scan.rings.max() < 32
    site = world.data.site_xpos[world.info.lidar_site_id]
    np.testing.assert_allclose(np.linalg.norm(scan.points - site, axis=1), scan.ranges,
                               rtol=1e-5, atol=1e-5)
    cls = np.array(CLASS_NAMES)[scan.class_index]
    # table-top hits lie on the table plane; floor hits at z = 0
    table_top = scan.points[(cls == "table") & (scan.points[:, 2] > 0.3)]
    assert len(table_top) > 500
    np.testing.assert_allclose(table_top[:, 2], world.table_height, atol=1e-4)
    floor = scan.points[cls == "background"]
    np.testing.assert_allclose(floor[:, 2], 0.0, atol=1e-4)
    # object hits lie on the objects' boxes
    for o in world.ground_truth():
        if o.name in ("red_cube", "green_cube", "blue_cylinder"):
            pts = scan.points[cls == o.name]
            assert len(pts) >= 5, o.name
            assert np.all(np.abs(pts - o.position) <= o.size / 2 + 1e-4), o.name
            # and conversely, points near the object's top face exist
            top = o.position + [0, 0, o.size[2] / 2]
            assert np.min(np.linalg.norm(scan.points - top, axis=1)) < 0.03


def test_lidar_sees_moved_object_and_validates(world: SimWorld) -> None:
    world.reset(11)
    lidar = LidarSensor(world, n_vertical=32, n_horizontal=360)
    scan = lidar.scan()
    red = next(o for o in world.ground_truth() if o.name == "red_cube")
    near = ((np.linalg.norm(scan.points[:, :2] - red.position[:2], axis=1) < 0.035)
            & (scan.points[:, 2] > world.table_height + 0.005))  # above the table top
    assert near.sum() >= 5
    assert np.all(np.array(CLASS_NAMES)[scan.class_index[near]] == "red_cube")
    world.reset(0)
    with pytest.raises(ValueError, match="lidar_n_vertical"):
        LidarSensor(world, n_vertical=0)
    with pytest.raises(ValueError, match="lidar_fov"):
        LidarSensor(world, fov=(0.5, -0.5))
    with pytest.raises(ValueError, match="camera_width"):
        CameraSensor(world, width=8)


def test_lidar_sees_the_arm(world: SimWorld) -> None:
    world.reset(0)
    world.set_joint_positions([0.0, 0.8, 0.6, 1.0, 0.0, 0.0])  # gripper over the table
    ee = world.end_effector_position()
    assert ee[2] > world.table_height + 0.2
    scan = LidarSensor(world).scan()
    cls = np.array(CLASS_NAMES)[scan.class_index]
    robot = scan.points[cls == "robot"]
    assert len(robot) > 20
    assert np.min(np.linalg.norm(robot - ee, axis=1)) < 0.08  # hits on the gripper
    # nothing is seen through the gripper palm: no hit lies beyond it on a ray through it
    palm = world.data.geom("gripper_palm").xpos.copy()
    origin = world.data.site_xpos[world.info.lidar_site_id]
    dirs = (scan.points - origin) / scan.ranges[:, None]
    along = (palm - origin) @ dirs.T  # [N] distance along each ray to the palm's foot point
    miss = np.linalg.norm(origin + along[:, None] * dirs - palm, axis=1)
    through = (miss < 0.01) & (scan.ranges > along + 0.02)
    assert (miss < 0.01).sum() >= 1 and not np.any(through)
    world.reset(0)


def test_sensor_costs(world: SimWorld, camera: CameraSensor) -> None:
    lidar = LidarSensor(world)
    camera.render()
    lidar.scan()
    t0 = time.perf_counter()
    for _ in range(3):
        camera.render()
    t_render = (time.perf_counter() - t0) / 3
    t0 = time.perf_counter()
    for _ in range(3):
        lidar.scan()
    t_scan = (time.perf_counter() - t0) / 3
    print(f"\nrender {W}x{H} rgb+depth: {t_render * 1e3:.1f} ms; "
          f"lidar scan {lidar.n_rays} rays: {t_scan * 1e3:.1f} ms")
    assert t_render < 1.0 and t_scan < 0.5
