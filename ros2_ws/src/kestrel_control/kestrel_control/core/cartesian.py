"""Differential-IK reference controller: Cartesian tool-centre-point targets -> joint position
commands, one step per control tick (no rclpy, no allocation per tick after construction
besides Pinocchio's own results).

Per tick (`step(q_measured, out)`), period dt:
  1. reference configuration q_ref (the integrated command; re-synchronised to the measured
     q when they differ by more than `resync_rad`, e.g. after a hold or a collision);
  2. carrot: a point moving from the tcp position toward the target at the target's
     max_speed (m/s; the default when <= 0); the tcp tracks it:
     v = (carrot - tcp) * position_gain + carrot velocity, |v| <= max_speed;
  3. primary task, position (3 rows of the Jacobian J_p): damped least squares
     dq1 = J_p^T (J_p J_p^T + damping^2 I)^-1 v;
  4. secondary task, top-down orientation (tool z axis toward world -z, the grasp approach;
     yaw held), in the null space of the position task:
     N = I - J_p^+ J_p (J_p^+ nearly undamped, so N moves the tcp by nothing measurable),
     w = orientation_gain * (z_tool x (-z_world)),
     dq2 = (J_w N)^T ((J_w N)(J_w N)^T + damping^2 I)^-1 (w - J_w dq1);
     so position wins where the straight-down grasp cannot be reached (the bin's far corner);
  5. joint velocity limits (URDF <limit velocity> x velocity_scale): dq scaled uniformly;
     joint position limits [lower + margin, upper - margin]: a joint that would cross one is
     frozen (its Jacobian column zeroed) and both tasks are solved again without it;
  6. q_ref += dq dt -> the joint position command (the safety filter clamps it again).

Shapes: n arm joints (6); positions m; rotations (3, 3); Jacobian (6, n) world-aligned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kestrel_control.core.kinematics import ArmKinematics


@dataclass(frozen=True)
class CartesianConfig:
    """Gains and limits of the reference controller; errors name the parameter."""

    rate_hz: float = 1000.0  # control rate (dt = 1 / rate_hz)
    position_gain: float = 8.0  # 1/s: tcp error -> velocity
    orientation_gain: float = 4.0  # 1/s: tool-axis error (rad) -> angular velocity
    damping: float = 0.02  # DLS damping (m, or rad for the orientation task)
    default_speed: float = 0.25  # m/s when a target's max_speed <= 0
    max_speed: float = 1.0  # m/s: no target moves the tcp faster
    velocity_scale: float = 0.8  # fraction of the URDF's joint velocity limits
    limit_margin: float = 0.02  # rad kept from the joint position limits
    resync_rad: float = 0.3  # reference further than this from the measurement -> resync
    top_down: bool = True  # the orientation task (False: position only)
    # Joint ranges the controller keeps to, rad, intersected with the URDF's (empty = the
    # URDF's). The default keeps the arm's elbow bent (>= 0.2 rad): a straight elbow is the
    # arm's singularity, where the orientation task would otherwise park it out of reach.
    ik_lower: tuple[float, ...] = (-3.14159, -2.0, 0.2, -2.6, -2.6, -3.14159)
    ik_upper: tuple[float, ...] = ()

    def validate(self) -> None:
        checks = {
            "rate_hz": (10.0, 10000.0), "position_gain": (0.1, 100.0),
            "orientation_gain": (0.0, 100.0), "damping": (1e-4, 1.0),
            "default_speed": (1e-3, 2.0), "max_speed": (1e-3, 5.0),
            "velocity_scale": (0.01, 1.0), "limit_margin": (0.0, 0.5),
            "resync_rad": (0.01, 10.0),
        }
        for name in ("ik_lower", "ik_upper"):
            if not all(isinstance(v, (int, float)) and math.isfinite(v)
                       for v in getattr(self, name)):
                raise ValueError(f"parameter 'cartesian.{name}' = {getattr(self, name)!r}: "
                                 "must be finite, rad")
        for name, (lo, hi) in checks.items():
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and lo <= v <= hi):
                raise ValueError(f"parameter 'cartesian.{name}' = {v!r}: must be in "
                                 f"[{lo}, {hi}]")


# m: the damping of the pseudo-inverse behind the secondary task's null-space projector
# (_orientation); small against the position Jacobian's singular values inside the joint
# ranges the controller keeps to, nonzero so that the solve stays finite at a singularity.
NULL_DAMPING = 1e-3


def _add_diag3(a: np.ndarray, value: float) -> None:
    a[0, 0] += value
    a[1, 1] += value
    a[2, 2] += value


def _solve3_into(a: np.ndarray, b: np.ndarray, out: np.ndarray) -> None:
    """out = a^-1 b for a symmetric positive definite (3, 3) a (Cramer's rule, no allocation
    beyond Python floats)."""
    a00, a01, a02 = float(a[0, 0]), float(a[0, 1]), float(a[0, 2])
    a11, a12, a22 = float(a[1, 1]), float(a[1, 2]), float(a[2, 2])
    c00 = a11 * a22 - a12 * a12
    c01 = a02 * a12 - a01 * a22
    c02 = a01 * a12 - a02 * a11
    c11 = a00 * a22 - a02 * a02
    c12 = a01 * a02 - a00 * a12
    c22 = a00 * a11 - a01 * a01
    det = a00 * c00 + a01 * c01 + a02 * c02
    b0, b1, b2 = float(b[0]), float(b[1]), float(b[2])
    inv = 1.0 / det
    out[0] = (c00 * b0 + c01 * b1 + c02 * b2) * inv
    out[1] = (c01 * b0 + c11 * b1 + c12 * b2) * inv
    out[2] = (c02 * b0 + c12 * b1 + c22 * b2) * inv


class CartesianController:
    """Damped-least-squares differential IK with a top-down secondary task (module docstring).

    set_target(position (3,) m, max_speed m/s) any time; step(q_measured [n], out [n]) once per
    tick writes the joint position command into `out` (rad) and returns True, or False when
    there is no target yet (out untouched: the caller holds)."""

    def __init__(self, kinematics: ArmKinematics, config: CartesianConfig | None = None) -> None:
        self.config = config or CartesianConfig()
        self.config.validate()
        cfg = self.config
        self.kin = kinematics
        n = kinematics.n
        self.n = n
        self.dt = 1.0 / cfg.rate_hz
        lower, upper = kinematics.lower.copy(), kinematics.upper.copy()
        for name, values, pick in (("ik_lower", cfg.ik_lower, np.maximum),
                                   ("ik_upper", cfg.ik_upper, np.minimum)):
            if values:
                if len(values) != n:
                    raise ValueError(f"parameter 'cartesian.{name}' = {list(values)}: needs "
                                     f"one value per joint ({n}) or none")
                pick(lower if name == "ik_lower" else upper, values,
                     out=lower if name == "ik_lower" else upper)
        self.lower = lower + cfg.limit_margin  # [n] rad
        self.upper = upper - cfg.limit_margin
        if np.any(self.lower >= self.upper):
            raise ValueError(f"parameter 'cartesian.ik_lower' = {list(cfg.ik_lower)}: "
                             "leaves no range inside the URDF limits and the margin")
        self.vmax = kinematics.velocity_limit * cfg.velocity_scale  # [n] rad/s
        self.q_ref = np.zeros(n)
        self.target = np.zeros(3)
        self.carrot = np.zeros(3)
        self.speed = cfg.default_speed
        self.has_target = False
        self._synced = False
        self._new_target = False
        # work arrays (every tick writes into these)
        self._v = np.zeros(3)
        self._w = np.zeros(3)
        self._step = np.zeros(3)
        self._a3 = np.zeros((3, 3))
        self._x3 = np.zeros(3)
        self._jpt = np.zeros((n, 3))
        self._pinv_t = np.zeros((3, n))  # (J_p^+)^T, rows contiguous
        self._null = np.zeros((n, n))
        self._jwn = np.zeros((3, n))
        self._dq1 = np.zeros(n)
        self._dq2 = np.zeros(n)
        self._dq = np.zeros(n)
        self._abs = np.zeros(n)
        self._mask = np.ones(n)  # 1 = joint free, 0 = frozen at a position limit this tick
        self._jpm = np.zeros((3, n))  # masked Jacobian rows: position
        self._jwm = np.zeros((3, n))  # angular velocity
        self._qn = np.zeros(n)
        self._over = np.zeros(n, dtype=bool)
        self._under = np.zeros(n, dtype=bool)
        self._eye3 = np.eye(3)
        self._eye_n = np.eye(n)
        self._down = np.array([0.0, 0.0, -1.0])
        self._d2 = cfg.damping * cfg.damping
        # views made once: the kinematics' result buffers are the same arrays every call
        jac, rot = kinematics._jac, kinematics._rot
        self._jp, self._jw, self._z = jac[:3], jac[3:], rot[:, 2]
        self._jwn_t = self._jwn.T
        self._pinv = self._pinv_t.T  # (n, 3) view
        self._pinv_rows = [self._pinv_t[k] for k in range(3)]
        self._unit = [self._eye3[k] for k in range(3)]
        self.resyncs = 0  # reference re-synchronised to the measurement (counted)

    # ---- commands --------------------------------------------------------------------------
    def set_target(self, position: np.ndarray, max_speed: float = 0.0) -> bool:
        """New tcp target (world frame, m) approached at max_speed m/s (<= 0: default).
        A non-finite position is refused (False): the target is cleared, the caller holds."""
        cfg = self.config
        np.copyto(self.target, position)
        if not math.isfinite(float(self.target.sum())):
            self.clear()
            return False
        speed = float(max_speed)
        self.speed = min(speed, cfg.max_speed) if speed > 0.0 and math.isfinite(speed) \
            else cfg.default_speed
        self.has_target = True
        self._new_target = True  # the carrot restarts from the tcp at the next step
        return True

    def clear(self) -> None:
        """Forget the target and the reference (activation, hold)."""
        self.has_target = False
        self._synced = False

    # ---- per tick --------------------------------------------------------------------------
    def step(self, q_measured: np.ndarray, out: np.ndarray) -> bool:
        if not self.has_target:
            self._synced = False
            return False
        cfg, dt = self.config, self.dt
        q = self.q_ref
        if not self._synced or np.max(np.abs(np.subtract(q, q_measured, out=self._abs))) \
                > cfg.resync_rad:
            if self._synced:
                self.resyncs += 1
            np.copyto(q, q_measured)
            np.clip(q, self.lower, self.upper, out=q)
            self._synced = True
            self._new_target = True
        pos, _, _ = self.kin.forward_and_jacobian(q)  # fills the views _jp, _jw, _z
        if self._new_target:
            np.copyto(self.carrot, pos)
            self._new_target = False
        # carrot toward the target at speed
        step = np.subtract(self.target, self.carrot, out=self._step)
        dist = math.sqrt(float(step.dot(step)))
        max_step = self.speed * dt
        if dist > max_step:
            step *= max_step / dist
        self.carrot += step
        # v = carrot velocity + gain * (carrot - tcp), capped at the speed
        v = np.subtract(self.carrot, pos, out=self._v)
        v *= cfg.position_gain
        step *= 1.0 / dt  # the carrot's velocity, m/s
        v += step
        norm = math.sqrt(float(v.dot(v)))
        if norm > self.speed:
            v *= self.speed / norm
        # joints that would cross a position limit are frozen (their Jacobian columns zeroed)
        # and the tasks solved again with the others (at most n rounds)
        mask, dq = self._mask, self._dq
        mask.fill(1.0)
        for _ in range(self.n):
            np.multiply(self._jp, mask, out=self._jpm)
            np.multiply(self._jw, mask, out=self._jwm)
            self._solve_tasks(v, dq)
            # joint velocity limits: scale uniformly
            np.abs(dq, out=self._abs)
            self._abs /= self.vmax
            ratio = float(self._abs.max())
            if ratio > 1.0:
                dq *= 1.0 / ratio
            dq *= dt  # rad this tick
            np.add(q, dq, out=self._qn)
            np.greater(self._qn, self.upper, out=self._over)
            np.less(self._qn, self.lower, out=self._under)
            np.logical_or(self._over, self._under, out=self._over)
            if not self._over.any():
                break
            np.copyto(mask, 0.0, where=self._over)
        q += dq
        np.clip(q, self.lower, self.upper, out=q)
        np.copyto(out, q)
        return True

    def _solve_tasks(self, v: np.ndarray, dq: np.ndarray) -> None:
        """dq (rad/s) <- position DLS for v, plus the orientation task in its null space, with
        the masked Jacobians _jpm, _jwm."""
        cfg = self.config
        np.copyto(self._jpt, self._jpm.T)
        a = np.dot(self._jpm, self._jpt, out=self._a3)
        _add_diag3(a, self._d2)
        _solve3_into(a, v, self._x3)
        dq1 = np.dot(self._jpt, self._x3, out=self._dq1)
        np.copyto(dq, dq1)
        if cfg.top_down and cfg.orientation_gain > 0.0:
            self._orientation(a, dq1, dq)

    def _orientation(self, a: np.ndarray, dq1: np.ndarray, dq: np.ndarray) -> None:
        """dq += secondary top-down task in the null space of the position task.
        a: the position task's damped J_p J_p^T (3, 3); its damping is swapped for
        NULL_DAMPING here (a is not used after this)."""
        cfg = self.config
        jp, jw = self._jpm, self._jwm
        # The projector N = I - J_p^+ J_p from a nearly undamped J_p^+: with the task's
        # damping, N leaks d^2 / (s^2 + d^2) of the secondary motion along each singular
        # direction s of J_p into the position, and the orientation task's own damped solve
        # can make that motion large enough to cancel the position task (a stretched arm at
        # its elbow limit then stops short of a target it can reach).
        _add_diag3(a, NULL_DAMPING * NULL_DAMPING - self._d2)
        # J_p^+ (n, 3) = J_p^T a^-1, column by column (a is symmetric)
        for k in range(3):
            _solve3_into(a, self._unit[k], self._x3)
            np.dot(self._jpt, self._x3, out=self._pinv_rows[k])
        null = np.dot(self._pinv, jp, out=self._null)  # J_p^+ J_p
        np.subtract(self._eye_n, null, out=null)  # N = I - J_p^+ J_p
        # w = gain * (z_tool x down) - J_w dq1
        z = self._z
        w = self._w
        d = self._down
        w[0] = z[1] * d[2] - z[2] * d[1]
        w[1] = z[2] * d[0] - z[0] * d[2]
        w[2] = z[0] * d[1] - z[1] * d[0]
        if float(z.dot(d)) < 0.0:  # more than 90 deg off: the cross product shrinks; push
            norm = math.sqrt(float(w.dot(w)))
            if norm > 1e-9:
                w *= 1.0 / norm
        w *= cfg.orientation_gain
        w -= np.dot(jw, dq1, out=self._x3)
        jwn = np.dot(jw, null, out=self._jwn)  # (3, n)
        np.dot(jwn, self._jwn_t, out=self._a3)
        _add_diag3(self._a3, self._d2)
        _solve3_into(self._a3, w, self._x3)
        dq2 = np.dot(self._jwn_t, self._x3, out=self._dq2)
        dq += dq2

    # ---- introspection ---------------------------------------------------------------------
    def tcp_error(self, q: np.ndarray) -> float:
        """m, distance from the tcp at q to the target (allocates: not for the loop)."""
        pos, _ = self.kin.forward(q)
        return float(np.linalg.norm(pos - self.target))
