"""The control node's input side (executor threads, the callbacks' mutually exclusive group):
joint states and targets from their subscriptions into the loop's buffers, and the timer that
moves a speed-limited joint target (ControlTarget.max_speed, core/target_limit.py). Callbacks
check a message's structure (counted drops) and write; values are the loop's SafetyFilter's
to judge. Every callback first checks the node clock for a backwards jump (`_time_jumped`).
A mixin of ControlNode (control_node.py), which owns the state used here."""

from __future__ import annotations

import array
import math
from typing import Any

import numpy as np
from kestrel_interfaces.msg import ControlTarget
from sensor_msgs.msg import JointState

from kestrel_common.conversions import stamp_to_ns
from kestrel_control.core.target_limit import speed_limit


class ControlInputs:
    """ControlNode's subscription callbacks and target timer (see the module docstring)."""

    def _time_jumped(self) -> bool:
        """The node clock jumped back (kestrel_common.time_jump; a sim restart, a bag loop)
        since the last callback: the speed-limited targets and the gripper state of before
        are dropped, as at activation (the loop forgets its own inputs: the runner's
        check_time, which counts the jump). Logged."""
        if not self._clock_jumps.observe(self._clock.now().nanoseconds):
            return False
        for ramp in self._ramps:
            ramp.reset()
        if self._ramp_timer is not None:
            self._ramp_timer.cancel()
        self._have_pos = [False] * len(self._ramps)
        if self._gripper_closed > 0.0:
            for msg in self._cmd_msgs:
                msg.position[-1] = 0.0  # open, as configured, until a target says otherwise
        self.get_logger().warning(
            f"time jumped back {self._clock_jumps.last_jump_s:.3f} s (a sim restart, a bag "
            "loop?): joint states, targets and the policy state of before are forgotten; "
            "commands resume with the next joint state")
        return True

    def _on_joint_state(self, robot: int, msg: JointState) -> None:
        if not self._active:
            return
        self._time_jumped()
        n = len(self._index)
        names, pos, vel = msg.name, msg.position, msg.velocity
        if len(names) < n or len(pos) != len(names) or len(vel) not in (0, len(names)):
            self.drop("joint_state_bad_length",
                      f"{len(names)} names, {len(pos)} positions, {len(vel)} velocities; the "
                      f"node has {n} joints")
            return
        if names != self._perm_names[robot]:  # new joint order: rebuild the permutation
            try:
                perm = np.array([list(names).index(j) for j in self._index], dtype=np.intp)
            except ValueError:  # a node joint is not named
                self.drop("joint_state_bad_names",
                          f"names {list(names)} are not the node's joints {list(self._index)}")
                return
            self._perm_names[robot], self._perm[robot] = list(names), perm
        self.check_stamp(msg.header.stamp)   # a stack on two clocks -> ERROR, named fix
        stamp = stamp_to_ns(msg.header.stamp) or self._clock.now().nanoseconds
        pos_a = np.frombuffer(pos, dtype=np.float64) if isinstance(pos, array.array) \
            else np.asarray(pos, dtype=np.float64)
        vel_a = np.frombuffer(vel, dtype=np.float64) if isinstance(vel, array.array) \
            else np.asarray(vel, dtype=np.float64)
        perm = self._perm[robot]

        def fill(slot: np.ndarray) -> None:  # slot: [2, n], node joint order
            np.take(pos_a, perm, out=slot[0])
            if vel_a.shape[0]:
                np.take(vel_a, perm, out=slot[1])
            else:
                slot[1] = 0.0

        self._js_bufs[robot].write_with(fill, stamp)
        np.take(pos_a, perm, out=self._last_pos[robot])  # where a speed-limited target starts
        self._have_pos[robot] = True

    def _on_target(self, robot: int, msg: ControlTarget) -> None:
        if not self._active:
            return
        self._time_jumped()
        if self._gripper_closed > 0.0:  # every target carries the gripper's state
            if math.isfinite(msg.gripper):
                self._cmd_msgs[robot].position[-1] = \
                    min(max(msg.gripper, 0.0), 1.0) * self._gripper_closed
            else:
                self.drop("target_bad_gripper", f"gripper {msg.gripper}: must be in [0, 1]")
        if self._mode_bufs and not self._to_ik_runner(robot, msg):
            return
        if msg.mode != ControlTarget.MODE_JOINT:
            # MODE_HOLD: keep the current joint target. MODE_CARTESIAN: to the policy's ee_*
            # terms when its layout has them, else held, counted.
            if msg.mode == ControlTarget.MODE_CARTESIAN:
                ee = self._ee_target_buffer(robot)
                if ee is None:
                    self.counters.inc("target_cartesian_held")
                else:
                    p = msg.position
                    ee.write(np.array([p.x, p.y, p.z]), stamp_to_ns(msg.header.stamp))
            else:
                self.counters.inc("target_hold")
            return
        n, q = len(self._index), msg.joint_positions
        if len(q) != n:
            self.drop("target_bad_length",
                      f"target has {len(q)} joint positions, the node has {n} joints")
            return
        limit = speed_limit(msg.max_speed)
        if limit is None:
            self.drop("target_bad_max_speed",
                      f"max_speed {msg.max_speed}: must be >= 0 rad/s (0 = no limit)")
            return
        goal = np.asarray(q, dtype=np.float64)
        stamp = stamp_to_ns(msg.header.stamp)
        ramp = self._ramps[robot]
        if limit == math.inf:  # no limit: the target as given (a later ramp starts there)
            ramp.reset()
            ramp.current = goal
            self._tgt_bufs[robot].write(goal, stamp)
            return
        ramp.set_goal(goal, limit)
        self._ramp_stamps[robot] = stamp
        if self._ramp_timer.is_canceled():
            self._ramp_last_ns = self._clock.now().nanoseconds
            self._ramp_timer.reset()
        self._advance_targets()  # the start point now (dt 0), then one step per timer period

    def _to_ik_runner(self, robot: int, msg: ControlTarget) -> bool:
        """controller ik: the target's mode (and Cartesian position) to the runner's mode
        buffer. True when the joint-target path must run too (MODE_JOINT)."""
        row = self._mode_rows[robot]
        if msg.mode == ControlTarget.MODE_CARTESIAN:
            if not (msg.max_speed >= 0.0):  # negative or NaN
                self.drop("target_bad_max_speed",
                          f"max_speed {msg.max_speed}: must be >= 0 m/s (0 = default)")
                return False
            p = msg.position
            row[:] = (p.x, p.y, p.z, msg.max_speed, ControlTarget.MODE_CARTESIAN)
        elif msg.mode == ControlTarget.MODE_JOINT:
            row[:] = (0.0, 0.0, 0.0, 0.0, ControlTarget.MODE_JOINT)
        else:
            row[:] = (0.0, 0.0, 0.0, 0.0, ControlTarget.MODE_HOLD)
            self.counters.inc("target_hold")
        self._mode_bufs[robot].write(row, stamp_to_ns(msg.header.stamp))
        return msg.mode == ControlTarget.MODE_JOINT

    def _ee_target_buffer(self, robot: int) -> Any:
        """The policy's Cartesian target buffer of `robot` (layouts with ee_* terms), or None."""
        if self._runner is not None:
            return getattr(self._runner.robots[robot], "ee_target", None)
        if self._proc is not None:
            bufs = getattr(self._proc, "ee_targets", None)
            return bufs[robot] if bufs else None
        return None

    def _advance_targets(self) -> None:
        """Timer (the callbacks' group): every ramping robot's target one step on, written
        into the loop's target buffer; the timer stops when none is left."""
        if self._time_jumped():  # the ramps of before are gone (the timer stops)
            return
        now = self._clock.now().nanoseconds
        # a late timer moves the target by at most two periods' worth: never a jump
        dt = min(max(now - self._ramp_last_ns, 0) * 1e-9, 2.0 * self._ramp_period)
        self._ramp_last_ns = now
        busy = False
        for r, ramp in enumerate(self._ramps):
            if not ramp.active:
                continue
            nxt = ramp.advance(dt, self._last_pos[r] if self._have_pos[r] else None)
            if nxt is not None:
                self._tgt_bufs[r].write(nxt, self._ramp_stamps[r])
            busy = busy or ramp.active
        if not busy:
            self._ramp_timer.cancel()
