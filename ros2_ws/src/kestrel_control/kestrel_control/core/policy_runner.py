"""Runs the recurrent policy once per control tick for R robots in one padded batch.

Per tick (`step_all(now_ns)`), with no allocation in steady state on the Python side, for each
robot r (its own input buffers, safety filter and command row):
  joint states [2, n] (positions rad; velocities rad/s) and target [n] (rad, zeros when none)
  are read from LatestValueBuffers (written by the node's subscription callbacks);
  latency compensation (optional): positions are predicted forward to the time the command
  takes effect, q + v * (observation age + measured compute latency), the horizon in
  [0, max_obs_age] (linear constant-velocity prediction);
  obs row r [obs_dim] float32 = [positions n | velocities n | target n | previous action A | 0]
  (the default `obs_layout`; policy_io.py: Isaac Lab terms such as q - default_q, scales,
  the Cartesian target relative to the end effector from each robot's `ee_target` buffer [3] m);
  SafetyFilter: stale or non-finite observation -> hold (counted);
then ONE backend step for the batch [B, obs_dim] -> [B, A] (B = R padded to a power of two so
one captured graph / engine serves; padded rows are zeros); then per robot
  command [n] rad = positions + action_scale * tanh(actions[r, :n]) (the default
  `action_mode`; or Isaac Lab's default_q + scale * a, q + scale * a) -> SafetyFilter (NaN ->
  hold + that robot's recurrent state reset, clamp to the joint limits).
When no robot has a valid observation the backend is not run. With several robots, a held
robot's row still goes through the batch step (on its last observation), so its recurrent state
advances; it is not reset.
Time jumping back (`check_time`, first in every tick: the clock `now_ns` went back more than
max_obs_age, as /clock does at a sim restart or a bag loop): every input from before is of the
world before the jump, whatever its stamp now looks like. The runner forgets them, as at
activation, without touching the buffers (their writer is another thread or process): the
joint-state value of before no longer counts as input (no command until one written after the
jump), the target and Cartesian target of before are read as none, the recurrent state,
previous action and last safe commands are reset; counted as `time_jumps_back`.
`step(now_ns)` is the single-robot form: robot 0's (command, info).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kestrel_common.time_jump import ClockJumps

from kestrel_control.core.double_buffer import LatestValueBuffer
from kestrel_control.core.policy_io import ACTION_MODES, PolicyIO, RowIO, build_io, check_obs_dim
from kestrel_control.core.safety import (SafetyCounters, SafetyFilter, SafetyStatus,
                                         validate_limits, validate_plausibility)
from kestrel_models.control.external import ModelSpec, load_policy
from kestrel_models.control.policy import ActorCritic, PolicyConfig
from kestrel_models.control.registry import AUTO, POST_BACKENDS, check_backend, create_backend
from kestrel_models.control.runtimes import PolicyBackend, PostSpec


def _kinematics(cfg: RunnerConfig) -> Any:
    """The arm's forward kinematics for the ee_* observation terms (Pinocchio, imported only
    then); ValueError naming the parameter."""
    from kestrel_control.core.kinematics import ARM_JOINTS, ArmKinematics

    names = tuple(cfg.joint_names) or ARM_JOINTS
    if len(names) != cfg.num_joints:
        raise ValueError(f"parameter 'joint_names' = {list(names)}: {cfg.num_joints} joints "
                         "(joint limits) need as many names")
    if cfg.robot_description:
        return ArmKinematics(cfg.robot_description, joint_names=names)
    return ArmKinematics.from_default(joint_names=names)


def padded_batch(num_robots: int) -> int:
    """Smallest power of two >= num_robots."""
    return 1 << max(0, int(num_robots) - 1).bit_length()


@dataclass
class RunnerConfig:
    """Validated in `__post_init__`; errors name the parameter and value."""

    joint_lower: Any  # [n] rad
    joint_upper: Any  # [n] rad
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    action_scale: float = 0.05  # rad of command offset per unit of tanh(action)
    max_obs_age_s: float = 0.02  # s, older observations -> hold
    # plausible observations: positions within the joint limits +- this margin, rad, and speeds
    # up to max_obs_velocity, rad/s (inf: that check off); others -> hold, counted
    obs_position_margin: float = math.inf
    max_obs_velocity: float = math.inf
    backend: str = "cpu_eager"  # one of BACKENDS, or "auto" (registry.auto_candidates)
    weights_path: str = ""  # torch state_dict file (reference architecture, `policy` dims)
    seed: int = 0  # random-weight seed
    warmup_steps: int = 20  # inference calls at construction
    model: ModelSpec | None = None  # a user's TorchScript/ONNX file (overrides the above)
    num_robots: int = 1  # robots batched into one inference
    latency_compensation: bool = False  # predict positions forward by age + compute latency
    cache_dir: str = ""  # for exported ONNX files ("" = a temporary directory)
    gpu_programs: int = 64  # cuda_persistent: resident programs (SMs held while ticks come)
    # what the policy sees and what its actions mean (policy_io.py; defaults: the reference)
    obs_layout: tuple[str, ...] = ()  # () = joint_pos, joint_vel, target, last_action
    action_mode: str = ACTION_MODES[0]  # q + scale * tanh(a)
    action_clip: float = math.inf  # raw actions clamped to +-this first (rsl_rl clip_actions)
    default_joint_positions: tuple[float, ...] = ()  # [n] rad; () = zeros
    action_scales: tuple[float, ...] = ()  # [n] per joint; () = action_scale for every joint
    # the ee_* observation terms' forward kinematics (kestrel_control.core.kinematics): the
    # URDF text ("" = kestrel_description's) and the joints of the joint vectors, in order
    # (() = the arm's six); read only when the layout has such a term
    robot_description: str = ""
    joint_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        lower, upper = validate_limits(self.joint_lower, self.joint_upper)
        self.joint_lower, self.joint_upper = lower, upper
        check_backend(self.backend)  # an unknown name, or one that cannot run here
        if not (isinstance(self.action_scale, (int, float)) and math.isfinite(self.action_scale)
                and self.action_scale > 0):
            raise ValueError(f"parameter 'action_scale' = {self.action_scale!r}: must be > 0")
        if not (isinstance(self.max_obs_age_s, (int, float)) and self.max_obs_age_s > 0):
            raise ValueError(f"parameter 'max_obs_age' = {self.max_obs_age_s!r}: must be > 0")
        validate_plausibility(self.obs_position_margin, self.max_obs_velocity)
        if self.warmup_steps < 0:
            raise ValueError(f"parameter 'warmup_steps' = {self.warmup_steps!r}: must be >= 0")
        if not (isinstance(self.num_robots, int) and 1 <= self.num_robots <= 1024):
            raise ValueError(f"parameter 'robots' = {self.num_robots!r}: 1 to 1024 robots")
        if not (isinstance(self.gpu_programs, int) and 1 <= self.gpu_programs <= 1024):
            raise ValueError(f"parameter 'gpu_programs' = {self.gpu_programs!r}: 1 to 1024 "
                             "(and at most the GPU's SM count, checked by the backend)")
        self.obs_layout = tuple(self.obs_layout)
        self.default_joint_positions = tuple(self.default_joint_positions)
        self.action_scales = tuple(self.action_scales)
        # the action mapping now; the layout's sizes once the policy is loaded (check_obs_dim)
        build_io(self.num_joints, self.num_joints, self.obs_layout, self.action_mode,
                 self.action_scale, self.action_clip, self.default_joint_positions,
                 self.action_scales)
        if self.model is None:
            self.model = ModelSpec(path=self.weights_path, format="state_dict",
                                   config=self.policy, seed=self.seed,
                                   path_param="weights_path")

    @property
    def num_joints(self) -> int:
        return int(self.joint_lower.shape[0])


@dataclass
class StepInfo:
    """Outcome of one robot's tick (preallocated, updated in place)."""

    status: SafetyStatus = SafetyStatus.NO_INPUT
    valid: bool = False  # a command is available to send
    obs_age_s: float = float("nan")  # now - observation stamp, s
    obs_version: int = 0  # version of the joint-state value used (0 = none yet)
    obs_stamp_ns: int = 0  # its stamp, ns (node clock)
    predicted_s: float = 0.0  # how far the positions were predicted forward, s


