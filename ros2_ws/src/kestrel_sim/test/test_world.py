"""SimWorld: loading, reset/randomisation, joint control, ground truth, time (no ROS)."""

from __future__ import annotations

import threading
import time

import mujoco
import numpy as np
import pytest

from kestrel_sim.core import (CLASS_NAMES, JOINT_NAMES, JointCommandError, SimWorld,
                              SimWorldConfig)

DEFAULT_LAYOUT = {  # name -> bounding-box centre, m (worlds/tabletop.xml)
    "red_cube": (0.5, -0.15, 0.425),
    "green_cube": (0.62, 0.02, 0.425),
    "blue_cylinder": (0.45, 0.12, 0.44),
    "bin": (0.42, 0.3, 0.44),
}
FREE = ("red_cube", "green_cube", "blue_cylinder")


@pytest.fixture(scope="module")
def world() -> SimWorld:
    return SimWorld()


def gt_by_name(world: SimWorld) -> dict:
    return {o.name: o for o in world.ground_truth()}


def test_model_parts_and_classes(world: SimWorld) -> None:
    assert world.joint_names == JOINT_NAMES
    assert world.model.opt.timestep == pytest.approx(0.001)
    lo, hi = world.joint_limits
    assert lo.shape == hi.shape == (6,) and np.all(lo < hi) and np.all(hi <= np.pi + 1e-6)
    assert world.table_height == pytest.approx(0.40)
    gt = gt_by_name(world)
    assert set(gt) == {"table", "bin", *FREE}
    for o in gt.values():
        assert o.class_name == o.name  # one instance of each class in the tabletop world
        assert CLASS_NAMES[o.class_index] == o.class_name
    # every robot geom is labelled "robot", the floor "background"
    floor = mujoco.mj_name2id(world.model, mujoco.mjtObj.mjOBJ_GEOM, "floor")
    palm = mujoco.mj_name2id(world.model, mujoco.mjtObj.mjOBJ_GEOM, "gripper_palm")
    assert world.info.geom_class[floor] == 0
    assert CLASS_NAMES[world.info.geom_class[palm]] == "robot"


def test_default_layout_and_sizes(world: SimWorld) -> None:
    world.reset(0)
    gt = gt_by_name(world)
    for name, pos in DEFAULT_LAYOUT.items():
        np.testing.assert_allclose(gt[name].position, pos, atol=1e-6)
        np.testing.assert_allclose(gt[name].quaternion, [1, 0, 0, 0], atol=1e-9)
    np.testing.assert_allclose(gt["red_cube"].size, [0.05, 0.05, 0.05], atol=1e-9)
    np.testing.assert_allclose(gt["blue_cylinder"].size, [0.05, 0.05, 0.08], atol=1e-9)
    np.testing.assert_allclose(gt["bin"].size, [0.2, 0.2, 0.08], atol=1e-9)
    np.testing.assert_allclose(gt["table"].size, [0.7, 1.0, 0.4], atol=1e-9)


def test_random_reset_places_objects_on_table(world: SimWorld) -> None:
    cfg = world.config
    layouts = []
    for seed in (1, 2, 1):
        world.reset(seed)
        gt = gt_by_name(world)
        np.testing.assert_allclose(gt["bin"].position, DEFAULT_LAYOUT["bin"], atol=1e-9)
        xy = []
        for name in FREE:
            o = gt[name]
            assert cfg.spawn_x[0] <= o.position[0] <= cfg.spawn_x[1]
            assert cfg.spawn_y[0] <= o.position[1] <= cfg.spawn_y[1]
            # resting on the table: bottom of the box at the table top
            assert o.position[2] - o.size[2] / 2 == pytest.approx(world.table_height, abs=1e-3)
            assert abs(np.linalg.norm(o.quaternion) - 1.0) < 1e-9
            xy.append(o.position[:2])
        xy = np.array(xy)
        dists = [np.linalg.norm(xy[i] - xy[j]) for i in range(3) for j in range(i + 1, 3)]
        assert min(dists) >= cfg.spawn_min_separation - 1e-9
        # clear of the bin (its half diagonal + the object's)
        assert np.all(np.linalg.norm(xy - np.array(DEFAULT_LAYOUT["bin"][:2]), axis=1) > 0.14)
        layouts.append(xy)
    np.testing.assert_allclose(layouts[0], layouts[2])  # same seed -> same layout
    assert not np.allclose(layouts[0], layouts[1])
    # objects settle and stay on the table (no interpenetration / explosion)
    world.step(300)
    for name in FREE:
        o = gt_by_name(world)[name]
        assert np.linalg.norm(o.position[:2] - layouts[2][FREE.index(name)]) < 0.01
        assert o.position[2] - o.size[2] / 2 == pytest.approx(world.table_height, abs=3e-3)
    world.reset(0)


