"""What the policy sees and what its actions mean: the observation layout and the action mapping.

Kestrel's reference policy (the defaults):
  obs row [obs_dim] float32 = [joint_pos n | joint_vel n | target n | last_action A | 0 ...]
  command [n] rad = q + action_scale * tanh(a[:n])                 ('position_delta_tanh')
(`action_scales` [n] replaces the one scale by one per joint, as Isaac Lab's scale dict.)

A policy trained in Isaac Lab (manager-based env, exported by rsl_rl) expects other terms and
maps its actions affinely, so both are parameters:
  obs terms   joint_pos_rel = q - default_q (mdp.joint_pos_rel), joint_vel (mdp.joint_vel_rel
              with the default joint velocity 0), last_action = the previous raw action
              (mdp.last_action), each with an optional scale (ObsTerm(scale=...)).
  actions     JointPositionAction(use_default_offset=True): default_q + scale * a
              ('position_offset'); RelativeJointPositionAction: q + scale * a ('position_delta');
              rsl_rl's clip_actions clamps the raw action to [-c, c] first (`action_clip`; the
              clamped action is also what last_action sees). Isaac Lab's own `clip` bounds the
              processed target; here that is the clamp to the joint limits (SafetyFilter).

obs_layout: the terms in order, each "name", "name*scale" or "zeros:K":
  joint_pos [n] rad, joint_pos_rel [n] rad (q - default_q), joint_vel [n] rad/s,
  target [n] rad, target_rel [n] rad (target - default_q), last_action [A],
  ee_target_rel [3] m: the Cartesian end-effector target minus the end effector's position
  (forward kinematics of q), base frame: what Isaac Lab reach tasks observe as the position
  error of the commanded pose,
  ee_target [3] m: the Cartesian end-effector target itself, base frame,
  zeros:K: K columns left at zero (a term this robot does not send, e.g. a base velocity).
q is the latency-compensated position wherever it appears (obs, the forward kinematics and the
'position_delta*' commands). Columns after the last term stay zero; a layout given for a user's
model file must cover its obs_dim exactly. The ee_* terms need the arm's kinematics (an object
with `forward(q) -> (position [3] m, rotation [3, 3])`, kestrel_control.core.kinematics) and a
Cartesian target; without a target the end effector's own position is used (the policy is asked
to hold).

The same arithmetic runs in C (native_tick.c, the loop process's tick): (x - offset) * scale in
float64, then float32, so both ticks give the same rows (test_native_tick.py). The ee_* terms
run in Python only (the forward kinematics is Pinocchio's): the C tick refuses them at configure.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# term sources: rows of a robot's `inputs` [3, n] (pos, vel, target), the previous action, zeros,
# the Cartesian target minus the end effector, the Cartesian target
SRC_POS, SRC_VEL, SRC_TARGET, SRC_ACTION, SRC_ZEROS, SRC_EE_REL, SRC_EE_TARGET = range(7)
EE_SOURCES = (SRC_EE_REL, SRC_EE_TARGET)
TERMS = {"joint_pos": (SRC_POS, False), "joint_pos_rel": (SRC_POS, True),
         "joint_vel": (SRC_VEL, False), "target": (SRC_TARGET, False),
         "target_rel": (SRC_TARGET, True), "last_action": (SRC_ACTION, False),
         "ee_target_rel": (SRC_EE_REL, False), "ee_target": (SRC_EE_TARGET, False)}
DEFAULT_LAYOUT = ("joint_pos", "joint_vel", "target", "last_action")
ACTION_MODES = ("position_delta_tanh", "position_delta", "position_offset")
MODE_DELTA_TANH, MODE_DELTA, MODE_OFFSET = range(3)


@dataclass(frozen=True)
class ObsTerm:
    """One observation term: obs[col : col + length] = (source - offset) * scale."""

    name: str
    source: int  # SRC_*
    col: int
    length: int
    relative: bool  # minus default_q
    scale: float


@dataclass
class PolicyIO:
    """A validated layout + action mapping for n joints and A actions (build_io)."""

    terms: tuple[ObsTerm, ...]
    width: int  # columns the terms cover
    mode: int  # MODE_*
    scales: np.ndarray  # [n] float64, rad per unit of (tanh) action, per joint
    per_joint_scale: bool  # `action_scales` given (not one scale for all)
    action_clip: float  # raw actions clamped to [-c, c] before use; inf = off
    default_q: np.ndarray  # [n] float64 rad
    explicit: bool  # the layout was given (not the default)

    @property
    def last_action_col(self) -> int:
        """Column of the last_action term, -1 when the layout has none."""
        return next((t.col for t in self.terms if t.source == SRC_ACTION), -1)

    @property
    def uses_ee(self) -> bool:
        """The layout has an ee_* term (needs kinematics and a Cartesian target)."""
        return any(t.source in EE_SOURCES for t in self.terms)

    @property
    def is_reference(self) -> bool:
        """The reference mapping: what the in-graph post-processing backends compute (they read
        q from obs[:, :n] and apply tanh), so only then may they do it."""
        return (tuple(t.name for t in self.terms) == DEFAULT_LAYOUT
                and all(t.scale == 1.0 for t in self.terms)
                and self.mode == MODE_DELTA_TANH and math.isinf(self.action_clip)
                and not self.per_joint_scale)


def _err(param: str, value: object, reason: str) -> ValueError:
    return ValueError(f"parameter '{param}' = {value!r}: {reason}")


def _parse_term(text: str, n: int, num_actions: int) -> tuple[str, int, int, bool, float]:
    """'name' | 'name*scale' | 'zeros:K' -> (name, source, length, relative, scale)."""
    layout = "obs_layout"
    if text.startswith("zeros:"):
        k = text[len("zeros:"):]
        if not (k.isascii() and k.isdigit() and int(k) >= 1):
            raise _err(layout, text, "zeros:K needs a whole number K >= 1 of zero columns")
        return "zeros", SRC_ZEROS, int(k), False, 1.0
    name, star, scale_text = text.partition("*")
    if name not in TERMS:
        raise _err(layout, text, f"unknown term {name!r}; terms: {sorted(TERMS)}, "
                   "'name*scale' or 'zeros:K'")
    scale = 1.0
    if star and not scale_text:
        raise _err(layout, text, "'name*' needs a scale after the '*'")
    if scale_text:
        try:
            scale = float(scale_text)
        except ValueError:
            raise _err(layout, text, f"scale {scale_text!r} is not a number") from None
        if not (math.isfinite(scale) and scale != 0.0):
            raise _err(layout, text, "the scale must be finite and non-zero")
    source, relative = TERMS[name]
    if source == SRC_ACTION and scale != 1.0:
        raise _err(layout, text, "last_action takes no scale (it is the raw action)")
    length = num_actions if source == SRC_ACTION else 3 if source in EE_SOURCES else n
    return name, source, length, relative, scale


def build_io(num_joints: int, num_actions: int, obs_layout: Sequence[str] = (),
             action_mode: str = ACTION_MODES[0], action_scale: float = 0.05,
             action_clip: float = math.inf,
             default_joint_positions: Sequence[float] = (),
             action_scales: Sequence[float] = ()) -> PolicyIO:
    """Validate the parameters (errors name the parameter and its value) into a PolicyIO."""
    n = num_joints
    if action_mode not in ACTION_MODES:
        raise _err("action_mode", action_mode, f"must be one of {ACTION_MODES}")
    clip = float(action_clip)
    if not (clip > 0.0):  # NaN fails too
        raise _err("action_clip", action_clip, "must be > 0 (inf or 0 in the node: off)")
    default_q = np.zeros(n) if len(default_joint_positions) == 0 else np.asarray(
        default_joint_positions, dtype=np.float64)
    if default_q.shape != (n,) or not np.isfinite(default_q).all():
        raise _err("default_joint_positions", list(default_joint_positions),
                   f"needs {n} finite values (one per joint, rad), or none for zeros")
    per_joint = len(action_scales) > 0
    scales = np.asarray(action_scales, dtype=np.float64) if per_joint else np.full(
        n, float(action_scale))
    if scales.shape != (n,) or not (np.isfinite(scales).all() and (scales > 0).all()):
        raise _err("action_scales", list(action_scales),
                   f"needs {n} finite values > 0 (one per joint), or none for action_scale")
    explicit = len(obs_layout) > 0
    terms, col = [], 0
    for text in (obs_layout if explicit else DEFAULT_LAYOUT):
        name, source, length, relative, scale = _parse_term(str(text), n, num_actions)
        if source != SRC_ZEROS and any(t.name == name for t in terms):
            raise _err("obs_layout", list(obs_layout), f"term {name!r} appears twice")
        if source == SRC_ACTION and any(t.source == SRC_ACTION for t in terms):
            raise _err("obs_layout", list(obs_layout), "last_action appears twice")
        terms.append(ObsTerm(name, source, col, length, relative, scale))
        col += length
    return PolicyIO(tuple(terms), col, ACTION_MODES.index(action_mode), scales, per_joint,
                    clip, default_q, explicit)


def check_obs_dim(io: PolicyIO, num_joints: int, obs_dim: int, num_actions: int, source: str,
                  user_model: bool = False) -> None:
    """The policy's sizes against the robot and the layout (ValueError naming the parameter):
    one action per joint at least (a user's model file: exactly, its outputs are taken as the
    joints' actions in joint_names order); the layout within obs_dim (a layout given for a
    model file: exactly obs_dim, so that a term left out is an error, not zeros)."""
    n = num_joints
    if user_model and num_actions != n:  # the file's size, not a parameter the user set
        raise ValueError(
            f"parameter 'model_path': the policy ({source}) outputs {num_actions} actions "
            f"and the robot has {n} joints (joint_names); a model file needs exactly one "
            "action per joint, in joint_names order")
    if n > num_actions:
        raise ValueError(
            f"parameter 'num_actions' = {num_actions}: the policy ({source}) outputs "
            f"{num_actions} actions and the robot has {n} joints (joint_names); it needs one "
            "action per joint")
    names = " + ".join(f"{t.name} {t.length}" for t in io.terms)
    if io.width > obs_dim:
        raise ValueError(
            f"parameter 'obs_dim' = {obs_dim}: the observation layout needs {names} = "
            f"{io.width} values ({source})")
    if user_model and io.explicit and io.width != obs_dim:
        raise ValueError(
            f"parameter 'obs_layout': {names} = {io.width} values, and the policy ({source}) "
            f"takes {obs_dim}; add the missing terms (zeros:K for ones this robot lacks)")


class RowIO:
    """One robot's observation row and proposed command, on preallocated arrays.

    inputs [3, n] float64: positions rad (compensated), velocities rad/s, target rad;
    obs_row [obs_dim] float32 and act_row [A] float32: views into the backend's buffers;
    kinematics: `forward(q) -> (position [3] m, rotation)`, needed by the ee_* terms.
    ee_target [3] float64 m (base frame): the Cartesian target of the ee_* terms, written by
    the owner; while `ee_target_set` is False, write_obs sets it to the end effector's
    position (hold where it is) and sets the flag."""

    def __init__(self, io: PolicyIO, inputs: np.ndarray, obs_row: np.ndarray,
                 act_row: np.ndarray, kinematics: Any = None) -> None:
        self.io = io
        n = inputs.shape[1]
        self.n = n
        if io.uses_ee and not callable(getattr(kinematics, "forward", None)):
            raise ValueError(
                f"parameter 'obs_layout' = {[t.name for t in io.terms]}: the ee_* terms need "
                "the arm's forward kinematics (the robot description), and none was given")
        self._kin = kinematics
        self.ee_target = np.zeros(3)
        self.ee_target_set = False
        self._ee_tmp = np.zeros(3)
        # (source, obs columns [3], scale) of the ee_* terms
        self._ee = [(t.source, obs_row[t.col:t.col + 3], t.scale)
                    for t in io.terms if t.source in EE_SOURCES]
        self.act_n = act_row[:n]
        self._a64 = np.zeros(act_row.shape[0])  # clipped raw action, float64
        self._a64_n = self._a64[:n]
        self._lo, self._hi = -io.action_clip, io.action_clip
        self._scale = io.scales  # [n]
        self._tmp = np.zeros(n)
        self._zeros = np.zeros(n)
        self._act_row = act_row
        # the reference layout: one copy of [pos | vel | target] (the C tick writes the same)
        self._block = obs_row[:3 * n].reshape(3, n) if io.is_reference else None
        self._inputs = inputs
        # (source [n], obs columns [n], offset [n] or None, scale): a plain term is one copy
        # (the C tick's (x - 0) * 1 is the same value)
        self._copies = [(inputs[t.source], obs_row[t.col:t.col + n],
                         io.default_q if t.relative else None, t.scale)
                        for t in io.terms if t.source in (SRC_POS, SRC_VEL, SRC_TARGET)]
        col = io.last_action_col
        self.prev_act = obs_row[col:col + act_row.shape[0]] if col >= 0 else None
        self._clip = not math.isinf(io.action_clip)

    def write_obs(self) -> None:
        """The obs row's input terms from `inputs` (the previous action is written by
        store_prev; zeros terms are never written)."""
        if self._block is not None:
            np.copyto(self._block, self._inputs)  # float64 -> float32
            return
        tmp = self._tmp
        for src, dst, off, scale in self._copies:
            if off is None and scale == 1.0:
                np.copyto(dst, src)  # float64 -> float32
                continue
            np.subtract(src, self._zeros if off is None else off, out=tmp)
            np.multiply(tmp, scale, out=tmp)
            np.copyto(dst, tmp)
        if self._ee:
            self._write_ee()

    def _write_ee(self) -> None:
        """ee_* terms: forward kinematics of the (compensated) positions, in float64."""
        pos = self._kin.forward(self._inputs[SRC_POS])[0]  # [3] m, the kinematics' own array
        if not self.ee_target_set:  # no Cartesian target yet: hold where the arm is
            np.copyto(self.ee_target, pos)
            self.ee_target_set = True
        tmp = self._ee_tmp
        for src, dst, scale in self._ee:
            if src == SRC_EE_REL:
                np.subtract(self.ee_target, pos, out=tmp)
            else:
                np.copyto(tmp, self.ee_target)
            if scale != 1.0:
                np.multiply(tmp, scale, out=tmp)
            np.copyto(dst, tmp)

    def propose(self, pos: np.ndarray, out: np.ndarray) -> None:
        """out [n] rad = the command the actions ask for (not clamped; NaN in, NaN out)."""
        io, scale = self.io, self._scale
        a = self.act_n
        if self._clip:
            np.copyto(self._a64, self._act_row)
            # maximum then minimum, as np.clip and the C tick (without np.clip's Python wrapper)
            np.maximum(self._a64, self._lo, out=self._a64)
            np.minimum(self._a64, self._hi, out=self._a64)
            a = self._a64_n
        if io.mode == MODE_DELTA_TANH:
            # tanh in float64 (the C tick's too: glibc's and numpy's float32 tanh differ)
            np.tanh(a, out=out, dtype=np.float64)
            out *= scale
        else:
            np.multiply(a, scale, out=out, dtype=np.float64)
        out += io.default_q if io.mode == MODE_OFFSET else pos

    def store_prev(self) -> None:
        """The accepted action becomes the next observation's last_action (clipped, raw)."""
        if self.prev_act is not None:
            np.copyto(self.prev_act, self._a64 if self._clip else self._act_row)

    def clear_prev(self) -> None:
        if self.prev_act is not None:
            self.prev_act.fill(0.0)
