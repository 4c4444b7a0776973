"""Plan validation against the robot's limits and the current scene: the safety gate.

Nothing the model decodes reaches control unless `PlanValidator.validate` accepts it. Every
problem is reported (not only the first), with the step number and the offending value.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kestrel_planner.core.plan import REFUSALS, Plan, PlanStep, SceneObject
from kestrel_planner.core.skills import SKILLS, Skill, skill_points

__all__ = ["PlanLimits", "ValidationReport", "PlanValidator"]

Vec3 = tuple[float, float, float]


def _bad(name: str, value: object, rule: str) -> ValueError:
    return ValueError(f"parameter '{name}' = {value!r}: {rule}")


@dataclass(frozen=True)
class PlanLimits:
    """max_speed m/s; min_height/max_height m (end-effector clearance above the target);
    workspace_min/max m (axis-aligned box in the perception frame); max_steps per plan."""

    max_speed: float = 0.5
    min_height: float = 0.0
    max_height: float = 0.4
    workspace_min: Vec3 = (-1.0, -1.0, -0.05)
    workspace_max: Vec3 = (1.0, 1.0, 1.0)
    max_steps: int = 8

    def __post_init__(self) -> None:
        if not (math.isfinite(self.max_speed) and self.max_speed > 0):
            raise _bad("max_speed", self.max_speed, "must be finite and > 0")
        for n in ("min_height", "max_height"):
            if not math.isfinite(getattr(self, n)):
                raise _bad(n, getattr(self, n), "must be finite")
        if self.min_height > self.max_height:
            raise _bad("min_height", self.min_height, f"must be <= max_height ({self.max_height})")
        for n in ("workspace_min", "workspace_max"):
            v = tuple(getattr(self, n))
            if len(v) != 3 or not all(math.isfinite(float(c)) for c in v):
                raise _bad(n, v, "must be 3 finite numbers (x, y, z), m")
            object.__setattr__(self, n, tuple(float(c) for c in v))
        if any(lo >= hi for lo, hi in zip(self.workspace_min, self.workspace_max, strict=True)):
            raise _bad("workspace_min", self.workspace_min,
                       f"must be < workspace_max ({self.workspace_max}) on every axis")
        if not (isinstance(self.max_steps, int) and self.max_steps >= 1):
            raise _bad("max_steps", self.max_steps, "must be an integer >= 1")

    def in_workspace(self, p: Vec3) -> bool:
        return all(lo <= c <= hi for c, lo, hi in
                   zip(p, self.workspace_min, self.workspace_max, strict=True))


@dataclass
class ValidationReport:
    accepted: bool
    reasons: list[str] = field(default_factory=list)


def _fmt(p: Sequence[float]) -> str:
    return "(" + ", ".join(f"{c:.3f}" for c in p) + ")"


class PlanValidator:
    def __init__(self, limits: PlanLimits) -> None:
        self.limits = limits

    def validate(self, plan: Plan, objects: Sequence[SceneObject],
                 max_steps: int | None = None) -> ValidationReport:
        """Check every step against the enumeration, the scene and the limits.
        max_steps: the request's bound (capped by limits.max_steps); None = the limit."""
        lim = self.limits
        cap = lim.max_steps if not max_steps else min(max_steps, lim.max_steps)
        reasons: list[str] = []
        if plan.refusal:
            what = REFUSALS.get(plan.refusal, f"reason {plan.refusal!r}")
            names = ", ".join(sorted(o.name for o in objects)) or "none"
            return ValidationReport(False, [f"the planner refused the task: {what} "
                                            f"(objects: {names})"])
        if not plan.steps:
            reasons.append("plan has no steps")
        if len(plan.steps) > cap:
            reasons.append(f"plan has {len(plan.steps)} steps, more than max_steps {cap}")
        scene = {o.name: o for o in objects}
        holding: str | None = None
        for i, step in enumerate(plan.steps, start=1):
            holding = self._check_step(i, step, scene, holding, reasons)
        return ValidationReport(not reasons, reasons)

    def _check_step(self, i: int, step: PlanStep, scene: dict[str, SceneObject],
                    holding: str | None, reasons: list[str]) -> str | None:
        try:
            skill = Skill(int(step.skill))
        except (ValueError, TypeError):
            reasons.append(f"step {i}: unknown skill {step.skill!r}")
            return holding
        spec = SKILLS[skill]
        where = f"step {i} ({spec.name})"
        bad_args = self._check_args(where, step, reasons)
        target = step.target_object
        pos = None
        if spec.needs_target and not target:
            reasons.append(f"{where}: needs a target object")
        elif not spec.needs_target and target:
            reasons.append(f"{where}: takes no target, got {target!r}")
        elif target:
            obj = scene.get(target)
            if obj is None:
                names = ", ".join(sorted(scene)) or "none"
                reasons.append(f"{where}: target {target!r} is not in the scene (objects: {names})")
            elif obj.position is None:
                reasons.append(f"{where}: target {target!r} has no 3D position")
            else:
                pos = obj.position
        if pos is not None and not self.limits.in_workspace(pos):
            reasons.append(f"{where}: target {target!r} at {_fmt(pos)} m is outside the "
                           f"workspace {_fmt(self.limits.workspace_min)}.."
                           f"{_fmt(self.limits.workspace_max)}")
        elif pos is not None and not bad_args & {"height", "distance"}:  # usable geometry
            dist = step.value("distance") if skill == Skill.PUSH else 0.0
            for p in skill_points(skill, pos, step.value("height"), dist):
                if not self.limits.in_workspace(p):
                    reasons.append(f"{where}: end-effector point {_fmt(p)} m is outside the "
                                   f"workspace")
        # Gripper / holding logic.
        if skill == Skill.PICK:
            if holding is not None:
                reasons.append(f"{where}: already holding {holding!r}; place it first")
            return target or holding
        if skill == Skill.PLACE:
            if holding is None:
                reasons.append(f"{where}: PLACE needs a preceding PICK that holds an object")
            elif holding == target:
                reasons.append(f"{where}: cannot place {target!r} onto itself")
            return None
        if skill == Skill.OPEN_GRIPPER:
            return None
        return holding

    def _check_args(self, where: str, step: PlanStep, reasons: list[str]) -> set[str]:
        """Given arguments (name, unit, value) and the effective values incl. defaults; every
        problem of every argument is reported. Returns the names of the arguments whose value
        is unusable (malformed, wrong unit, outside the hard bounds)."""
        spec = SKILLS[Skill(int(step.skill))]
        lim = self.limits
        bad: set[str] = set()  # arguments whose given value is unusable
        for name, given in step.arguments.items():
            arg = spec.arg(name)
            try:
                value, unit = float(given[0]), str(given[1])
            except (TypeError, ValueError, IndexError):
                reasons.append(f"{where}: argument {name!r} is not a (value, unit) pair")
                bad.add(name)
                continue
            if arg is None:
                reasons.append(f"{where}: unknown argument {name!r}")
                bad.add(name)
                continue
            if unit != arg.unit:
                reasons.append(f"{where}: argument '{name}' has unit {unit!r}, expected "
                               f"{arg.unit!r}")
                bad.add(name)
            if not arg.in_hard_bounds(value):
                reasons.append(f"{where}: argument '{name}' = {value} {unit} is not valid")
                bad.add(name)
        for arg in spec.args:
            if arg.name in bad:
                continue
            v = step.value(arg.name)
            src = "" if arg.name in step.arguments else " (default)"
            if arg.name == "speed" and v > lim.max_speed:
                reasons.append(f"{where}: speed {v} m/s{src} exceeds max_speed "
                               f"{lim.max_speed} m/s")
            if arg.name == "height" and not lim.min_height <= v <= lim.max_height:
                reasons.append(f"{where}: height {v} m{src} outside [{lim.min_height}, "
                               f"{lim.max_height}] m")
        return bad