class _Robot:
    """Per-robot buffers, preallocated."""

    def __init__(self, cfg: RunnerConfig, io: PolicyIO, counters: Any, obs_row: np.ndarray,
                 act_row: np.ndarray, buffers: tuple[Any, ...] | None = None) -> None:
        n = cfg.num_joints
        self.safety = SafetyFilter(cfg.joint_lower, cfg.joint_upper, cfg.max_obs_age_s, counters,
                                   cfg.obs_position_margin, cfg.max_obs_velocity)
        if buffers is None:
            buffers = (LatestValueBuffer((2, n)), LatestValueBuffer((n,)))
        shapes = ((2, n), (n,), (3,))[:max(2, len(buffers))]  # (3,): the Cartesian target
        for buf, shape in zip(buffers, shapes, strict=True):
            if tuple(buf.shape) != shape:
                raise ValueError(f"parameter 'buffers' = shape {tuple(buf.shape)}: expected "
                                 f"{shape}")
        self.joint_states = buffers[0]  # [positions rad; velocities rad/s]
        self.target = buffers[1]  # joint position target, rad
        # [3, n]: positions rad, velocities rad/s, target rad: the obs row's first 3n values in
        # the same order, so one finite check and one copy cover all three
        self.inputs = np.zeros((3, n))
        self.inputs_flat = self.inputs.reshape(-1)  # [3n] view (the finite check)
        self.js = self.inputs[:2]  # [2, n] view: what the joint-state buffer is read into
        self.pos, self.vel, self.target_now = self.inputs  # views, [n] each
        self.proposed = np.zeros(n)
        self.predicted = np.zeros(n)  # vel * ahead, rad (latency compensation, no temporary)
        self.info = StepInfo()
        self.obs, self.act = obs_row, act_row  # views into the backend's static buffers
        # the obs row's terms from `inputs`, the command from the actions, the previous action
        self.io = RowIO(io, self.inputs, obs_row, act_row,
                        _kinematics(cfg) if io.uses_ee else None)
        # Cartesian end-effector target [3] m, base frame (the ee_* terms; none: hold); a
        # third buffer given (e.g. a shared-memory one) or a new one
        self.ee_target = None
        if io.uses_ee:
            self.ee_target = buffers[2] if len(buffers) > 2 else LatestValueBuffer((3,))
        self.zeros_a = np.zeros(act_row.shape[0], dtype=act_row.dtype)  # finite check of act


