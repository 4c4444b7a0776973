"""The ee_* observation terms: the Cartesian target relative to the end effector (Isaac Lab
reach tasks' position error) and the target itself, through policy_io and PolicyRunner."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kestrel_control.core.policy_io import EE_SOURCES, RowIO, build_io
from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
from kestrel_models.control.external import ModelSpec

LAYOUT = ("joint_pos_rel", "joint_vel", "ee_target_rel")


class _FixedKinematics:
    """forward(q) -> (position, rotation): position = q[:3] (easy to check), own arrays."""

    def __init__(self) -> None:
        self.pos, self.rot = np.zeros(3), np.eye(3)
        self.calls = 0

    def forward(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        self.calls += 1
        np.copyto(self.pos, q[:3])
        return self.pos, self.rot


def _row(layout: tuple[str, ...], kin: object) -> tuple[RowIO, np.ndarray, np.ndarray]:
    io = build_io(6, 6, layout)
    inputs = np.zeros((3, 6))
    obs = np.zeros(io.width, dtype=np.float32)
    return RowIO(io, inputs, obs, np.zeros(6, dtype=np.float32), kin), inputs, obs


def test_terms_parse_to_three_columns() -> None:
    io = build_io(6, 6, ("joint_pos", "ee_target_rel*2", "ee_target", "zeros:2"))
    cols = [(t.name, t.col, t.length, t.scale) for t in io.terms]
    assert cols == [("joint_pos", 0, 6, 1.0), ("ee_target_rel", 6, 3, 2.0),
                    ("ee_target", 9, 3, 1.0), ("zeros", 12, 2, 1.0)]
    assert io.width == 14 and io.uses_ee and not io.is_reference
    assert not build_io(6, 6, ("joint_pos", "joint_vel")).uses_ee
    assert {t.source for t in io.terms} & set(EE_SOURCES) == set(EE_SOURCES)
    with pytest.raises(ValueError, match="appears twice"):
        build_io(6, 6, ("ee_target_rel", "ee_target_rel"))


def test_row_without_kinematics_is_refused_naming_the_layout() -> None:
    with pytest.raises(ValueError, match="obs_layout.*forward kinematics"):
        _row(LAYOUT, None)


def test_target_minus_end_effector_and_hold_without_a_target() -> None:
    kin = _FixedKinematics()
    row, inputs, obs = _row(("ee_target_rel*10", "ee_target"), kin)
    inputs[0, :3] = (0.4, -0.1, 0.6)  # the end effector (the fake kinematics: q[:3])
    row.write_obs()  # no target yet: hold where the arm is
    np.testing.assert_allclose(obs[:3], 0.0)
    np.testing.assert_allclose(obs[3:6], (0.4, -0.1, 0.6), rtol=1e-6)
    row.ee_target[:] = (0.5, 0.1, 0.55)
    row.ee_target_set = True
    row.write_obs()
    np.testing.assert_allclose(obs[:3], np.array((0.1, 0.2, -0.05)) * 10, rtol=1e-5)
    np.testing.assert_allclose(obs[3:6], (0.5, 0.1, 0.55), rtol=1e-6)


def _linear_model(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    path = tmp_path / "policy.pt"
    torch.jit.script(torch.nn.Linear(15, 6)).save(str(path))
    return path


def test_runner_feeds_the_cartesian_target_through_the_arm_kinematics(tmp_path: Path) -> None:
    pytest.importorskip("pinocchio")
    from kestrel_control.core.kinematics import ArmKinematics

    kin = ArmKinematics.from_default()
    cfg = RunnerConfig(joint_lower=kin.lower, joint_upper=kin.upper, warmup_steps=2,
                       model=ModelSpec(path=str(_linear_model(tmp_path)), obs_dim=15),
                       obs_layout=LAYOUT, action_mode="position_delta",
                       default_joint_positions=(0.0, -0.2, 1.4, 1.2, 0.0, 0.0))
    runner = PolicyRunner(cfg)
    robot = runner.robots[0]
    q = np.array([0.3, 0.1, 1.2, 1.0, -0.2, 0.4])
    tcp = kin.forward(q)[0].copy()
    robot.joint_states.write(np.stack([q, np.zeros(6)]), 1_000)
    runner.step(1_000)
    np.testing.assert_allclose(runner._obs[12:15], 0.0, atol=1e-6)  # no target: hold
    target = tcp + np.array([0.05, -0.02, 0.1])
    robot.ee_target.write(target)
    runner.step(1_000)
    np.testing.assert_allclose(runner._obs[12:15], target - tcp, atol=1e-6)
    np.testing.assert_allclose(runner._obs[:6], q - np.array(cfg.default_joint_positions),
                               atol=1e-6)
    runner.reset()  # activation forgets the target: hold again
    robot.joint_states.write(np.stack([q, np.zeros(6)]), 2_000)
    runner.step(2_000)
    np.testing.assert_allclose(runner._obs[12:15], 0.0, atol=1e-6)


def test_a_shared_target_buffer_can_be_given(tmp_path: Path) -> None:
    pytest.importorskip("pinocchio")
    from kestrel_control.core.double_buffer import LatestValueBuffer
    from kestrel_control.core.kinematics import ArmKinematics

    kin = ArmKinematics.from_default()
    cfg = RunnerConfig(joint_lower=kin.lower, joint_upper=kin.upper, warmup_steps=0,
                       model=ModelSpec(path=str(_linear_model(tmp_path)), obs_dim=15),
                       obs_layout=LAYOUT)
    bufs = (LatestValueBuffer((2, 6)), LatestValueBuffer((6,)), LatestValueBuffer((3,)))
    runner = PolicyRunner(cfg, buffers=[bufs])
    assert runner.robots[0].ee_target is bufs[2]
    with pytest.raises(ValueError, match="buffers"):
        PolicyRunner(cfg, buffers=[(bufs[0], bufs[1], LatestValueBuffer((4,)))])


def test_the_c_tick_refuses_the_ee_terms() -> None:
    from kestrel_control.core.native_tick import NativeTick, NativeUnavailable

    class _Runner:
        io = build_io(6, 6, LAYOUT)

    with pytest.raises(NativeUnavailable, match="ee_"):
        NativeTick(_Runner(), views=None)


def test_steady_state_steps_with_the_ee_terms_retain_no_memory(tmp_path: Path) -> None:
    """The forward kinematics writes into arrays owned by the kinematics object and the
    terms into the obs row: 2000 steps after warm-up retain nothing (Pinocchio's per-call
    wrappers are freed)."""
    pytest.importorskip("pinocchio")
    import tracemalloc

    from kestrel_control.core.kinematics import ArmKinematics

    torch.set_num_threads(1)
    kin = ArmKinematics.from_default()
    cfg = RunnerConfig(joint_lower=kin.lower, joint_upper=kin.upper, warmup_steps=2,
                       model=ModelSpec(path=str(_linear_model(tmp_path)), obs_dim=15),
                       obs_layout=LAYOUT, action_mode="position_delta",
                       latency_compensation=True)
    runner = PolicyRunner(cfg)
    robot = runner.robots[0]
    robot.ee_target.write(np.array([0.5, 0.0, 0.6]))
    js = np.zeros((2, 6))
    js[0] = (0.1, 0.2, 1.2, 1.0, 0.0, 0.0)
    stamp = 0

    def steps(count: int) -> None:
        nonlocal stamp
        for _ in range(count):
            stamp += 1_000_000
            js[1, 0] += 1e-4
            robot.joint_states.write(js, stamp)
            runner.step(stamp + 1000)

    steps(200)
    tracemalloc.start()
    try:
        steps(200)
        before = tracemalloc.get_traced_memory()[0]
        steps(2000)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert runner.info.valid
    assert after - before < 2048, f"{after - before} bytes retained over 2000 steps"
