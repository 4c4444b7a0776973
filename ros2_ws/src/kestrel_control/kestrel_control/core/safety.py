"""Safety filter between the policy and the robot: stale/NaN/implausible inputs -> hold,
commands clamped.

All per-cycle methods work on preallocated arrays, never allocate arrays and never raise: an
unexpected error inside them is treated like a non-finite value (hold + counted).
Counters live on a `counters` object with the attributes `stale_inputs`, `rejected_nonfinite`,
`rejected_implausible` and `clamped_actions` (a `LoopStats`, or a `SafetyCounters` by default);
counts are per cycle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np


class SafetyStatus(IntEnum):
    """Outcome of one cycle's checks (IntEnum members are singletons: returning one is free)."""

    OK = 0
    NO_INPUT = 1  # no observation received yet: nothing to command
    STALE = 2  # observation older than max_obs_age: holding
    NONFINITE_OBS = 3  # NaN/inf in the observation: holding
    NONFINITE_ACTION = 4  # NaN/inf in the policy output: holding
    # a position outside the joint limits by more than the margin, or a speed above the bound
    # (a broken encoder, a wrong unit, another robot's joint order): holding, and never a
    # command derived from that position
    IMPLAUSIBLE_OBS = 5


@dataclass
class SafetyCounters:
    stale_inputs: int = 0
    rejected_nonfinite: int = 0
    rejected_implausible: int = 0
    clamped_actions: int = 0
    time_jumps_back: int = 0  # backwards jumps of the clock (the runners forget their inputs)


def _all_finite(x: np.ndarray) -> bool:
    # The sum is NaN/inf iff some element is (or the sum overflows, ~1e308: bogus anyway).
    # No temporary array, unlike np.isfinite(x).all().
    return math.isfinite(float(x.sum()))


def _finite_dot(x: np.ndarray, zeros: dict) -> bool:
    """Every element finite? x . 0 is 0 for finite x and NaN as soon as one element is NaN/inf
    (exact: no overflow case). One BLAS call, ~3x cheaper than x.sum() on a few floats;
    `zeros` maps a 1-D shape to a preallocated zero vector (other shapes: the sum)."""
    z = zeros.get(x.shape)
    if z is None:
        return _all_finite(x)
    return math.isfinite(x.dot(z))


def validate_limits(joint_lower: Any, joint_upper: Any) -> tuple[np.ndarray, np.ndarray]:
    """Joint limits as float64 [n] arrays; ValueError naming the parameter and value if bad."""
    lower = np.asarray(joint_lower, dtype=np.float64).reshape(-1)
    upper = np.asarray(joint_upper, dtype=np.float64).reshape(-1)
    if lower.size == 0:
        raise ValueError(f"parameter 'joint_lower' = {list(lower)}: must not be empty")
    if upper.size != lower.size:
        raise ValueError(
            f"parameter 'joint_upper' = {upper.tolist()}: has {upper.size} values, "
            f"'joint_lower' has {lower.size}"
        )
    for name, arr in (("joint_lower", lower), ("joint_upper", upper)):
        if not np.isfinite(arr).all():
            raise ValueError(f"parameter '{name}' = {arr.tolist()}: must be finite")
    bad = np.nonzero(lower > upper)[0]
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"parameter 'joint_lower' = {lower.tolist()}: joint {i} lower {lower[i]} > "
            f"'joint_upper' {upper[i]}"
        )
    return lower, upper


def validate_plausibility(position_margin: float, max_velocity: float) -> None:
    """ValueError naming the parameter unless margin >= 0 rad and bound > 0 rad/s (inf: off)."""
    if not (isinstance(position_margin, (int, float)) and position_margin >= 0):
        raise ValueError(f"parameter 'obs_position_margin' = {position_margin!r}: must be >= 0 "
                         "rad")
    if not (isinstance(max_velocity, (int, float)) and max_velocity > 0):
        raise ValueError(f"parameter 'max_obs_velocity' = {max_velocity!r}: must be > 0 "
                         "rad/s")


