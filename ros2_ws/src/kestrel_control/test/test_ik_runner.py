"""IkRunner: the reference controller behind the policy runner's interface, closed loop on
the MuJoCo arm through the same buffers and safety filter the node uses (no ROS)."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_control.core.cartesian import CartesianConfig
from kestrel_control.core.ik_runner import MODE_CARTESIAN, MODE_HOLD, MODE_JOINT, IkRunner
from kestrel_control.core.kinematics import ArmKinematics
from kestrel_control.core.policy_runner import RunnerConfig
from kestrel_control.core.safety import SafetyStatus
from kestrel_sim.core import SimWorld

RATE = 500.0
DT_NS = int(1e9 / RATE)


@pytest.fixture(scope="module")
def world() -> SimWorld:
    return SimWorld()


def make_runner(world: SimWorld) -> IkRunner:
    lo, hi = world.joint_limits
    cfg = RunnerConfig(joint_lower=lo, joint_upper=hi, max_obs_age_s=0.05)
    return IkRunner(cfg, ArmKinematics.from_default(), CartesianConfig(rate_hz=RATE))


def tick(world: SimWorld, runner: IkRunner, now_ns: int, publish_state: bool = True):
    robot = runner.robots[0]
    if publish_state:
        _, q, qd, _ = world.joint_state()
        robot.joint_states.write(np.stack([q, qd]), now_ns)
    cmd, info = runner.step(now_ns)
    if info.valid:
        world.set_joint_targets(cmd)
    world.step(round(1.0 / RATE / world.config.timestep_s))
    return cmd.copy(), info


@pytest.mark.slow
def test_cartesian_target_reached_through_the_runner(world: SimWorld) -> None:
    world.reset(0)
    runner = make_runner(world)
    runner.reset()
    now = 10**9
    _, info = tick(world, runner, now, publish_state=False)
    assert not info.valid and info.status is SafetyStatus.NO_INPUT
    target = np.array([0.45, 0.10, 0.50])
    runner.robots[0].mode.write(np.array([*target, 0.4, MODE_CARTESIAN]), now)
    for _ in range(int(2.0 * RATE)):
        now += DT_NS
        tick(world, runner, now)
    assert np.linalg.norm(world.end_effector_position() - target) < 0.01
    assert runner.compute_latency_s > 0.0
    # hold: the last command stays
    held = runner.commands[0].copy()
    runner.robots[0].mode.write(np.array([0, 0, 0, 0, MODE_HOLD]), now)
    for _ in range(20):
        now += DT_NS
        cmd, info = tick(world, runner, now)
        assert info.valid
        np.testing.assert_allclose(cmd, held)
    # joint mode: the joint target buffer is the command (clamped by the safety filter)
    lo, hi = world.joint_limits
    goal = np.array([0.2, -0.1, 1.2, 1.0, 0.1, 3.5])  # wrist_3 beyond its limit
    runner.robots[0].target.write(goal, now)
    runner.robots[0].mode.write(np.array([0, 0, 0, 0, MODE_JOINT]), now)
    now += DT_NS
    cmd, info = tick(world, runner, now)
    np.testing.assert_allclose(cmd, np.clip(goal, lo, hi))
    assert runner.counters.clamped_actions >= 1
    world.reset(0)


def test_stale_and_nonfinite_inputs_hold(world: SimWorld) -> None:
    world.reset(0)
    runner = make_runner(world)
    runner.reset()
    now = 10**9
    runner.robots[0].mode.write(np.array([0.45, 0.0, 0.5, 0.3, MODE_CARTESIAN]), now)
    for _ in range(10):
        now += DT_NS
        tick(world, runner, now)
    last = runner.commands[0].copy()
    now += int(0.2e9)  # joint states 0.2 s old: stale
    cmd, info = tick(world, runner, now, publish_state=False)
    assert info.status is SafetyStatus.STALE and info.valid
    np.testing.assert_allclose(cmd, last)
    assert runner.counters.stale_inputs == 1
    # a NaN Cartesian target: refused and held, counted; the next good target works
    before = runner.counters.rejected_nonfinite
    runner.robots[0].mode.write(np.array([np.nan, 0.0, 0.5, 0.3, MODE_CARTESIAN]), now)
    now += DT_NS
    cmd, info = tick(world, runner, now)
    assert info.valid and np.all(np.isfinite(cmd))
    assert runner.counters.rejected_nonfinite == before + 1
    target = np.array([0.40, -0.1, 0.55])
    runner.robots[0].mode.write(np.array([*target, 0.5, MODE_CARTESIAN]), now)
    for _ in range(int(1.5 * RATE)):
        now += DT_NS
        tick(world, runner, now)
    assert np.linalg.norm(world.end_effector_position() - target) < 0.01
    world.reset(0)
