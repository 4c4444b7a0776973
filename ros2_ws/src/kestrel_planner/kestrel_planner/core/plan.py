"""Plan data types and the plan text form (the decoder's output language).

Text form, one step per line, single spaces, then a final `end` line:

    pick red_cube speed=0.1 height=0.05
    place bin
    end

plan    := line{1,max_steps} "end" | refusal "end"
line    := skill [" " target] (" " arg "=" number)* "\\n"
skill   := move_to | pick | place | push | open_gripper | close_gripper | home
number  := "-"? digit{1,3} ("." digit{1,3})?      (format only; values are checked later)
refusal := "refuse " reason "\\n"                   (reason: a key of REFUSALS)

A plan has at least one step. A refusal is the planner's answer to a task it cannot do with
the scene and the skills (e.g. "refuse absent_object"); it is a whole plan of its own, and the
validator always rejects it with the reason's text. Arguments are given without units; each
gets its unit from the skill schema (skills.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from kestrel_planner.core.skills import NAME_RE, SKILLS, Skill, skill_by_name

__all__ = [
    "SceneObject", "PlanStep", "Plan", "PlanParseError", "parse_plan", "format_plan",
    "format_number", "NUMBER_RE", "MAX_INT_DIGITS", "MAX_FRAC_DIGITS", "END", "REFUSE",
    "REFUSALS",
]

MAX_INT_DIGITS = 3
MAX_FRAC_DIGITS = 3
NUMBER_RE = re.compile(rf"^-?[0-9]{{1,{MAX_INT_DIGITS}}}(\.[0-9]{{1,{MAX_FRAC_DIGITS}}})?$")
END = "end"
REFUSE = "refuse"
# Refusal reasons (plan text) -> what the validator reports.
REFUSALS: dict[str, str] = {
    "absent_object": "the task names an object that is not in the scene",
    "unsupported_action": "the task asks for an action that the robot's skills cannot do",
}


class PlanParseError(ValueError):
    """The text is not a plan; `reason` says why (with the line number)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SceneObject:
    """An object of the current scene. position: (x, y, z) in m in the perception frame, or
    None when no 3D position is known."""

    name: str
    class_name: str
    position: tuple[float, float, float] | None = None


@dataclass
class PlanStep:
    """skill: the enumeration; target_object: scene object name ('' for none);
    arguments: name -> (value, unit) as given (defaults are not filled in)."""

    skill: Skill | int
    target_object: str = ""
    arguments: dict[str, tuple[float, str]] = field(default_factory=dict)

    @property
    def skill_name(self) -> str:
        try:
            return Skill(self.skill).text
        except ValueError:
            return f"unknown_{int(self.skill)}"

    def value(self, name: str) -> float:
        """An argument's value, or the schema default when not given (KeyError if unknown)."""
        if name in self.arguments:
            return float(self.arguments[name][0])
        spec = SKILLS[Skill(self.skill)].arg(name)
        if spec is None:
            raise KeyError(f"skill '{self.skill_name}' has no argument '{name}'")
        return spec.default


@dataclass
class Plan:
    """steps: what to do; refusal: a key of REFUSALS when the planner refused the task (then
    there are no steps)."""

    instruction: str
    steps: list[PlanStep] = field(default_factory=list)
    refusal: str = ""


def fill_defaults(plan: Plan, values: dict[str, float]) -> None:
    """Give each step every argument of `values` (name -> value, in the argument's unit) that
    its skill takes and the step does not give: the robot's defaults in place of the skill
    schema's. The filled-in arguments are then validated, executed and reported as given."""
    for step in plan.steps:
        try:
            spec = SKILLS[Skill(step.skill)]
        except (ValueError, KeyError):
            continue  # an unknown skill: the validator names it
        for name, value in values.items():
            arg = spec.arg(name)
            if arg is not None and name not in step.arguments:
                step.arguments[name] = (float(value), arg.unit)


def format_number(value: float) -> str:
    """0.1 -> '0.1', 2.0 -> '2'; ValueError outside the text format (|v| < 1000, 3 decimals)."""
    if not math.isfinite(value):
        raise ValueError(f"number {value!r} is not finite")
    text = f"{value:.{MAX_FRAC_DIGITS}f}".rstrip("0").rstrip(".")
    text = "0" if text in ("-0", "") else text
    if not NUMBER_RE.match(text):
        raise ValueError(f"number {value!r} does not fit the plan number format")
    return text