def test_joint_tracking_and_state(world: SimWorld) -> None:
    world.reset(0)
    names, q0, _, _ = world.joint_state()
    assert names == list(JOINT_NAMES)
    target = q0 + np.array([0.4, 0.3, -0.3, 0.2, 0.3, -0.5])
    ee0 = world.end_effector_position()
    applied = world.set_joint_targets(target)
    np.testing.assert_allclose(applied, target)
    world.step(100)
    _, q_mid, qd_mid, eff_mid = world.joint_state()
    assert np.all(np.abs(qd_mid) > 0.01)  # moving
    assert np.all(np.sign(q_mid - q0) == np.sign(target - q0))
    assert np.all(np.abs(eff_mid) > 1e-3)  # actuators push
    world.step(1400)
    _, q, qd, _ = world.joint_state()
    np.testing.assert_allclose(q, target, atol=0.02)
    assert np.all(np.abs(qd) < 0.05)
    assert np.linalg.norm(world.end_effector_position() - ee0) > 0.05


def test_targets_clamped_and_bad_commands_rejected(world: SimWorld) -> None:
    world.reset(0)
    lo, hi = world.joint_limits
    applied = world.set_joint_targets(np.full(6, 10.0))
    np.testing.assert_allclose(applied, hi)
    np.testing.assert_allclose(world.joint_targets(), hi)
    good = np.zeros(6)
    world.set_joint_targets(good)
    for bad in (np.zeros(5), np.zeros(7), [0, 0, float("nan"), 0, 0, 0],
                [0, 0, 0, float("inf"), 0, 0]):
        with pytest.raises(JointCommandError):
            world.set_joint_targets(bad)
        np.testing.assert_allclose(world.joint_targets(), good)  # previous targets kept
    assert issubclass(JointCommandError, ValueError)
    with pytest.raises(JointCommandError):
        world.set_joint_positions([0.0] * 3)


def test_forward_kinematics_straight_up(world: SimWorld) -> None:
    world.set_joint_positions(np.zeros(6))
    # pedestal 0.42 + shoulder 0.10 + upper arm 0.35 + forearm 0.30 + wrist 0.08 + 0.06 + tcp 0.08
    np.testing.assert_allclose(world.end_effector_position(), [0, 0, 1.39], atol=1e-9)
    world.set_joint_positions([np.pi / 2, np.pi / 2, 0, 0, 0, 0])  # arm horizontal along +y
    np.testing.assert_allclose(world.end_effector_position(), [0, 0.87, 0.52], atol=1e-9)
    world.reset(0)


def test_sim_time_monotonic_across_reset(world: SimWorld) -> None:
    t0 = world.sim_time_ns
    world.step(250)
    assert world.sim_time_ns - t0 == 250 * 1_000_000
    world.reset(3)
    assert world.sim_time_ns == t0 + 250 * 1_000_000  # reset does not rewind the clock
    world.step(0)
    assert world.sim_time_ns == t0 + 250 * 1_000_000
    with pytest.raises(ValueError):
        world.step(-1)
    with pytest.raises(ValueError):
        world.reset(-5)
    world.reset(0)


def test_snapshot_is_a_consistent_private_copy(world: SimWorld) -> None:
    world.reset(0)
    snap = mujoco.MjData(world.model)
    stamp = world.snapshot_into(snap)
    assert stamp == world.sim_time_ns
    np.testing.assert_allclose(snap.qpos, world.data.qpos)
    np.testing.assert_allclose(snap.site_xpos[world.info.ee_site_id],
                               world.end_effector_position())
    world.set_joint_positions(np.zeros(6))
    assert not np.allclose(snap.qpos, world.data.qpos)  # the snapshot did not follow
    world.reset(0)


def test_step_and_reads_from_two_threads(world: SimWorld) -> None:
    world.reset(0)
    t_start = world.sim_time_ns
    stop = threading.Event()

    def physics() -> None:
        while not stop.is_set():
            world.step(5)

    th = threading.Thread(target=physics)
    th.start()
    try:
        snap = mujoco.MjData(world.model)
        stamps = []
        deadline = time.monotonic() + 5.0
        while len(stamps) < 20 and time.monotonic() < deadline:
            stamps.append(world.snapshot_into(snap))
            _, q, _, _ = world.joint_state()
            assert np.all(np.isfinite(q))
            time.sleep(0.001)
    finally:
        stop.set()
        th.join(timeout=5.0)
    assert not th.is_alive()
    assert stamps == sorted(stamps) and stamps[-1] > t_start
    assert all((s - t_start) % 5_000_000 == 0 for s in stamps)  # whole batches only
    world.reset(0)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="timestep_s"):
        SimWorld(SimWorldConfig(timestep_s=0.5))
    with pytest.raises(ValueError, match="world_file.*/nonexistent.xml"):
        SimWorld(SimWorldConfig(world_file="/nonexistent.xml"))
    with pytest.raises(ValueError, match="spawn_x"):
        SimWorld(SimWorldConfig(spawn_x=(0.8, 0.4)))
    w = SimWorld(SimWorldConfig(timestep_s=0.002))
    w.step(10)
    assert w.sim_time_ns == 10 * 2_000_000


def test_physics_step_cost(world: SimWorld) -> None:
    world.reset(0)
    world.step(10)
    t0 = time.perf_counter()
    world.step(1000)
    dt = time.perf_counter() - t0
    print(f"\n1000 physics steps: {dt * 1e3:.1f} ms")
    assert dt < 1.0  # 1 s of sim time must run faster than real time on a loaded 2-core CPU