class PolicyRunner:
    """Policy backend + per-robot safety filters and input buffers (see module docstring)."""

    def __init__(self, config: RunnerConfig, counters: Any = None,
                 buffers: list[tuple[Any, ...]] | None = None) -> None:
        """buffers: per robot (joint states [2, n], target [n][, Cartesian target [3]]) with
        LatestValueBuffer's read_into/write API (e.g. shared-memory ones of the loop process);
        default: new LatestValueBuffers."""
        self.config = config
        if buffers is not None and len(buffers) != config.num_robots:
            raise ValueError(f"parameter 'buffers' = {len(buffers)} pairs: expected one per "
                             f"robot ({config.num_robots})")
        torch.set_num_threads(1)  # process-wide: one intra-op thread, no pool wake-ups
        self.policy = load_policy(config.model)
        n = config.num_joints
        self.io = build_io(n, self.policy.num_actions, config.obs_layout, config.action_mode,
                           config.action_scale, config.action_clip,
                           config.default_joint_positions, config.action_scales)
        check_obs_dim(self.io, n, self.policy.obs_dim, self.policy.num_actions,
                      self.policy.source,
                      user_model=self.policy.source.startswith(("TorchScript", "ONNX")))
        self.num_joints, self.num_actions = n, self.policy.num_actions
        self.num_robots = config.num_robots
        self.batch = padded_batch(config.num_robots)
        # the in-graph command computes q + scale * tanh(a) from obs[:, :n]: only then
        post = PostSpec(n, tuple(config.joint_lower), tuple(config.joint_upper),
                        float(config.action_scale)) if (config.backend in (*POST_BACKENDS, AUTO)
                                                        and self.io.is_reference) else None
        self.backend: PolicyBackend = create_backend(
            config.backend, self.policy, self.batch, cache_dir=config.cache_dir,
            warmup_steps=0, post=post, programs=config.gpu_programs)
        # [B, n + 2] float32 (command | finite | clamped) from the graph, or None (host path)
        self._post = getattr(self.backend, "post_np", None)
        self.model: ActorCritic | None = self.policy.extra.get("model")
        self.device = self.backend.device
        self.counters = counters if counters is not None else SafetyCounters()
        obs, act = self.backend.obs_np, self.backend.act_np  # [B, obs_dim], [B, A] float32
        self.robots = [_Robot(config, self.io, self.counters, obs[r], act[r],
                              None if buffers is None else buffers[r])
                       for r in range(self.num_robots)]
        first = self.robots[0]
        self.joint_states, self.target, self.safety = first.joint_states, first.target, \
            first.safety
        self.info = first.info
        self._obs = first.obs  # robot 0's observation row [obs_dim] (tests)
        self.commands = np.zeros((self.num_robots, n))  # rad, one row per robot
        # [EMA of the backend step time, last step time], s; an array: the C tick updates it
        self._lat = np.zeros(2)
        # per robot: version of the target now in its `inputs` (0 = none: zeros)
        self._tver = np.zeros(self.num_robots, dtype=np.int64)
        self._ever = np.zeros(self.num_robots, dtype=np.int64)  # same, Cartesian targets
        self._ready = [False] * self.num_robots  # per tick: robot has a fresh, finite obs
        # backwards clock jumps (check_time); per robot, the joint-state version at the last
        # jump: that value and older ones are not input (0: none)
        self._clock_jumps = ClockJumps(config.max_obs_age_s)
        self._js_floor = [0] * self.num_robots  # (a list: read every tick, plain ints)
        self._after_jump = False  # a robot has had no joint state since the last jump
        self._infos = [r.info for r in self.robots]
        self._compensate = bool(config.latency_compensation)
        self.warmup(config.warmup_steps)

    @property
    def compute_latency_s(self) -> float:
        """EMA of the backend step time, s (warm-up: the median of the warm-up steps)."""
        return float(self._lat[0])

    @compute_latency_s.setter
    def compute_latency_s(self, value: float) -> None:
        self._lat[0] = value

    @property
    def _last_step_s(self) -> float:
        return float(self._lat[1])

    # ---- lifecycle -------------------------------------------------------------------------
    def warmup(self, steps: int) -> None:
        """Run inference `steps` times on zeros, then reset the recurrent state. The compute
        latency estimate starts at the median of these steps (first calls may compile)."""
        times = []
        for _ in range(steps):
            self._infer()
            times.append(self._last_step_s)
        if times:
            self.compute_latency_s = float(np.median(times))
        self.reset()

    def reset(self) -> None:
        """Activation: zero the recurrent state and observations, forget the last safe commands
        and clear the input buffers, so that nothing received before is acted on: no robot
        has input (no command) until a joint state written after this call."""
        self.backend.reset_state()
        self.backend.obs_np[:] = 0.0
        self.backend.act_np[:] = 0.0
        self._tver[:] = 0
        self._ever[:] = 0
        self._js_floor = [0] * self.num_robots
        self._after_jump = False
        self._clock_jumps.reset()
        for robot in self.robots:
            robot.safety.reset()
            robot.joint_states.clear()
            robot.target.clear()
            if robot.ee_target is not None:
                robot.ee_target.clear()
                robot.io.ee_target_set = False  # hold where the arm is until a target comes
            robot.inputs.fill(0.0)

    def check_time(self, now_ns: int) -> bool:
        """The tick's clock reading: True when it jumped back (see the module docstring);
        then every input received before is forgotten (in place: the loop process's C tick
        holds the arrays' addresses)."""
        if not self._clock_jumps.observe(now_ns):
            return False
        self.backend.reset_state()
        self.backend.obs_np[:] = 0.0
        self.backend.act_np[:] = 0.0
        for r, robot in enumerate(self.robots):
            robot.safety.reset()
            self._js_floor[r] = robot.joint_states.version
            self._tver[r] = robot.target.version  # read as none: zeros in inputs
            if robot.ee_target is not None:
                self._ever[r] = robot.ee_target.version
                robot.io.ee_target_set = False
            robot.inputs.fill(0.0)
        self._after_jump = True
        self.counters.time_jumps_back += 1
        return True

    @property
    def after_jump(self) -> bool:
        """A robot has had no joint state since the last backwards jump (the loop process
        runs the Python tick until every one has: its C tick knows no such floor)."""
        if self._after_jump:
            self._after_jump = any(r.joint_states.version <= f
                                   for r, f in zip(self.robots, self._js_floor, strict=True))
        return self._after_jump

    def close(self) -> None:
        """Release the backend's non-memory resources (cuda_persistent: its resident kernel);
        a later tick would start them again."""
        self.backend.close()

    def reset_recurrent(self, index: int = 0) -> None:
        """Zero robot `index`'s recurrent state and previous action; keep its last command."""
        self.backend.reset_state(index)
        self.robots[index].io.clear_prev()

    # ---- per tick --------------------------------------------------------------------------
    def _infer(self) -> None:
        t0 = time.perf_counter()
        self.backend.step()
        self._record_step(time.perf_counter() - t0)

    def _record_step(self, dt: float) -> None:
        """Backend step time dt, s, into [EMA, last] (native_tick.c's record_step too)."""
        lat = self._lat
        lat[1] = dt
        lat[0] += 0.05 * (dt - lat[0])

    def _infer_late(self, t0_ns: int) -> None:
        """The C tick posted this step's request at time.monotonic_ns() `t0_ns` and stopped
        waiting (native_tick.py): wait here; the step time counts from t0_ns."""
        self.backend.finish_late()
        self._record_step((time.monotonic_ns() - t0_ns) * 1e-9)

    def _prepare(self, index: int, now_ns: int) -> bool:
        """Read robot `index`'s inputs, fill its obs row; False when it holds (or no input)."""
        robot = self.robots[index]
        info = robot.info
        version, stamp = robot.joint_states.read_into(robot.js)
        info.obs_version, info.obs_stamp_ns = version, stamp
        if version <= self._js_floor[index]:  # none yet, or from before a time jump
            info.status, info.valid, info.obs_age_s = SafetyStatus.NO_INPUT, False, math.nan
            return False
        target, tver = robot.target, self._tver
        if target.version != tver[index]:  # targets change rarely: copy only then
            tver[index] = target.read_into(robot.target_now)[0]
        ee = robot.ee_target
        if ee is not None and ee.version != self._ever[index]:
            self._ever[index] = ee.read_into(robot.io.ee_target)[0]
            robot.io.ee_target_set = True
        age = (now_ns - stamp) * 1e-9
        info.obs_age_s = age
        # one check: stale (counted), else any NaN/inf in positions, velocities or the target
        status = robot.safety.check_observation(robot.inputs_flat, age)
        if status is not SafetyStatus.OK:
            info.status = status
            # an implausible position must not become a command, not even clamped: hold the
            # last safe command or send nothing
            pos = None if status is SafetyStatus.IMPLAUSIBLE_OBS else robot.pos
            info.valid = robot.safety.hold(self.commands[index], pos)
            return False
        if self._compensate:
            ahead = min(max(age, 0.0) + self.compute_latency_s, robot.safety.max_obs_age_s)
            # linear prediction in place (robot.js is a copy), through a preallocated row:
            # `pos += vel * ahead` would allocate a temporary array every tick
            np.multiply(robot.vel, ahead, out=robot.predicted)
            robot.pos += robot.predicted
            info.predicted_s = ahead
        robot.io.write_obs()  # the layout's input terms, float32
        # the previous action's columns hold it already (written below / by reset)
        return True

    def _finish(self, index: int) -> None:
        robot = self.robots[index]
        if self._post is not None:  # command, clamp and finite check computed in the graph
            self._finish_post(index, robot)
            return
        robot.io.propose(robot.pos, robot.proposed)  # float64, as the C tick
        if not math.isfinite(robot.act.dot(robot.zeros_a)):  # a NaN/inf action: rejected below
            robot.proposed.fill(math.nan)
        command = self.commands[index]
        status = robot.safety.filter_command(command, robot.proposed, robot.pos)
        if status is SafetyStatus.OK:
            robot.io.store_prev()
            robot.info.valid = True
        else:  # non-finite policy output: drop the recurrent state, it may be poisoned
            self.reset_recurrent(index)
            robot.info.valid = robot.safety.hold(command, robot.pos)
        robot.info.status = status

    def _finish_post(self, index: int, robot: _Robot) -> None:
        row, n = self._post[index], self.num_joints
        command = self.commands[index]
        if row[n] != 0.0:  # every action finite
            status = robot.safety.accept_clamped(command, row[:n], row[n + 1] != 0.0)
        else:
            robot.proposed.fill(math.nan)
            status = robot.safety.filter_command(command, robot.proposed, robot.pos)
        if status is SafetyStatus.OK:
            robot.io.store_prev()
            robot.info.valid = True
        else:
            self.reset_recurrent(index)
            robot.info.valid = robot.safety.hold(command, robot.pos)
        robot.info.status = status

    def step_all(self, now_ns: int) -> tuple[np.ndarray, list[StepInfo]]:
        """One tick for every robot. Returns (commands [R, n] rad, per-robot infos); send row r
        only when `infos[r].valid`. Arrays are the runner's own (overwritten next tick)."""
        self.check_time(now_ns)
        if self._prepare_all(now_ns):
            self._infer()
            self._finish_all()
        return self.commands, self._infos

    def _prepare_all(self, now_ns: int) -> bool:
        """_prepare every robot; True when at least one is ready (then infer and finish)."""
        ready = self._ready
        any_ready = False
        for r in range(self.num_robots):
            ok = self._prepare(r, now_ns)
            ready[r] = ok
            any_ready = any_ready or ok
        return any_ready

    def _finish_all(self, all_ready: bool = False) -> None:
        """_finish every ready robot (all_ready: every robot, as the C tick prepared them)."""
        ready = self._ready
        for r in range(self.num_robots):
            if all_ready or ready[r]:
                self._finish(r)

    def step(self, now_ns: int) -> tuple[np.ndarray, StepInfo]:
        """Single-robot form: robot 0's (command [n] rad, info). Never raises for bad input."""
        self.step_all(now_ns)
        return self.commands[0], self.info
