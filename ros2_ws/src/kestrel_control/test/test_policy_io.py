"""Observation layout and action mapping (policy_io.py): parameters, the row arithmetic, and an
Isaac Lab style policy file run by the PolicyRunner against an independent reference."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from kestrel_control.core.policy_io import (DEFAULT_LAYOUT, MODE_OFFSET, RowIO, build_io,
                                            check_obs_dim)
from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
from kestrel_control.core.safety import SafetyStatus
from kestrel_control.core.stats import LoopStats
from kestrel_models.control.external import ModelSpec

torch.set_num_threads(1)
N, MS = 4, 1_000_000
DQ = np.array([0.1, -0.4, 0.8, 0.0])  # default joint positions, rad
LOWER, UPPER = np.full(N, -1.5), np.full(N, 1.5)
# an Isaac Lab manipulator's policy terms: joint_pos_rel, joint_vel_rel (scaled), a 3-value
# command this robot does not publish, last_action
ISAAC = ["joint_pos_rel", "joint_vel*0.05", "zeros:3", "last_action"]
ISAAC_DIM = N + N + 3 + N


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"obs_layout": ["joint_pos", "gravity"]}, r"'obs_layout' = 'gravity': unknown term"),
    ({"obs_layout": ["joint_vel*x"]}, r"'obs_layout' = 'joint_vel\*x': scale 'x'"),
    ({"obs_layout": ["joint_vel*0"]}, r"'obs_layout' = 'joint_vel\*0': the scale must"),
    ({"obs_layout": ["zeros:0"]}, r"'obs_layout' = 'zeros:0'"),
    ({"obs_layout": ["zeros:\u00b2"]}, r"'obs_layout' = 'zeros:\u00b2'"),
    ({"obs_layout": ["joint_pos*"]}, r"'obs_layout' = 'joint_pos\*': 'name\*' needs a scale"),
    ({"obs_layout": ["last_action*2"]}, r"last_action takes no scale"),
    ({"obs_layout": ["joint_pos", "joint_pos"]}, r"term 'joint_pos' appears twice"),
    ({"action_mode": "absolute"}, r"'action_mode' = 'absolute': must be one of"),
    ({"action_clip": 0.0}, r"'action_clip' = 0.0: must be > 0"),
    ({"action_clip": math.nan}, r"'action_clip' = nan"),
    ({"default_joint_positions": [0.1, 0.2]}, r"'default_joint_positions' = \[0.1, 0.2\]: "
                                              r"needs 4 finite values"),
    ({"action_scales": [0.5, 0.5, -1.0, 0.5]}, r"'action_scales' = \[0.5, 0.5, -1.0, 0.5\]: "
                                               r"needs 4 finite values > 0"),
])
def test_bad_parameters_name_themselves(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_io(N, N, **kwargs)
    with pytest.raises(ValueError, match=match):  # and the runner's config, at configure
        RunnerConfig(joint_lower=LOWER, joint_upper=UPPER, **kwargs)


def test_default_is_the_reference_layout() -> None:
    io = build_io(N, 8)
    assert [t.name for t in io.terms] == list(DEFAULT_LAYOUT) and io.is_reference
    assert [t.col for t in io.terms] == [0, N, 2 * N, 3 * N] and io.width == 3 * N + 8
    assert io.last_action_col == 3 * N and not io.explicit
    assert not build_io(N, N, action_mode="position_offset").is_reference
    assert not build_io(N, N, action_clip=1.0).is_reference
    assert not build_io(N, N, action_scales=[0.05] * N).is_reference
    assert not build_io(N, N, obs_layout=["joint_pos", "joint_vel*2", "target",
                                          "last_action"]).is_reference


def test_layout_size_against_the_model() -> None:
    io = build_io(N, N, ISAAC)
    check_obs_dim(io, N, ISAAC_DIM, N, "TorchScript policy.pt", user_model=True)
    with pytest.raises(ValueError, match=r"'obs_layout': joint_pos_rel 4 \+ joint_vel 4 \+ "
                                         r"zeros 3 \+ last_action 4 = 15 values, and the "
                                         r"policy .* takes 18"):
        check_obs_dim(io, N, ISAAC_DIM + 3, N, "TorchScript policy.pt", user_model=True)
    with pytest.raises(ValueError, match=r"'obs_dim' = 12: the observation layout needs"):
        check_obs_dim(io, N, 12, N, "TorchScript policy.pt", user_model=True)
    # the reference policy keeps its zero padding past the layout
    check_obs_dim(build_io(N, N), N, 64, N, "kestrel ActorCritic")


def test_row_arithmetic() -> None:
    io = build_io(N, N, ISAAC, "position_offset", 0.5, 1.0, DQ)
    inputs = np.array([[0.3, -0.2, 1.0, 0.5], [2.0, -4.0, 0.0, 1.0], [9.0, 9.0, 9.0, 9.0]])
    obs, act = np.full(ISAAC_DIM, 7.0, np.float32), np.array([0.4, -3.0, 2.0, 0.0], np.float32)
    row = RowIO(io, inputs, obs, act)
    row.write_obs()
    np.testing.assert_array_equal(obs[:N], ((inputs[0] - DQ) * 1.0).astype(np.float32))
    np.testing.assert_array_equal(obs[N:2 * N], (inputs[1] * 0.05).astype(np.float32))
    assert (obs[2 * N:] == 7.0).all()  # zeros and last_action columns: not written here
    out = np.zeros(N)
    row.propose(inputs[0], out)
    clipped = np.clip(act.astype(np.float64), -1.0, 1.0)
    np.testing.assert_array_equal(out, clipped * 0.5 + DQ)
    row.store_prev()
    np.testing.assert_array_equal(obs[2 * N + 3:], clipped.astype(np.float32))
    row.clear_prev()
    assert (obs[2 * N + 3:] == 0.0).all()
    scales = np.array([0.5, 0.25, 1.0, 2.0])
    row = RowIO(build_io(N, N, ISAAC, "position_offset", 9.0, 1.0, DQ, scales), inputs, obs,
                act)
    row.propose(inputs[0], out)
    np.testing.assert_array_equal(out, clipped * scales + DQ)  # per joint; action_scale unused
    for mode, expected in (("position_delta", act * 0.5 + inputs[0]),
                           ("position_delta_tanh", np.tanh(act.astype(np.float64)) * 0.5
                            + inputs[0])):
        row = RowIO(build_io(N, N, action_mode=mode, action_scale=0.5), inputs,
                    np.zeros(3 * N + N, np.float32), act)
        row.propose(inputs[0], out)
        np.testing.assert_allclose(out, expected, rtol=0, atol=1e-15)


class IsaacPolicy(torch.nn.Module):
    """Stands in for an rsl_rl export (policy.pt): a fixed linear map of obs [B, 15] (so the
    reference below can recompute it) to actions [B, 4], no recurrent state."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(5)
        self.w = torch.nn.Parameter(torch.randn(N, ISAAC_DIM, generator=g), requires_grad=False)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return obs @ self.w.t()