def format_plan(plan: Plan) -> str:
    """Plan -> text form (ends with 'end', no trailing newline)."""
    if plan.refusal:
        return f"{REFUSE} {plan.refusal}\n{END}"
    lines = []
    for step in plan.steps:
        parts = [Skill(step.skill).text]
        if step.target_object:
            parts.append(step.target_object)
        parts += [f"{k}={format_number(v)}" for k, (v, _unit) in step.arguments.items()]
        lines.append(" ".join(parts))
    lines.append(END)
    return "\n".join(lines)


def _clip(text: str, n: int = 60) -> str:
    """repr of a piece of model text for an error message, at most about n characters."""
    return repr(text) if len(text) <= n else repr(text[:n]) + f"... ({len(text)} characters)"


def _parse_line(n: int, line: str) -> PlanStep:
    words = line.split(" ")
    if any(w == "" for w in words):
        raise PlanParseError(f"line {n}: words must be separated by single spaces: {_clip(line)}")
    spec = skill_by_name(words[0])
    if spec is None:
        raise PlanParseError(f"line {n}: unknown skill {_clip(words[0])}")
    rest = words[1:]
    target = ""
    if spec.needs_target:
        if not rest or "=" in rest[0]:
            raise PlanParseError(f"line {n}: skill '{spec.name}' needs a target object")
        target, rest = rest[0], rest[1:]
        if not NAME_RE.match(target):
            raise PlanParseError(f"line {n}: invalid target name {_clip(target)}")
    args: dict[str, tuple[float, str]] = {}
    for w in rest:
        name, eq, num = w.partition("=")
        if not eq:
            raise PlanParseError(f"line {n}: expected name=value, got {_clip(w)}")
        arg = spec.arg(name)
        if arg is None:
            raise PlanParseError(f"line {n}: skill '{spec.name}' has no argument {_clip(name)}")
        if name in args:
            raise PlanParseError(f"line {n}: argument '{name}' given twice")
        if not NUMBER_RE.match(num):
            raise PlanParseError(f"line {n}: argument '{name}' has a malformed number {_clip(num)}")
        args[name] = (float(num), arg.unit)
    return PlanStep(spec.skill, target, args)


def parse_plan(text: str, instruction: str = "", max_steps: int | None = None) -> Plan:
    """Text form -> Plan; PlanParseError with a reason otherwise. Trailing whitespace after
    `end` is ignored; everything else must follow the grammar exactly. max_steps: a text with
    more lines than max_steps + 1 is refused before any line is parsed (bounded work on any
    text)."""
    if not isinstance(text, str):
        raise PlanParseError(f"plan text must be str, got {type(text).__name__}")
    text = text.rstrip()
    if max_steps is not None and text.count("\n") > max_steps:
        raise PlanParseError(f"plan has {text.count(chr(10)) + 1} lines, more than max_steps "
                             f"{max_steps} steps and '{END}'")
    lines = text.split("\n")
    steps: list[PlanStep] = []
    if lines[0].startswith(REFUSE + " ") or lines[0] == REFUSE:
        reason = lines[0][len(REFUSE) + 1:]
        if reason not in REFUSALS:
            raise PlanParseError(f"line 1: unknown refusal reason {_clip(reason)} (one of "
                                 f"{', '.join(REFUSALS)})")
        if lines[1:] != [END]:
            raise PlanParseError(f"a refusal is a whole plan: line 1 then '{END}'")
        return Plan(instruction, [], reason)
    for i, line in enumerate(lines, start=1):
        if line == END:
            if i != len(lines):
                raise PlanParseError(f"line {i}: text after '{END}'")
            if not steps:
                raise PlanParseError(f"line {i}: a plan needs at least one step before "
                                     f"'{END}'")
            return Plan(instruction, steps)
        steps.append(_parse_line(i, line))
    raise PlanParseError(f"missing the final '{END}' line (text ends at line {len(lines)})")