class SafetyFilter:
    """Hold on stale/non-finite input, reject non-finite commands, clamp to joint limits.

    joint_lower, joint_upper: [n], rad. max_obs_age_s: an observation whose age (node-clock now
    minus its stamp) is above this, or below minus this (stamp from the future: a clock jump), is
    stale. The hold command is the last safe command, else the current position clamped.
    """

    def __init__(self, joint_lower: Any, joint_upper: Any, max_obs_age_s: float,
                 counters: Any = None, position_margin: float = math.inf,
                 max_velocity: float = math.inf) -> None:
        self.lower, self.upper = validate_limits(joint_lower, joint_upper)
        if not (isinstance(max_obs_age_s, (int, float)) and math.isfinite(max_obs_age_s)
                and max_obs_age_s > 0):
            raise ValueError(f"parameter 'max_obs_age' = {max_obs_age_s!r}: must be > 0 s")
        validate_plausibility(position_margin, max_velocity)
        self.max_obs_age_s = float(max_obs_age_s)
        self.counters = counters if counters is not None else SafetyCounters()
        n = self.lower.shape[0]
        self.num_joints = n
        # plausible [pos | vel]: |x - center| <= half, center/half [2n] (inf: not checked);
        # the loop process's C tick reads the same two arrays
        self.plaus_center = np.concatenate([(self.lower + self.upper) / 2, np.zeros(n)])
        self.plaus_half = np.concatenate([(self.upper - self.lower) / 2 + position_margin,
                                          np.full(n, float(max_velocity))])
        self._plaus_on = bool(np.isfinite(self.plaus_half).any())
        self._plaus_tmp = np.zeros(2 * n)
        self._last_safe = np.zeros(n)  # last command that passed the filter, rad
        # has_last_safe, as an int64 [1] that the loop process's C tick also sets
        self._has = np.zeros(1, dtype=np.int64)
        self._neq = np.zeros(n, dtype=bool)  # scratch for the clamp check
        # zero vectors for the finite check of [n] commands and flat [k * n] observations
        self._zeros = {(k * n,): np.zeros(k * n) for k in (1, 2, 3)}
        self.internal_errors = 0

    @property
    def has_last_safe(self) -> bool:
        return bool(self._has[0])

    @has_last_safe.setter
    def has_last_safe(self, value: bool) -> None:
        self._has[0] = int(value)

    def reset(self) -> None:
        """Forget the last safe command (on activation)."""
        self._has[0] = 0

    def check_observation(self, observation: np.ndarray, age_s: float) -> SafetyStatus:
        """Stale, non-finite or implausible observation (each counted)? `observation`: a float
        array whose first 2n values are [positions rad | velocities rad/s] (the runner's flat
        [pos | vel | target]); shorter ones get the finite check only. NaN age is stale."""
        try:
            if not (-self.max_obs_age_s <= age_s <= self.max_obs_age_s):
                self.counters.stale_inputs += 1
                return SafetyStatus.STALE
            if not _finite_dot(observation, self._zeros):
                self.counters.rejected_nonfinite += 1
                return SafetyStatus.NONFINITE_OBS
            if self._plaus_on and observation.shape[0] >= 2 * self.num_joints:
                t = self._plaus_tmp  # |x - center| - half > 0 somewhere: implausible
                np.subtract(observation[:2 * self.num_joints], self.plaus_center, out=t)
                np.abs(t, out=t)
                np.subtract(t, self.plaus_half, out=t)
                if t.max() > 0.0:
                    self.counters.rejected_implausible += 1
                    return SafetyStatus.IMPLAUSIBLE_OBS
            return SafetyStatus.OK
        except Exception:  # never raise in the hot path
            self.internal_errors += 1
            self.counters.rejected_nonfinite += 1
            return SafetyStatus.NONFINITE_OBS

    def hold(self, out: np.ndarray, position: np.ndarray | None = None) -> bool:
        """Write the hold command into `out` [n], rad. False when there is none (no safe command
        yet and no finite position): then `out` is left untouched and nothing may be sent."""
        try:
            if self._has[0]:
                np.copyto(out, self._last_safe)
                return True
            if position is not None and _finite_dot(position, self._zeros):
                self._clip(position, out)
                return True
            return False
        except Exception:
            self.internal_errors += 1
            return False

    def _clip(self, value: np.ndarray, out: np.ndarray) -> None:
        """out = value clamped to [lower, upper] (finite value; two ufunc calls: cheaper than
        np.clip's Python wrapper)."""
        np.maximum(value, self.lower, out=out)
        np.minimum(out, self.upper, out=out)

    def _accept(self, out: np.ndarray, clamped: bool) -> SafetyStatus:
        """`out` (finite, within the limits) is the command: count a clamp, remember it."""
        if clamped:
            self.counters.clamped_actions += 1
        self._last_safe[:] = out
        self._has[0] = 1
        return SafetyStatus.OK

    def accept_clamped(self, out: np.ndarray, command: np.ndarray,
                       clamped: bool) -> SafetyStatus:
        """A command the backend already clamped (float32, in its CUDA graph) and found finite:
        clipped again here in float64 (float32 limits can round just outside the float64 ones),
        counted when `clamped`, remembered as the last safe command."""
        try:
            self._clip(command, out)
            return self._accept(out, clamped)
        except Exception:
            self.internal_errors += 1
            self.counters.rejected_nonfinite += 1
            self.hold(out)
            return SafetyStatus.NONFINITE_ACTION

    def filter_command(self, out: np.ndarray, proposed: np.ndarray,
                       position: np.ndarray | None = None) -> SafetyStatus:
        """`proposed` [n] rad -> `out` [n] rad: non-finite -> hold (counted, NONFINITE_ACTION);
        else clamped to the limits (counted when any joint was clamped) and remembered as the
        last safe command. If NONFINITE_ACTION and `hold` had nothing, `out` is untouched."""
        try:
            if not _finite_dot(proposed, self._zeros):
                self.counters.rejected_nonfinite += 1
                self.hold(out, position)
                return SafetyStatus.NONFINITE_ACTION
            self._clip(proposed, out)
            np.not_equal(out, proposed, out=self._neq)
            return self._accept(out, np.count_nonzero(self._neq) > 0)
        except Exception:
            self.internal_errors += 1
            self.counters.rejected_nonfinite += 1
            self.hold(out, position)
            return SafetyStatus.NONFINITE_ACTION
