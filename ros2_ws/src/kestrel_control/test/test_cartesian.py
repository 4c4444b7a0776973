"""Differential-IK reference controller (core/cartesian.py), closed loop against the MuJoCo
arm (the controller sees only measured joint positions; the sim's servos move the arm)."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_control.core.cartesian import CartesianConfig, CartesianController
from kestrel_control.core.kinematics import ArmKinematics
from kestrel_sim.core import SimWorld


@pytest.fixture(scope="module")
def kin() -> ArmKinematics:
    return ArmKinematics.from_default()


@pytest.fixture(scope="module")
def world() -> SimWorld:
    return SimWorld()


def reachable_targets(n: int, seed: int) -> np.ndarray:
    """Random tcp targets (m) the gripper reaches pointing straight down over the table:
    horizontal distance r 0.30-0.60 m from the base, azimuth +-1.2 rad, height z 0.42-0.70 m
    (table top 0.40), with the wrist (0.22 m above the tcp) within 0.62 m of the shoulder
    (z 0.52): sqrt(r^2 + (z - 0.30)^2) <= 0.62 (the arm's reach is 0.65 m)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        r, a, z = rng.uniform(0.30, 0.60), rng.uniform(-1.2, 1.2), rng.uniform(0.42, 0.70)
        if np.hypot(r, z - 0.30) <= 0.62:
            out.append((r * np.cos(a), r * np.sin(a), z))
    return np.array(out)


def run(world: SimWorld, ctl: CartesianController, seconds: float,
        record: list | None = None) -> None:
    """Closed loop: measure q, one controller step, command, step physics to the next tick."""
    sub = round(ctl.dt / world.config.timestep_s)
    out = np.zeros(6)
    for _ in range(round(seconds / ctl.dt)):
        _, q, _, _ = world.joint_state()
        assert ctl.step(q, out)
        world.set_joint_targets(out)
        world.step(sub)
        if record is not None:
            record.append((out.copy(), world.end_effector_position()))


@pytest.mark.slow
@pytest.mark.parametrize(("rate_hz", "n"), [(500.0, 5), (1000.0, 2)])
def test_reaches_random_targets_within_1cm_top_down(kin, world, rate_hz, n) -> None:
    ctl = CartesianController(kin, CartesianConfig(rate_hz=rate_hz))
    for target in reachable_targets(n, seed=int(rate_hz)):
        world.reset(0)
        ctl.clear()
        ctl.set_target(target, max_speed=0.5)
        run(world, ctl, 2.0)
        pos, rot = world.end_effector_pose()
        assert np.linalg.norm(pos - target) < 0.01, (target, pos)
        assert np.arccos(np.clip(-rot[2, 2], -1, 1)) < 0.05  # tool axis straight down
    world.reset(0)


@pytest.mark.slow
def test_respects_max_speed_and_joint_limits(kin, world) -> None:
    ctl = CartesianController(kin, CartesianConfig(rate_hz=500.0))
    world.reset(0)
    ctl.clear()
    target = np.array([0.45, -0.35, 0.45])
    ctl.set_target(target, max_speed=0.2)
    record: list = []
    run(world, ctl, 3.5, record)  # 0.51 m at 0.2 m/s, then settle
    cmds = np.array([c for c, _ in record])
    ee = np.array([p for _, p in record])
    ref = np.array([kin.forward(c)[0] for c in cmds])  # commanded tcp path
    ref_speed = np.linalg.norm(np.diff(ref, axis=0), axis=1) / ctl.dt
    assert ref_speed.max() <= 0.2 * 1.02
    ee_speed = np.linalg.norm(np.diff(ee, axis=0), axis=1) / ctl.dt
    assert ee_speed.max() <= 0.2 * 1.3  # the servos' overshoot on top
    assert ee_speed.max() > 0.15  # it did travel at about the speed asked
    assert np.linalg.norm(ee[-1] - target) < 0.01
    # joint velocity limits (x velocity_scale) on every tick's command
    dq = np.abs(np.diff(cmds, axis=0)) / ctl.dt
    assert np.all(dq <= ctl.vmax * (1 + 1e-9))
    assert np.all(cmds >= ctl.lower - 1e-12) and np.all(cmds <= ctl.upper + 1e-12)
    world.reset(0)


def test_unreachable_target_stays_within_limits(kin, world) -> None:
    ctl = CartesianController(kin, CartesianConfig(rate_hz=500.0))
    world.reset(0)
    ctl.clear()
    ctl.set_target(np.array([1.5, 0.0, 0.2]), max_speed=1.0)  # beyond the arm's reach
    record: list = []
    run(world, ctl, 1.0, record)
    cmds = np.array([c for c, _ in record])
    assert np.all(np.isfinite(cmds))
    assert np.all(cmds >= ctl.lower - 1e-12) and np.all(cmds <= ctl.upper + 1e-12)
    assert np.all(np.abs(np.diff(cmds, axis=0)) / ctl.dt <= ctl.vmax * (1 + 1e-9))
    world.reset(0)


def track(kin: ArmKinematics, q0: np.ndarray, target: np.ndarray, seconds: float) -> float:
    """Kinematics alone (the arm follows every command exactly): m left to the target."""
    ctl = CartesianController(kin, CartesianConfig(rate_hz=500.0))
    ctl.set_target(target, max_speed=0.3)
    q, out = q0.astype(float), np.zeros(6)
    for _ in range(round(seconds * 500.0)):
        assert ctl.step(q, out)
        q[:] = out
    return float(np.linalg.norm(kin.forward(q)[0] - target))


# The arm stretched toward a point beyond its reach: elbow at the controller's lower limit
# (0.2 rad + margin), shoulder far forward, the tool tilted back toward the base.
STRETCHED = np.array([-0.33, 1.14, 0.22, 2.28, 0.0, -0.33])


@pytest.mark.parametrize("x", [0.53, 0.55, 0.565])
def test_a_stretched_arm_reaches_what_it_reaches_from_home(kin, x) -> None:
    """From where an unreachable target left it, the arm still reaches each of these points
    (as it does from home). The orientation task must not take back what the position task
    moves: its null-space projector is not the position task's damped one."""
    target = np.array([x, -0.187, 0.56])
    assert track(kin, np.array([0.0, -0.2, 1.4, 1.2, 0.0, 0.0]), target, 4.0) < 1e-3
    assert track(kin, STRETCHED, target, 4.0) < 1e-3


def test_the_orientation_task_leaves_the_tcp_motion_alone(kin) -> None:
    """One step from configurations around a tool-down pose, toward a target a few cm away:
    the tool-centre velocity (J_p dq) with the top-down task is the position task's alone,
    where no joint froze at a limit and no joint speed was capped."""
    rng = np.random.default_rng(3)
    on = CartesianController(kin, CartesianConfig(rate_hz=500.0, velocity_scale=1.0))
    off = CartesianController(kin, CartesianConfig(rate_hz=500.0, velocity_scale=1.0,
                                                   top_down=False))
    down = np.array([0.0, 0.3, 1.5, np.pi - 1.8, 0.0, 0.0])  # tool straight down
    checked = 0
    for _ in range(300):
        q = down + rng.uniform(-0.4, 0.4, 6)
        target = kin.forward(q)[0] + rng.normal(0.0, 0.05, 3)
        moves = []
        for ctl in (on, off):
            ctl.clear()
            ctl.set_target(target, max_speed=0.05)
            out = np.zeros(6)
            ctl.step(q, out)
            if ctl._mask.min() < 1.0 or ctl._abs.max() > 1.0:  # frozen joint, capped speed
                break
            moves.append(kin.jacobian(q)[:3] @ (out - q))
        if len(moves) < 2:
            continue
        checked += 1
        np.testing.assert_allclose(moves[0], moves[1], atol=0.02 * np.linalg.norm(moves[1]))
    assert checked > 200


def test_no_target_no_command_and_resync(kin) -> None:
    ctl = CartesianController(kin)
    out = np.full(6, 7.0)
    assert not ctl.step(np.zeros(6), out)
    assert np.all(out == 7.0)  # untouched: the caller holds
    q = np.array([0.0, 0.3, 1.5, np.pi - 1.8, 0.0, 0.0])  # tool straight down
    ctl.set_target(kin.forward(q)[0].copy(), 0.1)
    assert ctl.step(q, out)
    np.testing.assert_allclose(out, q, atol=1e-3)  # at the target: stays
    far = q + 0.5
    ctl.step(far, out)  # measurement jumped (e.g. a collision): reference follows it
    assert ctl.resyncs == 1
    np.testing.assert_allclose(out, np.clip(far, ctl.lower, ctl.upper), atol=0.02)


@pytest.mark.parametrize(("field", "value"), [
    ("rate_hz", 0.0), ("position_gain", -1.0), ("damping", float("nan")),
    ("ik_lower", (0.0,) * 3), ("ik_lower", (5.0,) * 6)])
def test_bad_config_names_the_parameter(kin, field, value) -> None:
    with pytest.raises(ValueError, match=f"cartesian.{field}"):
        CartesianController(kin, CartesianConfig(**{field: value}))