def _runner(path: Path, **kwargs) -> PolicyRunner:
    args = {"joint_lower": LOWER, "joint_upper": UPPER, "obs_layout": tuple(ISAAC),
            "action_mode": "position_offset", "action_scale": 0.5, "action_clip": 1.0,
            "default_joint_positions": tuple(DQ), "latency_compensation": False,
            "warmup_steps": 2, "model": ModelSpec(path=str(path), obs_dim=ISAAC_DIM)} | kwargs
    return PolicyRunner(RunnerConfig(**args), counters=LoopStats(1e-3))


def test_an_isaac_lab_policy_file_gets_its_observations_and_action_mapping(
        tmp_path: Path) -> None:
    """Every tick the file sees [q - default_q | 0.05 qd | 0 0 0 | last clipped raw action] and
    its action a becomes clamp(default_q + 0.5 * clip(a, +-1), limits), as Isaac Lab's
    JointPositionAction(use_default_offset=True) with rsl_rl's clip_actions would apply it.
    The reference (tanh) mapping would command q + 0.05 tanh(a): other values, asserted too."""
    net = IsaacPolicy()
    path = tmp_path / "policy.pt"
    torch.jit.script(net).save(str(path))
    runner = _runner(path)
    assert runner._post is None and runner.io.mode == MODE_OFFSET
    rng = np.random.default_rng(2)
    last = np.zeros(N, np.float32)
    clamped_seen = 0
    w = net.w.detach().numpy().astype(np.float64)
    for k in range(1, 60):
        q, qd = rng.uniform(-1.2, 1.2, N), rng.uniform(-3.0, 3.0, N)
        runner.joint_states.write(np.stack([q, qd]), k * MS)
        command, info = runner.step(k * MS + 1000)
        assert info.status is SafetyStatus.OK and info.valid
        obs = np.concatenate([(q - DQ).astype(np.float32), (qd * 0.05).astype(np.float32),
                              np.zeros(3, np.float32), last])
        row = runner.backend.obs_np[0]  # the file saw obs; since then last_action moved on
        np.testing.assert_array_equal(row[:2 * N + 3], obs[:2 * N + 3])
        a = obs.astype(np.float64) @ w.T
        np.testing.assert_allclose(runner.backend.act_np[0], a, rtol=1e-5, atol=1e-5)
        raw = np.clip(runner.backend.act_np[0].astype(np.float64), -1.0, 1.0)
        np.testing.assert_array_equal(row[2 * N + 3:], raw.astype(np.float32))
        np.testing.assert_array_equal(command, np.clip(DQ + 0.5 * raw, LOWER, UPPER))
        clamped_seen += int((np.abs(DQ + 0.5 * raw) > 1.5).any())
        assert not np.allclose(command, np.clip(q + 0.05 * np.tanh(raw), LOWER, UPPER))
        last = raw.astype(np.float32)
    assert (np.abs(last) == 1.0).any()  # the clip was exercised
    assert runner.counters.clamped_actions == clamped_seen


