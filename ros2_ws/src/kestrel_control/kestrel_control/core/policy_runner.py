"""Runs the recurrent policy once per control tick on preallocated buffers.

Per tick (`step(now_ns)`), with no allocation in steady state on the Python side:
  joint states [2, n] (positions rad; velocities rad/s) and target [n] (rad, zeros when none)
  are read from LatestValueBuffers (written by the node's subscription callbacks);
  obs [obs_dim] float32 = [positions n | velocities n | target n | previous action A | zeros];
  SafetyFilter: stale or non-finite observation -> hold (no inference);
  actions [A] = policy.step(obs, h, c) (LSTM state h, c [1, 1, H] kept on the device);
  command [n] rad = positions + action_scale * tanh(actions[:n]) -> SafetyFilter (NaN -> hold,
  clamp to the joint limits).
Torch itself allocates its intermediate tensors in its C++ allocators (CPU: malloc-backed, freed
every step; CUDA: the caching allocator, whose blocks are reused): invisible to tracemalloc and
constant in steady state. Only per-step Python objects (tensor wrappers, floats) come and go.
Backends now: 'cpu_eager' and 'cuda_eager' (later: CUDA graphs, ONNX Runtime, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kestrel_control.core.double_buffer import LatestValueBuffer
from kestrel_control.core.safety import SafetyCounters, SafetyFilter, SafetyStatus, validate_limits
from kestrel_models.control.policy import ActorCritic, PolicyConfig, build_policy

BACKENDS = ("cpu_eager", "cuda_eager")


@dataclass
class RunnerConfig:
    """Validated in `__post_init__`; errors name the parameter and value."""

    joint_lower: Any  # [n] rad
    joint_upper: Any  # [n] rad
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    action_scale: float = 0.05  # rad of command offset per unit of tanh(action)
    max_obs_age_s: float = 0.02  # s, older observations -> hold
    backend: str = "cpu_eager"  # one of BACKENDS
    weights_path: str = ""  # torch state_dict file; "" = seeded random weights
    seed: int = 0  # random-weight seed
    warmup_steps: int = 20  # inference calls at construction

    def __post_init__(self) -> None:
        lower, upper = validate_limits(self.joint_lower, self.joint_upper)
        self.joint_lower, self.joint_upper = lower, upper
        n, cfg = lower.shape[0], self.policy
        if n > cfg.num_actions:
            raise ValueError(
                f"parameter 'num_actions' = {cfg.num_actions}: the policy needs one action per "
                f"joint and the robot has {n} joints (joint_lower/joint_upper/joint_names)"
            )
        needed = 3 * n + cfg.num_actions
        if needed > cfg.obs_dim:
            raise ValueError(
                f"parameter 'obs_dim' = {cfg.obs_dim}: the observation needs 3 * {n} joints + "
                f"{cfg.num_actions} actions = {needed} values"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"parameter 'backend' = {self.backend!r}: must be one of {BACKENDS}")
        if self.backend == "cuda_eager" and not torch.cuda.is_available():
            raise ValueError("parameter 'backend' = 'cuda_eager': CUDA is not available")
        if not (isinstance(self.action_scale, (int, float)) and math.isfinite(self.action_scale)
                and self.action_scale > 0):
            raise ValueError(f"parameter 'action_scale' = {self.action_scale!r}: must be > 0")
        if not (isinstance(self.max_obs_age_s, (int, float)) and self.max_obs_age_s > 0):
            raise ValueError(f"parameter 'max_obs_age' = {self.max_obs_age_s!r}: must be > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"parameter 'warmup_steps' = {self.warmup_steps!r}: must be >= 0")

    @property
    def num_joints(self) -> int:
        return int(self.joint_lower.shape[0])


@dataclass
class StepInfo:
    """Outcome of one `step` (one preallocated instance, updated in place)."""

    status: SafetyStatus = SafetyStatus.NO_INPUT
    valid: bool = False  # a command is available to send
    obs_age_s: float = float("nan")  # now - observation stamp, s
    obs_version: int = 0  # version of the joint-state value used (0 = none yet)
    obs_stamp_ns: int = 0  # its stamp, ns (node clock)


def load_weights(path: str) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - reported as a configuration error
        raise ValueError(f"parameter 'weights_path' = {path!r}: cannot load: {exc}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"parameter 'weights_path' = {path!r}: not a state_dict")
    return state


class PolicyRunner:
    """Policy + safety filter + input buffers for the real-time loop (see module docstring)."""

    def __init__(self, config: RunnerConfig, counters: Any = None) -> None:
        self.config = config
        cfg, n = config.policy, config.num_joints
        self.num_joints, self.num_actions = n, cfg.num_actions
        self.device = torch.device("cuda" if config.backend == "cuda_eager" else "cpu")
        if self.device.type == "cpu":
            torch.set_num_threads(1)  # process-wide: one intra-op thread, no pool wake-ups
        state = load_weights(config.weights_path) if config.weights_path else None
        try:
            model = build_policy(cfg, seed=config.seed, state_dict=state)
        except RuntimeError as exc:
            raise ValueError(
                f"parameter 'weights_path' = {config.weights_path!r}: does not match the "
                f"policy dims: {exc}") from exc
        self.model: ActorCritic = model.to(self.device)
        self.counters = counters if counters is not None else SafetyCounters()
        self.safety = SafetyFilter(config.joint_lower, config.joint_upper, config.max_obs_age_s,
                                   self.counters)
        # Inputs, written by subscription callbacks (stamps: node clock, ns).
        self.joint_states = LatestValueBuffer((2, n))  # [positions rad; velocities rad/s]
        self.target = LatestValueBuffer((n,))  # joint position target, rad
        # Preallocated per-tick arrays.
        self._js = np.zeros((2, n))
        self._pos, self._vel = self._js[0], self._js[1]  # views, [n]
        self._target = np.zeros(n)
        self._proposed = np.zeros(n)  # rad
        self._command = np.zeros(n)  # rad, returned by step()
        self.info = StepInfo()
        pin = self.device.type == "cuda"
        with torch.inference_mode():
            self._obs_cpu = torch.zeros(1, cfg.obs_dim, pin_memory=pin)  # [1, obs_dim]
            self._act_cpu = torch.zeros(1, cfg.num_actions, pin_memory=pin)  # [1, A]
            self._obs_dev = self._obs_cpu if not pin else self._obs_cpu.to(self.device)
            self._h, self._c = self.model.initial_state(1, self.device)  # [1, 1, H] each
        self._obs = self._obs_cpu.numpy()[0]  # float32 view [obs_dim]
        self._act = self._act_cpu.numpy()[0]  # float32 view [A]
        self._act_n = self._act[:n]
        self._o_vel, self._o_tgt, self._o_act = n, 2 * n, 3 * n
        self.warmup(config.warmup_steps)

    # ---- lifecycle -------------------------------------------------------------------------
    def warmup(self, steps: int) -> None:
        """Run inference `steps` times on zeros, then reset the recurrent state."""
        for _ in range(steps):
            self._infer()
        self.reset()

    def reset(self) -> None:
        """Zero LSTM state and previous action; forget the last safe command (on activation)."""
        with torch.inference_mode():
            self._h.zero_()
            self._c.zero_()
        self._obs[:] = 0.0
        self._act[:] = 0.0
        self.safety.reset()

    # ---- per tick --------------------------------------------------------------------------
    def _infer(self) -> None:
        """obs (self._obs) -> actions (self._act); updates h, c."""
        with torch.inference_mode():
            if self._obs_dev is not self._obs_cpu:
                self._obs_dev.copy_(self._obs_cpu, non_blocking=True)
            actions, _value, h, c = self.model.step(self._obs_dev, self._h, self._c)
            self._h.copy_(h)
            self._c.copy_(c)
            self._act_cpu.copy_(actions)  # device -> pinned host: synchronises

    def step(self, now_ns: int) -> tuple[np.ndarray, StepInfo]:
        """One tick at node-clock time `now_ns`. Returns (command [n] rad, info).

        The command array is the runner's own buffer (overwritten next tick); send it only when
        `info.valid`. Never raises for bad input: stale/NaN are held and counted.
        """
        info = self.info
        version, stamp = self.joint_states.read_into(self._js)
        info.obs_version, info.obs_stamp_ns = version, stamp
        if version == 0:
            info.status, info.valid, info.obs_age_s = SafetyStatus.NO_INPUT, False, math.nan
            return self._command, info
        self.target.read_into(self._target)
        age = (now_ns - stamp) * 1e-9
        info.obs_age_s = age
        obs, n = self._obs, self.num_joints
        obs[:n] = self._pos
        obs[self._o_vel:self._o_tgt] = self._vel
        obs[self._o_tgt:self._o_act] = self._target
        # obs[3n : 3n + A] already holds the previous action (written below / by reset).
        status = self.safety.check_observation(obs, age)
        if status is not SafetyStatus.OK:
            info.status = status
            info.valid = self.safety.hold(self._command, self._pos)
            return self._command, info
        self._infer()
        np.tanh(self._act_n, out=self._proposed)
        self._proposed *= self.config.action_scale
        self._proposed += self._pos
        status = self.safety.filter_command(self._command, self._proposed, self._pos)
        if status is SafetyStatus.OK:
            obs[self._o_act:self._o_act + self.num_actions] = self._act
            info.valid = True
        else:  # non-finite policy output: drop the recurrent state, it may be poisoned
            self.reset_recurrent()
            info.valid = self.safety.hold(self._command, self._pos)
        info.status = status
        return self._command, info

    def reset_recurrent(self) -> None:
        """Zero the LSTM state and the previous action, keep the last safe command."""
        with torch.inference_mode():
            self._h.zero_()
            self._c.zero_()
        self._obs[self._o_act:self._o_act + self.num_actions] = 0.0
