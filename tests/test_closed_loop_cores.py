"""The pick-and-place loop closes in the cores (no ROS): the planner's executor turns a plan
into Cartesian and gripper targets, the reference controller (IkRunner) turns them into joint
commands at 500 Hz, the MuJoCo world moves the arm and the object; success is the simulator's
ground truth (object in the bin and settled)."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_control.core.cartesian import CartesianConfig
from kestrel_control.core.ik_runner import MODE_CARTESIAN, MODE_HOLD, IkRunner
from kestrel_control.core.kinematics import ArmKinematics
from kestrel_control.core.policy_runner import RunnerConfig
from kestrel_planner.core.executor import ExecutorConfig, PlanExecutor, TargetMode
from kestrel_planner.core.plan import SceneObject, parse_plan
from kestrel_sim.core import SimWorld

CONTROL_HZ, PLANNER_HZ = 500.0, 20.0


def run_plan(world: SimWorld, plan_text: str, seconds: float) -> PlanExecutor:
    lo, hi = world.joint_limits
    runner = IkRunner(RunnerConfig(joint_lower=lo, joint_upper=hi, max_obs_age_s=0.05),
                      ArmKinematics.from_default(), CartesianConfig(rate_hz=CONTROL_HZ))
    runner.reset()
    ex = PlanExecutor(ExecutorConfig(position_tolerance=0.01, step_timeout=10.0,
                                     gripper_time=0.5, transit_clearance=0.15))
    scene = [SceneObject(o.name, o.class_name, tuple(float(v) for v in o.position))
             for o in world.ground_truth()]
    ex.start(parse_plan(plan_text), scene, 0.0)
    robot = runner.robots[0]
    sub = round(1.0 / CONTROL_HZ / world.config.timestep_s)
    every = round(CONTROL_HZ / PLANNER_HZ)
    now_ns, dt_ns = 10**9, int(1e9 / CONTROL_HZ)
    for k in range(int(seconds * CONTROL_HZ)):
        if k % every == 0:
            out = ex.tick(k / CONTROL_HZ, world.end_effector_position())
            tg = out.target
            if tg is None:
                break
            world.set_gripper_target(tg.gripper * world.gripper_travel)
            if tg.mode == TargetMode.CARTESIAN:
                robot.mode.write(np.array([*tg.position, tg.max_speed, MODE_CARTESIAN]), now_ns)
            else:
                robot.mode.write(np.array([0.0, 0.0, 0.0, 0.0, MODE_HOLD]), now_ns)
        _, q, qd, _ = world.joint_state()
        robot.joint_states.write(np.stack([q, qd]), now_ns)
        cmd, info = runner.step(now_ns)
        if info.valid:
            world.set_joint_targets(cmd)
        world.step(sub)
        now_ns += dt_ns
    world.step(500)  # let it settle
    return ex


@pytest.mark.parametrize("name", ["red_cube", "blue_cylinder"])
def test_pick_and_place_plan_succeeds(name: str) -> None:
    world = SimWorld()
    world.reset(0)
    ex = run_plan(world, f"pick {name} speed=0.3\nplace bin speed=0.3\nend", 15.0)
    assert not ex.running and all(s.name == "SUCCEEDED" for s in ex.statuses), ex.statuses
    status = world.task_status()
    assert status.success(name), status
