"""Reaching task for rsl_rl's PPO: N MuJoCo copies of the arm, stepped in batch on the CPU.

`ReachEnv(world, ReachConfig(...))` implements `rsl_rl.env.VecEnv` (rsl-rl-lib 5.5). `world` is
the MjSpec of the simulated world with the arm in it; its free bodies (the objects) are removed,
the table and the bin stay as obstacles.

Task: move the end effector (site `ee_site`) to a Cartesian target in the base frame; targets are
end-effector positions of sampled collision-free configurations inside `target_box` (reachable
by construction). Each episode starts from another such configuration (or near `default_q`).

Observation (the control node's `obs_layout` "joint_pos_rel, joint_vel, ee_target_rel"):
  [q - default_q (n) rad | dq/dt (n) rad/s | target - ee (3) m, base frame]
  group "policy": measured (uniform noise on q and dq; ee computed from the noisy q, as the
  node computes it from its measurement); group "critic": the same without noise.
Action a [n] (clamped to +-action_clip, rsl_rl's clip_actions): the node's 'position_delta'
  mapping, command q_cmd = q + action_scales * a, sent to the arm's position servos
  (force = kp (q_cmd - q) - kv dq/dt). Through the servo the action is a joint force
  kp * scale * a, whatever the rate at which the command is refreshed: the policy is a
  continuous-time feedback law and the same file runs at 500 Hz and 1 kHz. Here the servos are
  rewritten as that force law (force = kp * ctrl - kv dq/dt, ctrl = scale * a), which is the
  servo refreshed every physics step; the policy itself runs every `control_period_s`.
Randomised per episode: the target and start, link masses (x U(mass_range), inertias alike),
the command latency (0 to `latency_steps` physics steps before a new action acts).
Reward per policy step: -d + w_coarse (1 - tanh(d / 0.1)) + w_fine (1 - tanh(d / fine_std))
  - w_vel |dq/dt|^2 - w_rate |a - a_prev|^2 - w_over |max(|dq/dt| - velocity_limits, 0)|^2,
  d = |target - ee| in m.
Episodes end by time (`episode_s`), reported as time-outs.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import mujoco
import mujoco.rollout
import numpy as np
import torch
from rsl_rl.env import VecEnv
from tensordict import TensorDict

from kestrel_models.control.arm_chain import ArmChain

ARM_JOINTS = ("shoulder_pan", "shoulder_lift", "elbow", "wrist_1", "wrist_2", "wrist_3")
OBS_LAYOUT = ("joint_pos_rel", "joint_vel", "ee_target_rel")  # the node's obs_layout
ACTION_MODE = "position_delta"  # the node's action_mode
_STATE = mujoco.mjtState.mjSTATE_FULLPHYSICS


@dataclass
class ReachConfig:
    """Task, randomisation and reward settings (units in the names or comments)."""

    num_envs: int = 4096
    seed: int = 0
    joint_names: tuple[str, ...] = ARM_JOINTS
    base_body: str = "robot_base"
    ee_site: str = "end_effector"
    default_q: tuple[float, ...] = ()  # [n] rad; () = the model's keyframe "home" (or zeros)
    control_period_s: float = 0.01  # policy period while training (the node: 1 or 2 ms)
    episode_s: float = 2.0
    action_scales: tuple[float, ...] = (0.1, 0.1, 0.1, 0.1, 0.1, 0.1)  # rad per unit action
    action_clip: float = 3.0
    q_noise: float = 0.001  # rad, uniform +-
    dq_noise: float = 0.02  # rad/s, uniform +-
    latency_steps: int = 3  # physics steps, uniform 0..latency_steps per episode
    mass_range: tuple[float, float] = (0.8, 1.2)  # link mass and inertia factor
    # targets: ee positions in the base frame within this box, m ((x0, x1), (y0, y1), (z0, z1))
    target_box: tuple[tuple[float, float], ...] = ((0.25, 0.8), (-0.45, 0.45), (0.45, 0.85))
    # configurations sampled from these joint ranges, rad (targets and starts)
    sample_ranges: tuple[tuple[float, float], ...] = (
        (-1.6, 1.6), (-1.0, 1.4), (0.0, 2.4), (-0.5, 2.4), (-1.0, 1.0), (-1.5, 1.5))
    pool_size: int = 8192  # sampled configurations (targets and starts draw from it)
    home_start_prob: float = 0.2  # start near default_q (+-0.1 rad) instead of the pool
    threads: int = 0  # MuJoCo rollout threads; 0 = the CPU count
    w_coarse: float = 0.5
    w_fine: float = 1.0
    fine_std: float = 0.01  # m
    w_vel: float = 0.002
    w_rate: float = 0.001
    # joint speed limits, rad/s (the URDF's <limit velocity>); speed beyond costs w_over per
    # (rad/s)^2
    velocity_limits: tuple[float, ...] = (2.0, 2.0, 2.5, 3.0, 3.0, 3.0)
    w_over: float = 1.0

    def __post_init__(self) -> None:
        n = len(self.joint_names)
        if self.num_envs < 1:
            raise ValueError(f"parameter 'num_envs' = {self.num_envs}: must be >= 1")
        if len(self.action_scales) != n or min(self.action_scales) <= 0:
            raise ValueError(f"parameter 'action_scales' = {self.action_scales}: {n} values > 0")
        if len(self.sample_ranges) != n:
            raise ValueError(f"parameter 'sample_ranges' = {self.sample_ranges}: {n} ranges")
        if self.default_q and len(self.default_q) != n:
            raise ValueError(f"parameter 'default_q' = {self.default_q}: {n} values or none")
        if len(self.velocity_limits) != n or min(self.velocity_limits) <= 0:
            raise ValueError(f"parameter 'velocity_limits' = {self.velocity_limits}: {n} "
                             "values > 0")
        if not 0 <= self.latency_steps:
            raise ValueError(f"parameter 'latency_steps' = {self.latency_steps}: must be >= 0")


def arm_model(world: mujoco.MjSpec) -> mujoco.MjModel:
    """The world without its free bodies, compiled (the arm, the table and the bin)."""
    spec = world.copy()
    for body in list(spec.worldbody.bodies):
        if any(j.type == mujoco.mjtJoint.mjJNT_FREE for j in body.joints):
            spec.delete(body)
    return spec.compile()


class ConfigurationPool:
    """Collision-free arm configurations whose end effector lies in the target box.

    q [P, n] rad, ee [P, 3] m (base frame); drawn with `rng` from `cfg.sample_ranges`."""

    def __init__(self, model: mujoco.MjModel, chain: ArmChain, cfg: ReachConfig, size: int,
                 rng: np.random.Generator) -> None:
        lo = np.array([r[0] for r in cfg.sample_ranges])
        hi = np.array([r[1] for r in cfg.sample_ranges])
        box = np.asarray(cfg.target_box, dtype=np.float64)
        data = mujoco.MjData(model)
        qadr = model.jnt_qposadr[chain.joint_ids]
        base = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, cfg.base_body)
        robot = {b for b in range(model.nbody) if _below(model, b, base)}
        geom_robot = np.array([model.geom_bodyid[g] in robot for g in range(model.ngeom)])
        qs, ees = [], []
        count = 0
        for _ in range(1000):
            q = rng.uniform(lo, hi, size=(4 * size, lo.shape[0]))
            ee = chain.ee_position(q)
            inside = np.all((ee >= box[:, 0]) & (ee <= box[:, 1]), axis=1)
            for qi, ei in zip(q[inside], ee[inside], strict=True):
                data.qpos[qadr] = qi
                mujoco.mj_kinematics(model, data)
                mujoco.mj_collision(model, data)
                con = data.contact[:data.ncon]
                if np.any(geom_robot[con.geom1] != geom_robot[con.geom2]):
                    continue  # the arm touches the table or the bin
                qs.append(qi)
                ees.append(ei)
                count += 1
                if count == size:
                    break
            if count == size:
                break
        if count < size:
            raise ValueError(f"parameter 'target_box' = {cfg.target_box}: only {count} of "
                             f"{size} collision-free configurations found in it")
        self.q, self.ee = np.array(qs), np.array(ees)


def _below(model: mujoco.MjModel, body: int, root: int) -> bool:
    while body != root and body != 0:
        body = int(model.body_parentid[body])
    return body == root


class ReachEnv(VecEnv):
    """rsl_rl VecEnv over `cfg.num_envs` arms (see the module docstring)."""

    def __init__(self, world: mujoco.MjSpec, cfg: ReachConfig, device: str = "cpu") -> None:
        self.cfg = cfg
        self.device = device
        self.num_envs = n_env = cfg.num_envs
        self.rng = np.random.default_rng(cfg.seed)
        model = arm_model(world)
        self.chain = ArmChain(model, cfg.joint_names, cfg.base_body, cfg.ee_site)
        n = self.num_joints = self.num_actions = self.chain.num_joints
        dt = float(model.opt.timestep)
        self.decimation = max(1, round(cfg.control_period_s / dt))
        self.step_dt = self.decimation * dt
        self.max_episode_length = max(1, round(cfg.episode_s / self.step_dt))
        self.episode_length_buf = torch.zeros(n_env, dtype=torch.long)
        if cfg.default_q:
            self.default_q = np.asarray(cfg.default_q, dtype=np.float64)
        elif model.nkey:
            self.default_q = model.key_qpos[0][model.jnt_qposadr[self.chain.joint_ids]].copy()
        else:
            self.default_q = np.zeros(n)
        self.pool = ConfigurationPool(model, self.chain, cfg, cfg.pool_size, self.rng)
        # the arm's servos become force = kp * ctrl - kv * dq/dt (ctrl = scale * a)
        self.act_ids = []
        for j in self.chain.joint_ids:
            ids = [a for a in range(model.nu) if model.actuator_trnid[a, 0] == j
                   and model.actuator_trntype[a] == mujoco.mjtTrn.mjTRN_JOINT]
            if len(ids) != 1 or model.actuator_biasprm[ids[0], 1] >= 0:
                raise ValueError(f"parameter 'joint_names': joint "
                                 f"{mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_JOINT, j)!r} "
                                 "needs one position actuator")
            self.act_ids.append(ids[0])
        self.kp = model.actuator_gainprm[self.act_ids, 0].copy()
        model.actuator_biasprm[self.act_ids, 1] = 0.0
        model.actuator_ctrllimited[self.act_ids] = 0
        self.model = model
        # one model per arm (its own masses); bodies of the arm (below the base) are randomised
        base = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_BODY, cfg.base_body)
        self._arm_bodies = np.array([b for b in range(1, model.nbody) if _below(model, b, base)])
        self._mass0 = model.body_mass[self._arm_bodies].copy()
        self._inertia0 = model.body_inertia[self._arm_bodies].copy()
        self.models = [copy.copy(model) for _ in range(n_env)]
        threads = cfg.threads or os.cpu_count() or 1
        self._datas = [mujoco.MjData(model) for _ in range(threads)]
        data = self._datas[0]
        if model.nkey:
            mujoco.mj_resetDataKeyframe(model, data, 0)
        else:
            mujoco.mj_resetData(model, data)
        self._ctrl0 = data.ctrl.copy()
        self._ctrl0[self.act_ids] = 0.0
        nstate = mujoco.mj_stateSize(model, _STATE)
        self._state0 = np.zeros(nstate)
        mujoco.mj_getState(model, data, self._state0, _STATE)
        self._qadr = 1 + model.jnt_qposadr[self.chain.joint_ids]  # state: time, qpos, qvel
        self._vadr = 1 + model.nq + model.jnt_dofadr[self.chain.joint_ids]
        self.state = np.tile(self._state0, (n_env, 1))
        self._rollout_state = np.zeros((n_env, self.decimation, nstate))
        self._control = np.tile(self._ctrl0, (n_env, self.decimation, 1))
        self.scales = np.asarray(cfg.action_scales, dtype=np.float64)
        self.target = np.zeros((n_env, 3))
        self.latency = np.zeros(n_env, dtype=np.int64)
        self.prev_action = np.zeros((n_env, n))
        self.prev_ctrl = np.zeros((n_env, n))
        self._steps = np.arange(self.decimation)
        self._stats = np.zeros(5)  # episodes, within 1 cm, final distance sum, reward sum, steps
        self.vlim = np.asarray(cfg.velocity_limits, dtype=np.float64)
        self._reset(np.arange(n_env))
        self._obs = self._observe(self.target - self.chain.ee_position(self.state[:, self._qadr]))

    # ---- VecEnv --------------------------------------------------------------------------
    def get_observations(self) -> TensorDict:
        return self._obs

    def step(self, actions: torch.Tensor) -> tuple[TensorDict, torch.Tensor, torch.Tensor, dict]:
        clip = self.cfg.action_clip
        a = np.clip(actions.detach().cpu().numpy().astype(np.float64), -clip, clip)
        ctrl = a * self.scales
        # a new command acts after `latency` physics steps; the previous one until then
        late = self._steps[None, :] < self.latency[:, None]  # [N, decimation]
        arm = self._control[:, :, self.act_ids]
        arm[:] = np.where(late[:, :, None], self.prev_ctrl[:, None, :], ctrl[:, None, :])
        self._control[:, :, self.act_ids] = arm
        mujoco.rollout.rollout(self.models, self._datas, self.state, self._control,
                               control_spec=mujoco.mjtState.mjSTATE_CTRL, skip_checks=True,
                               nstep=self.decimation, state=self._rollout_state,
                               persistent_pool=True)
        self.state[:] = self._rollout_state[:, -1]
        q, dq = self.state[:, self._qadr], self.state[:, self._vadr]
        rel = self.target - self.chain.ee_position(q)
        d = np.linalg.norm(rel, axis=1)
        cfg = self.cfg
        over = np.maximum(np.abs(dq) - self.vlim, 0.0)
        reward = (-d + cfg.w_coarse * (1.0 - np.tanh(d / 0.1))
                  + cfg.w_fine * (1.0 - np.tanh(d / cfg.fine_std))
                  - cfg.w_vel * np.sum(dq * dq, axis=1)
                  - cfg.w_rate * np.sum((a - self.prev_action) ** 2, axis=1)
                  - cfg.w_over * np.sum(over * over, axis=1))
        self.prev_action[:] = a
        self.prev_ctrl[:] = ctrl
        self.episode_length_buf += 1
        done = (self.episode_length_buf >= self.max_episode_length).numpy()
        extras: dict = {"time_outs": torch.from_numpy(done.copy())}
        ids = np.flatnonzero(done)
        self._stats += (ids.size, np.count_nonzero(d[ids] < 0.01), d[ids].sum(), reward.sum(),
                        reward.size)
        if ids.size:
            extras["log"] = {"/reach/final_distance_m": float(d[ids].mean()),
                             "/reach/within_1cm": float((d[ids] < 0.01).mean())}
            self._reset(ids)
            rel[ids] = self.target[ids] - self.chain.ee_position(self.state[ids][:, self._qadr])
        self._obs = self._observe(rel)
        return (self._obs, torch.from_numpy(reward.astype(np.float32)),
                torch.from_numpy(done.copy()), extras)

    # ---- internals ------------------------------------------------------------------------
    def _reset(self, ids: np.ndarray) -> None:
        cfg, rng, k = self.cfg, self.rng, ids.size
        pool = self.pool
        self.target[ids] = pool.ee[rng.integers(0, len(pool.ee), k)]
        q0 = pool.q[rng.integers(0, len(pool.q), k)]
        home = rng.random(k) < cfg.home_start_prob
        q0[home] = self.default_q + rng.uniform(-0.1, 0.1, (int(home.sum()), self.num_joints))
        self.state[ids] = self._state0
        self.state[ids[:, None], self._qadr[None, :]] = q0
        self.latency[ids] = rng.integers(0, cfg.latency_steps + 1, k)
        self.prev_action[ids] = 0.0
        self.prev_ctrl[ids] = 0.0
        self.episode_length_buf[torch.from_numpy(ids)] = 0
        lo, hi = cfg.mass_range
        for i in ids:
            f = rng.uniform(lo, hi, self._arm_bodies.size)
            m = self.models[i]
            m.body_mass[self._arm_bodies] = self._mass0 * f
            m.body_inertia[self._arm_bodies] = self._inertia0 * f[:, None]

    def _observe(self, rel: np.ndarray) -> TensorDict:
        """Both observation groups; rel [N, 3]: target - ee of the true positions."""
        cfg, rng = self.cfg, self.rng
        q, dq = self.state[:, self._qadr], self.state[:, self._vadr]
        qn = q + rng.uniform(-cfg.q_noise, cfg.q_noise, q.shape)
        dqn = dq + rng.uniform(-cfg.dq_noise, cfg.dq_noise, dq.shape)
        reln = self.target - self.chain.ee_position(qn)
        policy = np.concatenate([qn - self.default_q, dqn, reln], axis=1)
        critic = np.concatenate([q - self.default_q, dq, rel], axis=1)
        return TensorDict({"policy": torch.from_numpy(policy.astype(np.float32)),
                           "critic": torch.from_numpy(critic.astype(np.float32))},
                          batch_size=[self.num_envs])

    def take_episode_stats(self) -> dict:
        """Episodes ended since the last call: count, fraction ending within 1 cm of the
        target, mean final distance m; mean reward per step. Resets the counters."""
        n, ok, dist, rew, steps = self._stats
        self._stats[:] = 0.0
        return {"episodes": int(n), "within_1cm": ok / n if n else float("nan"),
                "final_distance_m": dist / n if n else float("nan"),
                "mean_reward": rew / steps if steps else float("nan")}

    def distance(self) -> np.ndarray:
        """Current end-effector distance to the target per arm, m [N]."""
        q = self.state[:, self._qadr]
        return np.linalg.norm(self.target - self.chain.ee_position(q), axis=1)


def train_config(num_steps_per_env: int = 24, actor_hidden: Sequence[int] = (128, 128, 64),
                 critic_hidden: Sequence[int] = (256, 256, 128), seed: int = 0) -> dict:
    """rsl_rl 5.5 OnPolicyRunner configuration for this task (PPO, MLP actor and critic with
    their observation normalisers, which the exporters keep in the exported policy)."""
    return {
        "seed": seed,
        "num_steps_per_env": num_steps_per_env,
        "save_interval": 10 ** 9,
        "obs_groups": {"actor": ["policy"], "critic": ["critic"]},
        "algorithm": {"class_name": "PPO", "num_learning_epochs": 5, "num_mini_batches": 4,
                      "clip_param": 0.2, "gamma": 0.99, "lam": 0.95, "value_loss_coef": 1.0,
                      "entropy_coef": 0.005, "learning_rate": 1e-3, "max_grad_norm": 1.0,
                      "schedule": "adaptive", "desired_kl": 0.01},
        "actor": {"class_name": "MLPModel", "hidden_dims": list(actor_hidden),
                  "activation": "elu", "obs_normalization": True,
                  "distribution_cfg": {"class_name": "GaussianDistribution", "init_std": 1.0}},
        "critic": {"class_name": "MLPModel", "hidden_dims": list(critic_hidden),
                   "activation": "elu", "obs_normalization": True},
    }


def period_steps(period_s: float, timestep_s: float) -> int:
    """Physics steps per control period (the period must be a whole number of steps)."""
    k = round(period_s / timestep_s)
    if k < 1 or not math.isclose(k * timestep_s, period_s, rel_tol=1e-9, abs_tol=1e-12):
        raise ValueError(f"parameter 'control_period_s' = {period_s}: not a whole number of "
                         f"physics steps of {timestep_s} s")
    return k
