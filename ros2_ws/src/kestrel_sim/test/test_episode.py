"""Episodes (seeded layouts: which objects, distractors, poses), the gripper actuator and the
ground-truth task status (object in the bin and settled) in the sim core (no ROS)."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_sim.core import GRIPPER_JOINT, JOINT_NAMES, SimWorld, SimWorldConfig
from kestrel_sim.core.world import JointCommandError

TASK = ("red_cube", "green_cube", "blue_cylinder")


@pytest.fixture(scope="module")
def world() -> SimWorld:
    return SimWorld(SimWorldConfig(min_objects=1, max_distractors=3))


def on_table(world: SimWorld) -> dict[str, np.ndarray]:
    """name -> bounding-box centre of every free body (task objects and distractors) whose
    centre is over the table."""
    out = {}
    with world.lock:
        for ob in (*world.info.objects, *world.info.distractors):
            if ob.is_free:
                a = ob.free_qpos_adr
                p = world.data.qpos[a:a + 3]
                if 0.2 <= p[0] <= 0.9 and abs(p[1]) <= 0.5:
                    out[ob.name] = p.copy()
    return out


def test_episodes_vary_objects_and_distractors_within_bounds(world: SimWorld) -> None:
    cfg = world.config
    counts, distractors = set(), set()
    for seed in range(1, 25):
        world.reset(seed)
        assert world.seed == seed
        placed = on_table(world)
        task = [n for n in placed if n in TASK]
        dis = [n for n in placed if n.startswith("distractor")]
        assert set(task) == set(world.task_objects) and len(task) >= cfg.min_objects
        assert len(dis) <= cfg.max_distractors
        counts.add(len(task))
        distractors.add(len(dis))
        gt = {o.name for o in world.ground_truth()}
        assert gt == {"table", "bin", *task}  # parked objects and distractors: not listed
        for p in placed.values():  # stated bounds: box, radius from the base
            assert cfg.spawn_x[0] <= p[0] <= cfg.spawn_x[1]
            assert cfg.spawn_y[0] <= p[1] <= cfg.spawn_y[1]
            assert cfg.spawn_radius[0] <= np.hypot(p[0], p[1]) <= cfg.spawn_radius[1]
    assert counts == {1, 2, 3} and distractors == {0, 1, 2, 3}
    world.reset(7)
    first = on_table(world)
    world.reset(8)
    world.reset(7)
    again = on_table(world)
    assert first.keys() == again.keys()
    assert all(np.allclose(first[k], again[k]) for k in first)  # same seed, same episode


def test_default_layout_has_all_objects_and_no_distractors(world: SimWorld) -> None:
    world.reset(0)
    assert world.task_objects == TASK
    assert not any(n.startswith("distractor") for n in on_table(world))


def test_parked_objects_stay_parked(world: SimWorld) -> None:
    world.reset(3)
    parked = [o.name for o in world.info.objects if o.is_free and o.name not in
              world.task_objects]
    world.step(300)
    placed = on_table(world)
    assert not set(parked) & set(placed)
    with world.lock:
        assert np.all(np.isfinite(world.data.qpos))


def test_gripper_target_and_state(world: SimWorld) -> None:
    world.reset(0)
    pos, _ = world.gripper_state()
    np.testing.assert_allclose(pos, 0.0, atol=1e-9)  # open at reset
    travel = world.gripper_travel
    assert world.set_gripper_target(10.0) == pytest.approx(travel)  # clamped
    world.step(300)
    pos, vel = world.gripper_state()
    np.testing.assert_allclose(pos, travel, atol=2e-3)  # closed on nothing: both fingers in
    assert world.set_gripper_target(-1.0) == 0.0
    world.step(300)
    np.testing.assert_allclose(world.gripper_state()[0], 0.0, atol=2e-3)
    with pytest.raises(JointCommandError):
        world.set_gripper_target(float("nan"))
    assert world.gripper_target() == 0.0
    names, q, qd, eff = world.joint_state_all()
    assert names == [*JOINT_NAMES, GRIPPER_JOINT, "finger_right"]
    assert q.shape == qd.shape == eff.shape == (8,)


def _put(world: SimWorld, name: str, xyz) -> None:
    ob = next(o for o in world.info.objects if o.name == name)
    with world.lock:
        a = ob.free_qpos_adr
        world.data.qpos[a:a + 3] = xyz
        world.data.qpos[a + 3:a + 7] = (1, 0, 0, 0)


def test_task_status_in_bin_and_settled(world: SimWorld) -> None:
    world.reset(0)
    assert world.task_status().in_bin == ()
    assert not world.task_status().success()
    bin_pos = next(o for o in world.ground_truth() if o.name == "bin").position
    _put(world, "green_cube", bin_pos + [0.0, 0.0, 0.03])  # dropped 2 cm above the floor
    world.step(30)
    assert "green_cube" not in world.task_status().in_bin  # still falling: not settled
    world.step(600)
    status = world.task_status()
    assert status.in_bin == ("green_cube",)
    assert status.success() and status.success("green_cube")
    assert not status.success("red_cube")
    _put(world, "green_cube", bin_pos + [0.15, 0.0, 0.0])  # beside the bin, on the table
    world.step(300)
    assert world.task_status().in_bin == ()
    world.reset(0)
