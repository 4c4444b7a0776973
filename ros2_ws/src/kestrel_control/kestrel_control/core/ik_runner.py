"""The differential-IK reference controller behind PolicyRunner's interface (no rclpy), so the
control node runs it in the same real-time loop, with the same input buffers, safety filter,
deadlines and statistics (loop.mode 'thread').

Per tick (`step_all(now_ns)`), per robot, no allocation in steady state:
  joint states [2, n] from their buffer (stale / non-finite / implausible -> hold, counted:
  SafetyFilter.check_observation, as for the policy);
  the mode buffer [5] = (x, y, z m, max_speed m/s, mode) written by the node's target callback:
  mode ControlTarget.MODE_CARTESIAN (2) -> CartesianController.set_target (when it changed;
  a non-finite position is refused: hold, counted as rejected_nonfinite),
  MODE_JOINT (1) -> the joint target buffer [n] rad is the command (the node ramps it at the
  target's max_speed), MODE_HOLD (0) or nothing yet -> hold;
  the proposed command -> SafetyFilter.filter_command (non-finite -> hold, clamp to the joint
  limits, counted) -> commands[r].
A backwards jump of the clock (as PolicyRunner.check_time): the joint states, target and mode
of before are forgotten (no command until a joint state of after the jump, then hold there
until a new target), counted as `time_jumps_back`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from kestrel_common.time_jump import ClockJumps

from kestrel_control.core.cartesian import CartesianConfig, CartesianController
from kestrel_control.core.double_buffer import LatestValueBuffer
from kestrel_control.core.kinematics import ArmKinematics
from kestrel_control.core.policy_runner import RunnerConfig, StepInfo
from kestrel_control.core.safety import SafetyCounters, SafetyFilter, SafetyStatus

MODE_HOLD, MODE_JOINT, MODE_CARTESIAN = 0, 1, 2  # ControlTarget's constants
MODE_SIZE = 5  # (x, y, z, max_speed, mode)


@dataclass(frozen=True)
class _Source:
    source: str  # what the node logs as "policy"


class _IkRobot:
    def __init__(self, cfg: RunnerConfig, kin: ArmKinematics, cart: CartesianConfig,
                 counters: Any) -> None:
        n = cfg.num_joints
        self.safety = SafetyFilter(cfg.joint_lower, cfg.joint_upper, cfg.max_obs_age_s, counters,
                                   cfg.obs_position_margin, cfg.max_obs_velocity)
        self.joint_states = LatestValueBuffer((2, n))  # [positions rad; velocities rad/s]
        self.target = LatestValueBuffer((n,))  # joint target, rad (MODE_JOINT)
        self.mode = LatestValueBuffer((MODE_SIZE,))  # (x, y, z m, max_speed m/s, mode)
        self.controller = CartesianController(kin, cart)
        self.js = np.zeros((2, n))
        self.js_flat = self.js.reshape(-1)
        self.pos = self.js[0]
        self.target_now = np.zeros(n)
        self.mode_now = np.zeros(MODE_SIZE)
        self.proposed = np.zeros(n)
        self.tver = 0  # version of target_now (0 = none)
        self.mver = 0  # version of mode_now
        self.js_floor = 0  # joint-state version at the last time jump: it and older are none
        self.info = StepInfo()


class IkRunner:
    """CartesianController per robot + the safety filter (see the module docstring)."""

    def __init__(self, config: RunnerConfig, kinematics: ArmKinematics,
                 cartesian: CartesianConfig, counters: Any = None) -> None:
        if kinematics.n != config.num_joints:
            raise ValueError(f"parameter 'joint_names': {config.num_joints} joints, the robot "
                             f"description's arm has {kinematics.n}")
        self.config = config
        self.counters = counters if counters is not None else SafetyCounters()
        self.num_joints, self.num_robots = config.num_joints, config.num_robots
        self.batch = config.num_robots
        self.robots = [_IkRobot(config, kinematics, cartesian, self.counters)
                       for _ in range(config.num_robots)]
        self.commands = np.zeros((self.num_robots, self.num_joints))  # rad
        self._infos = [r.info for r in self.robots]
        self.policy = _Source(f"differential IK ({kinematics.n} joints, "
                              f"{cartesian.rate_hz:g} Hz)")
        self._lat = np.zeros(1)  # EMA of the step time, s
        self._clock_jumps = ClockJumps(config.max_obs_age_s)

    @property
    def compute_latency_s(self) -> float:
        return float(self._lat[0])

    def reset(self) -> None:
        """Activation: forget targets, last safe commands and every input received before."""
        for robot in self.robots:
            robot.safety.reset()
            robot.controller.clear()
            for buf in (robot.joint_states, robot.target, robot.mode):
                buf.clear()
            robot.tver = robot.mver = robot.js_floor = 0
            robot.mode_now.fill(0.0)
        self._clock_jumps.reset()

    def check_time(self, now_ns: int) -> bool:
        """The tick's clock reading: True when it jumped back; then every input received
        before is forgotten (the buffers untouched: their writer is another thread)."""
        if not self._clock_jumps.observe(now_ns):
            return False
        for robot in self.robots:
            robot.safety.reset()
            robot.controller.clear()
            robot.js_floor = robot.joint_states.version
            robot.tver, robot.mver = robot.target.version, robot.mode.version
            robot.target_now.fill(0.0)
            robot.mode_now.fill(0.0)  # MODE_HOLD until a target of after the jump
        self.counters.time_jumps_back += 1
        return True

    def close(self) -> None:
        """Nothing to release (the policy runner's interface)."""

    def step_all(self, now_ns: int) -> tuple[np.ndarray, list[StepInfo]]:
        """One tick for every robot: (commands [R, n] rad, infos); send row r only when
        infos[r].valid. Never raises for bad input."""
        t0 = time.perf_counter()
        self.check_time(now_ns)
        for r in range(self.num_robots):
            self._step(r, now_ns)
        self._lat[0] += 0.05 * (time.perf_counter() - t0 - self._lat[0])
        return self.commands, self._infos

    def step(self, now_ns: int) -> tuple[np.ndarray, StepInfo]:
        self.step_all(now_ns)
        return self.commands[0], self._infos[0]

    def _step(self, r: int, now_ns: int) -> None:
        robot, command = self.robots[r], self.commands[r]
        info = robot.info
        version, stamp = robot.joint_states.read_into(robot.js)
        info.obs_version, info.obs_stamp_ns = version, stamp
        if version <= robot.js_floor:  # none yet, or from before a time jump
            info.status, info.valid, info.obs_age_s = SafetyStatus.NO_INPUT, False, math.nan
            return
        age = (now_ns - stamp) * 1e-9
        info.obs_age_s = age
        status = robot.safety.check_observation(robot.js_flat, age)
        if status is not SafetyStatus.OK:
            info.status = status
            pos = None if status is SafetyStatus.IMPLAUSIBLE_OBS else robot.pos
            info.valid = robot.safety.hold(command, pos)
            return
        if robot.mode.version != robot.mver:  # a new target message
            robot.mver = robot.mode.read_into(robot.mode_now)[0]
            mode = int(robot.mode_now[4])
            if mode == MODE_CARTESIAN:
                if not robot.controller.set_target(robot.mode_now[:3],
                                                   float(robot.mode_now[3])):
                    self.counters.rejected_nonfinite += 1  # NaN/inf target: hold
            else:
                robot.controller.clear()
        if robot.target.version != robot.tver:
            robot.tver = robot.target.read_into(robot.target_now)[0]
        mode = int(robot.mode_now[4])
        proposed = robot.proposed
        if mode == MODE_CARTESIAN:
            ok = robot.controller.step(robot.pos, proposed)
        elif mode == MODE_JOINT and robot.tver:
            np.copyto(proposed, robot.target_now)
            ok = True
        else:
            ok = False
        if not ok:  # hold: the last safe command, else where the arm is
            info.status = SafetyStatus.OK
            info.valid = robot.safety.hold(command, robot.pos)
            return
        info.status = robot.safety.filter_command(command, proposed, robot.pos)
        info.valid = info.status is SafetyStatus.OK or robot.safety.hold(command, robot.pos)
