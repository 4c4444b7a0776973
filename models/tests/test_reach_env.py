"""Reaching environment (rsl_rl VecEnv over batched MuJoCo arms) and its batched kinematics."""

from __future__ import annotations

import mujoco
import numpy as np
import pytest
import torch

pytest.importorskip("rsl_rl")

from kestrel_models.control.arm_chain import ArmChain  # noqa: E402
from kestrel_models.control.reach_env import ReachConfig, ReachEnv, arm_model  # noqa: E402
from rsl_rl.env import VecEnv  # noqa: E402

# a small 3-joint arm on a base that is neither at the origin nor axis-aligned, with a joint
# anchor off the body origin, a wall behind it to avoid and a free cube (removed by the
# environment)
WORLD = """
<mujoco>
  <compiler angle="radian"/>
  <option timestep="0.001"/>
  <worldbody>
    <geom name="wall" type="box" pos="-0.3 0 0.3" size="0.02 0.4 0.4" contype="1"
          conaffinity="3"/>
    <body name="cube" pos="0.5 0 0.3"><freejoint/><geom type="box" size="0.02 0.02 0.02"/></body>
    <body name="base" pos="0.1 0.05 0.3" quat="0.9962 0 0 0.0872">
      <geom type="cylinder" size="0.05 0.05" contype="2" conaffinity="0"/>
      <body name="l1" pos="0 0 0.1" gravcomp="1">
        <joint name="j1" axis="0 0 1" range="-3 3" damping="0.5" armature="0.05"/>
        <geom type="capsule" fromto="0 0 0 0 0 0.2" size="0.03" contype="2" conaffinity="0"/>
        <body name="l2" pos="0 0 0.2" quat="0.9659 0.2588 0 0" gravcomp="1">
          <joint name="j2" axis="0 1 0" pos="0 0 0.01" range="-2 2" damping="0.5"
                 armature="0.05"/>
          <geom type="capsule" fromto="0 0 0 0.25 0 0" size="0.03" contype="2" conaffinity="0"/>
          <body name="l3" pos="0.25 0 0" gravcomp="1">
            <joint name="j3" axis="0 1 0" range="-2.5 2.5" damping="0.5" armature="0.05"/>
            <geom type="capsule" fromto="0 0 0 0.2 0 0" size="0.025" contype="2"
                  conaffinity="0"/>
            <site name="tip" pos="0.2 0 0.01" quat="0.7071 0 0.7071 0"/>
          </body>
        </body>
      </body>
    </body>
  </worldbody>
  <actuator>
    <position joint="j1" kp="200" dampratio="1" ctrlrange="-3 3"/>
    <position joint="j2" kp="200" dampratio="1" ctrlrange="-2 2"/>
    <position joint="j3" kp="100" dampratio="1" ctrlrange="-2.5 2.5"/>
  </actuator>
</mujoco>
"""
JOINTS = ("j1", "j2", "j3")


def _cfg(**kw) -> ReachConfig:  # noqa: ANN003
    base = dict(num_envs=6, seed=3, joint_names=JOINTS, base_body="base", ee_site="tip",
                action_scales=(0.1, 0.1, 0.1), sample_ranges=((-1, 1), (-1, 1), (-1, 1)),
                velocity_limits=(2.0, 2.0, 2.0),
                target_box=((0.0, 0.6), (-0.4, 0.4), (-0.3, 0.4)), pool_size=64, threads=2)
    base.update(kw)
    return ReachConfig(**base)


def _spec() -> mujoco.MjSpec:
    return mujoco.MjSpec.from_string(WORLD)


def test_chain_matches_mujoco_in_the_base_frame() -> None:
    model = arm_model(_spec())
    data = mujoco.MjData(model)
    chain = ArmChain(model, JOINTS, "base", "tip")
    rng = np.random.default_rng(0)
    q = rng.uniform(-2, 2, (20, 3))
    got = chain.ee_position(q)
    base = model.body("base").id
    for i in range(20):
        data.qpos[:] = q[i]
        mujoco.mj_kinematics(model, data)
        rot = data.xmat[base].reshape(3, 3)
        want = rot.T @ (data.site("tip").xpos - data.xpos[base])
        np.testing.assert_allclose(got[i], want, atol=1e-12)


def test_chain_refuses_a_missing_joint_and_unknown_names() -> None:
    model = arm_model(_spec())
    with pytest.raises(ValueError, match="joint_names"):
        ArmChain(model, ("j1", "j3"), "base", "tip")
    with pytest.raises(ValueError, match="ee_site"):
        ArmChain(model, JOINTS, "base", "nope")


