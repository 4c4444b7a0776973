"""The control runners across a backwards jump of their clock (a sim restart, a bag played
with --loop: /clock goes back): the joint state, target and policy state of before are
forgotten, the jump is counted, nothing is commanded until a joint state of after the jump,
and then never from the target of before (no ROS)."""

from __future__ import annotations

import numpy as np
import torch

from kestrel_control.core.cartesian import CartesianConfig
from kestrel_control.core.ik_runner import MODE_JOINT, IkRunner
from kestrel_control.core.kinematics import ArmKinematics
from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
from kestrel_control.core.safety import SafetyStatus
from kestrel_control.core.stats import LoopStats
from kestrel_models.control.policy import PolicyConfig

torch.set_num_threads(1)
N = 6
S, MS = 1_000_000_000, 1_000_000
LOWER, UPPER = np.full(N, -3.0), np.full(N, 3.0)
BEFORE, AFTER = 100 * S, 3 * S  # the clock before and after the jump


def _config(**kw) -> RunnerConfig:
    return RunnerConfig(joint_lower=LOWER, joint_upper=UPPER, max_obs_age_s=0.05,
                        warmup_steps=0, policy=PolicyConfig.tiny(), seed=3, **kw)


def _state(pos: float) -> np.ndarray:
    return np.stack([np.full(N, pos), np.zeros(N)])


def test_policy_runner_forgets_the_inputs_of_before_a_jump() -> None:
    stats = LoopStats(1e-3)
    runner = PolicyRunner(_config(), counters=stats)
    robot = runner.robots[0]
    robot.joint_states.write(_state(0.1), BEFORE)
    robot.target.write(np.full(N, 0.8), BEFORE)
    _, info = runner.step(BEFORE + MS)
    assert info.valid and (robot.target_now == 0.8).all()
    cycles_before = stats.stale_inputs

    for k in range(3):  # the jump, and ticks before a joint state of after it
        _, info = runner.step(AFTER + k * MS)
        assert info.status is SafetyStatus.NO_INPUT and not info.valid
    assert stats.time_jumps_back == 1 and stats.stale_inputs == cycles_before  # not "stale"
    assert not robot.safety.has_last_safe and (robot.target_now == 0.0).all()

    robot.joint_states.write(_state(-0.2), AFTER + 3 * MS)  # the restarted sim's state
    _, info = runner.step(AFTER + 4 * MS)
    assert info.valid and info.status is SafetyStatus.OK
    assert (robot.target_now == 0.0).all()  # the target of before is not acted on
    assert (robot.pos == -0.2).all()
    robot.target.write(np.full(N, 0.5), AFTER + 5 * MS)  # a target of after the jump is
    runner.step(AFTER + 6 * MS)
    assert (robot.target_now == 0.5).all()
    assert stats.time_jumps_back == 1


def test_small_steps_back_are_not_jumps() -> None:
    stats = LoopStats(1e-3)
    runner = PolicyRunner(_config(), counters=stats)
    runner.joint_states.write(_state(0.1), BEFORE)
    runner.step(BEFORE + MS)
    _, info = runner.step(BEFORE - 10 * MS)  # 11 ms back: less than max_obs_age (50 ms)
    assert info.valid and stats.time_jumps_back == 0


def test_ik_runner_holds_where_the_arm_is_after_a_jump() -> None:
    """A joint target of before the jump is not commanded once the restarted sim's joint
    states arrive: the runner holds where the arm is, until a new target."""
    stats = LoopStats(1e-3)
    runner = IkRunner(_config(), ArmKinematics.from_default(), CartesianConfig(rate_hz=500.0),
                      counters=stats)
    runner.reset()
    robot = runner.robots[0]
    robot.joint_states.write(_state(0.1), BEFORE)
    robot.mode.write(np.array([0.0, 0.0, 0.0, 0.0, MODE_JOINT]), BEFORE)
    robot.target.write(np.full(N, 0.8), BEFORE)
    cmd, info = runner.step(BEFORE + MS)
    assert info.valid and np.allclose(cmd, 0.8)

    cmd_before = cmd.copy()
    _, info = runner.step(AFTER)
    assert info.status is SafetyStatus.NO_INPUT and not info.valid
    assert stats.time_jumps_back == 1
    robot.joint_states.write(_state(-0.2), AFTER + MS)
    cmd, info = runner.step(AFTER + 2 * MS)
    assert info.valid and np.allclose(cmd, -0.2)  # where the arm is, not the old target
    assert not np.allclose(cmd, cmd_before)
    robot.mode.write(np.array([0.0, 0.0, 0.0, 0.0, MODE_JOINT]), AFTER + 3 * MS)
    robot.target.write(np.full(N, 0.4), AFTER + 3 * MS)
    cmd, info = runner.step(AFTER + 4 * MS)
    assert info.valid and np.allclose(cmd, 0.4)
