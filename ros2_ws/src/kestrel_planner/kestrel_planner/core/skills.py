"""The fixed skill enumeration (kestrel_interfaces/msg/TaskStep.msg) and each skill's schema.

A skill's schema says whether it needs a target object and which numeric arguments it takes,
each with its SI unit, its default, and hard bounds that hold on any robot (e.g. a speed is
> 0). The robot's own limits (max speed, height range, workspace) are PlanLimits in the
validator; the plan grammar only enforces the argument *format*, never the value.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import IntEnum

__all__ = [
    "Skill", "ArgSpec", "SkillSpec", "SKILLS", "skill_by_name", "NAME_RE", "PUSH_BACKOFF_M",
    "PUSH_CONTACT_M", "skill_points",
]

# m: PUSH comes down this far behind the object's position (-x of the position frame): the
# closed fingers' front face (1.6 cm ahead of the tool centre) clears the corner of a 5 cm
# cube turned 45 degrees (3.5 cm from its centre).
PUSH_BACKOFF_M = 0.07
# m: the tool centre's distance behind the object's position when the closed fingers touch
# it (1.6 cm + half a 5 cm object): the push ends `distance` past that, so that the object
# moves about `distance`.
PUSH_CONTACT_M = 0.04

# Object and skill names in the plan text: lower-case identifiers.
NAME_RE = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


class Skill(IntEnum):
    """Values equal the TaskStep.SKILL_* constants."""

    MOVE_TO = 0
    PICK = 1
    PLACE = 2
    PUSH = 3
    OPEN_GRIPPER = 4
    CLOSE_GRIPPER = 5
    HOME = 6

    @property
    def text(self) -> str:
        """Name in plans and TaskStep.skill_name: 'move_to', 'pick', ..."""
        return self.name.lower()


@dataclass(frozen=True)
class ArgSpec:
    """A numeric argument: name, SI unit, default value, hard bounds [lo, hi] (inclusive;
    `lo_open` makes the lower bound exclusive)."""

    name: str
    unit: str
    default: float
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    doc: str = ""

    def in_hard_bounds(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.lo if self.lo_open else value >= self.lo
        return above and value <= self.hi


@dataclass(frozen=True)
class SkillSpec:
    skill: Skill
    needs_target: bool
    args: tuple[ArgSpec, ...]
    doc: str

    @property
    def name(self) -> str:
        return self.skill.text

    def arg(self, name: str) -> ArgSpec | None:
        for a in self.args:
            if a.name == name:
                return a
        return None

    @property
    def arg_names(self) -> tuple[str, ...]:
        return tuple(a.name for a in self.args)


_SPEED = ArgSpec("speed", "m/s", 0.10, lo=0.0, lo_open=True,
                 doc="Cartesian end-effector speed limit while executing the step")
_HEIGHT = ArgSpec("height", "m", 0.05,
                  doc="end-effector clearance above the target object's position")
_DISTANCE = ArgSpec("distance", "m", 0.05, lo=0.0,
                    doc="how far the object is pushed along +x of the position frame")
# the fingertips reach 2 cm below the tool centre: 1 cm over the object's centre keeps them
# off the table and pushes the object low
_PUSH_HEIGHT = ArgSpec("height", "m", 0.01,
                       doc="tool-centre height above the target object's position while pushing")

SKILLS: dict[Skill, SkillSpec] = {
    Skill.MOVE_TO: SkillSpec(Skill.MOVE_TO, True, (_SPEED, _HEIGHT),
                             "move the end effector above the target"),
    Skill.PICK: SkillSpec(Skill.PICK, True, (_SPEED, _HEIGHT),
                          "approach above the target at `height`, descend, close the gripper"),
    Skill.PLACE: SkillSpec(Skill.PLACE, True, (_SPEED, _HEIGHT),
                           "move the held object above the target at `height`, open the gripper"),
    Skill.PUSH: SkillSpec(Skill.PUSH, True, (_SPEED, _PUSH_HEIGHT, _DISTANCE),
                          "push the target along +x by `distance` with the closed gripper at "
                          "`height`"),
    Skill.OPEN_GRIPPER: SkillSpec(Skill.OPEN_GRIPPER, False, (), "open the gripper"),
    Skill.CLOSE_GRIPPER: SkillSpec(Skill.CLOSE_GRIPPER, False, (), "close the gripper"),
    Skill.HOME: SkillSpec(Skill.HOME, False, (), "move to the home joint configuration"),
}

_BY_NAME = {s.text: SKILLS[s] for s in Skill}


def skill_by_name(name: str) -> SkillSpec | None:
    """'pick' -> the PICK spec; None for unknown names."""
    return _BY_NAME.get(name)


def skill_points(skill: Skill, position: tuple[float, float, float], height: float,
                 distance: float = 0.0) -> list[tuple[float, float, float]]:
    """Cartesian end-effector waypoints (m) of a skill applied to an object at `position` (m):
    the geometry shared by the validator (workspace check) and the executor (targets)."""
    x, y, z = (float(v) for v in position)
    above = (x, y, z + height)
    if skill == Skill.MOVE_TO or skill == Skill.PLACE:
        return [above]
    if skill == Skill.PICK:
        return [above, (x, y, z)]
    if skill == Skill.PUSH:
        return [(x - PUSH_BACKOFF_M, y, z + height),
                (x - PUSH_CONTACT_M + distance, y, z + height)]
    return []
