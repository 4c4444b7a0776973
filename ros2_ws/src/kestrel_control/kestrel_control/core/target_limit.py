"""Speed limit of a commanded joint target (ControlTarget.max_speed, rad/s per joint).

A target message names where the joints should go; the policy is given a target that moves
there at most `max_speed` rad/s per joint, from where the previous target was (or from the
joint positions, for the first target after activation). No ROS here: the node advances a
`TargetRamp` per robot from a timer and writes what it returns into the loop's target buffer.

`step_toward` is the joint-space limiter itself (pure), for anything that turns a goal into
joint targets over time (e.g. Cartesian tracking through IK).
"""

from __future__ import annotations

import math

import numpy as np


def speed_limit(max_speed: float) -> float | None:
    """ControlTarget.max_speed -> the limit in rad/s: math.inf for 0 or +inf (no limit, the
    message default), None when it is not a speed (negative, NaN)."""
    if max_speed == 0.0 or max_speed == math.inf:
        return math.inf
    if not (max_speed > 0.0):  # negative or NaN
        return None
    return float(max_speed)


def step_toward(current: np.ndarray, goal: np.ndarray, max_step: float) -> np.ndarray:
    """`current` moved toward `goal` by at most `max_step` per joint (rad): a new array [n].

    Each joint independently (the limit is per joint, rad/s x dt), so joints with less to go
    arrive first. max_step inf: the goal itself; max_step 0: current unchanged."""
    current = np.asarray(current, dtype=np.float64)
    goal = np.asarray(goal, dtype=np.float64)
    if current.shape != goal.shape:
        raise ValueError(f"step_toward: current {current.shape} and goal {goal.shape} differ")
    if not max_step >= 0.0:
        raise ValueError(f"step_toward: max_step = {max_step!r}: must be >= 0")
    if max_step == math.inf:
        return goal.copy()
    return current + np.clip(goal - current, -max_step, max_step)


class TargetRamp:
    """One robot's speed-limited joint target.

    set_goal(goal, max_speed): a new goal and limit (rad, rad/s; inf = jump to it).
    advance(dt, positions): the next target to write (rad [n]) after dt s, or None when there
    is nothing new to write (no goal, arrived, or no start yet: the first goal starts from the
    joint positions, so without a joint state nothing is written). `active`: more to come.
    """

    def __init__(self, num_joints: int) -> None:
        self.n = int(num_joints)
        self.current: np.ndarray | None = None  # the target last written, rad [n]
        self.goal: np.ndarray | None = None  # rad [n]
        self.max_speed = math.inf  # rad/s

    @property
    def active(self) -> bool:
        return self.goal is not None

    def reset(self) -> None:
        """Forget the target and the goal (activation)."""
        self.current = self.goal = None
        self.max_speed = math.inf

    def set_goal(self, goal: np.ndarray, max_speed: float) -> None:
        goal = np.asarray(goal, dtype=np.float64)
        if goal.shape != (self.n,):
            raise ValueError(f"TargetRamp: goal of shape {goal.shape}, expected ({self.n},)")
        if not max_speed > 0.0:
            raise ValueError(f"TargetRamp: max_speed = {max_speed!r}: must be > 0 rad/s")
        self.goal, self.max_speed = goal.copy(), float(max_speed)

    def advance(self, dt: float, positions: np.ndarray | None) -> np.ndarray | None:
        """dt: time since the last call, s (>= 0). positions: the latest joint positions, rad
        [n] (None: none yet), used only to start the first ramp."""
        if self.goal is None:
            return None
        unlimited = self.max_speed == math.inf
        if self.current is not None and not np.isfinite(self.current).all():
            self.current = None  # a non-finite target was sent (the loop held): start afresh
        if self.current is None:
            if unlimited:
                self.current = self.goal
            elif positions is None:
                return None  # no start yet: write nothing, the loop holds anyway
            else:  # the first write is where the joints are; the motion starts from there
                self.current = np.asarray(positions, dtype=np.float64).copy()
                dt = 0.0
        step = math.inf if unlimited else self.max_speed * max(dt, 0.0)
        nxt = step_toward(self.current, self.goal, step)
        self.current = nxt
        if np.array_equal(nxt, self.goal):
            self.goal = None
        return nxt