def test_env_is_an_rsl_rl_vecenv_with_the_node_layout() -> None:
    env = ReachEnv(_spec(), _cfg())
    assert isinstance(env, VecEnv)
    assert env.num_actions == 3 and env.decimation == 10 and env.max_episode_length == 200
    assert env.model.nq == 3  # the free cube is gone
    obs = env.get_observations()
    assert set(obs.keys()) == {"policy", "critic"}
    crit = obs["critic"].numpy().astype(np.float64)
    q = env.state[:, env._qadr]
    np.testing.assert_allclose(crit[:, :3], q - env.default_q, atol=1e-6)
    np.testing.assert_allclose(crit[:, 6:9], env.target - env.chain.ee_position(q), atol=1e-6)
    # the policy group is the measured one: noisy, close to the true values
    pol = obs["policy"].numpy()
    assert 0 < np.abs(pol[:, :3] - crit[:, :3]).max() <= env.cfg.q_noise + 1e-6


def test_targets_are_inside_the_box_and_collision_free() -> None:
    env = ReachEnv(_spec(), _cfg())
    box = np.asarray(env.cfg.target_box)
    assert np.all((env.pool.ee >= box[:, 0]) & (env.pool.ee <= box[:, 1]))
    np.testing.assert_allclose(env.chain.ee_position(env.pool.q), env.pool.ee)
    data = mujoco.MjData(env.model)
    for q in env.pool.q[:16]:
        data.qpos[:] = q
        mujoco.mj_forward(env.model, data)
        assert data.ncon == 0


def test_a_joint_servo_toward_a_pool_configuration_reaches_its_target() -> None:
    """The action is q_cmd = q + scale * a; a = (q_goal - q) / scale is a position servo to
    q_goal, whose end effector is the target: the distance must go to ~0."""
    env = ReachEnv(_spec(), _cfg(latency_steps=2))
    goal = env.pool.q[:env.num_envs]
    env.target[:] = env.pool.ee[:env.num_envs]
    d0 = env.distance().copy()
    for _ in range(150):
        q = env.get_observations()["critic"][:, :3].numpy() + env.default_q
        a = np.clip((goal - q) / 0.1, -1, 1)
        env.step(torch.tensor(a, dtype=torch.float32))
    assert np.all(env.distance() < 0.005) and d0.max() > 0.05


def test_episodes_time_out_and_reset_with_new_masses_and_latency() -> None:
    env = ReachEnv(_spec(), _cfg(episode_s=0.05))  # 5 policy steps
    masses = np.array([m.body_mass[env._arm_bodies] for m in env.models])
    assert np.ptp(masses[:, -1]) > 0  # per-arm masses differ
    lat = env.latency.copy()
    targets = env.target.copy()
    for _ in range(5):
        _, rew, done, extras = env.step(torch.zeros(env.num_envs, 3))
        assert rew.shape == (env.num_envs,) and torch.isfinite(rew).all()
    assert done.all() and extras["time_outs"].all()
    assert set(extras["log"]) == {"/reach/final_distance_m", "/reach/within_1cm"}
    assert (env.episode_length_buf == 0).all()
    assert not np.array_equal(targets, env.target)
    assert not (np.array_equal(lat, env.latency) and np.array_equal(
        masses, np.array([m.body_mass[env._arm_bodies] for m in env.models])))
    stats = env.take_episode_stats()
    assert stats["episodes"] == env.num_envs and env.take_episode_stats()["episodes"] == 0


def test_latency_delays_the_new_command() -> None:
    """With latency L the first L physics steps still apply the previous command (zero
    here): an arm at rest stays exactly at rest for those steps."""
    env = ReachEnv(_spec(), _cfg(num_envs=2, mass_range=(1.0, 1.0)))
    env.latency[:] = [0, 9]  # 9 of the 10 physics steps of a policy step
    q0 = env.state[:, env._qadr].copy()
    env.step(torch.ones(2, 3))
    moved = np.abs(env.state[:, env._qadr] - q0).max(axis=1)
    assert moved[0] > 10 * moved[1] > 0


def test_bad_config_names_the_parameter() -> None:
    with pytest.raises(ValueError, match="action_scales"):
        _cfg(action_scales=(0.1,))
    with pytest.raises(ValueError, match="target_box"):
        ReachEnv(_spec(), _cfg(target_box=((5, 6), (5, 6), (5, 6)), pool_size=4))