def test_a_layout_that_does_not_cover_the_file_fails_at_configure(tmp_path: Path) -> None:
    path = tmp_path / "policy.pt"
    torch.jit.script(IsaacPolicy()).save(str(path))
    with pytest.raises(ValueError, match=r"parameter 'obs_layout': joint_pos_rel 4 \+ "
                                         r"joint_vel 4 \+ last_action 4 = 12 values, and the "
                                         r"policy \(TorchScript .*\) takes 15"):
        _runner(path, obs_layout=("joint_pos_rel", "joint_vel*0.05", "last_action"))


def test_delta_mode_uses_the_compensated_position(tmp_path: Path) -> None:
    """'position_delta' (Isaac Lab's RelativeJointPositionAction): q + scale * a, with q the
    position predicted forward by the latency compensation, like the reference mapping."""
    net = IsaacPolicy()
    path = tmp_path / "policy.pt"
    torch.jit.script(net).save(str(path))
    runner = _runner(path, action_mode="position_delta", action_clip=math.inf,
                     latency_compensation=True)
    runner.compute_latency_s = 0.0
    q, qd = np.array([0.2, 0.1, -0.3, 0.0]), np.array([1.0, -1.0, 0.5, 0.0])
    runner.joint_states.write(np.stack([q, qd]), MS)
    command, info = runner.step(MS + 4 * MS)  # 4 ms old
    assert info.status is SafetyStatus.OK and info.predicted_s == pytest.approx(4e-3)
    pred = q + qd * 4e-3
    np.testing.assert_allclose(runner.backend.obs_np[0, :N], pred - DQ, atol=1e-6)
    a = runner.backend.act_np[0].astype(np.float64)
    np.testing.assert_allclose(command, np.clip(pred + 0.5 * a, LOWER, UPPER), atol=1e-12)
