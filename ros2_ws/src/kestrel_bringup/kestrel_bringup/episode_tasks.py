"""The closed-loop evaluation's tasks (no rclpy): what an episode asks of the robot, the
instruction that asks it, the correct plan, and when the task is done, by the ground truth.

    bin    put the goal in the bin: the simulator's EpisodeStatus says when it lies there,
           settled ("put the red cube in the bin");
    stack  stack the goal on another task object, the base: the goal rests on the base,
           released, for SETTLE_S ("stack the red cube on the blue cylinder");
    push   push the goal PUSH_DISTANCE along +x, the push skill's own distance (the
           instruction names none: "push the red cube"): after the plan ended, the goal lies
           PUSH_DISTANCE +- PUSH_TOLERANCE along +x of where it stood, at most PUSH_TOLERANCE
           sideways, upright (its centre within PUSH_TOLERANCE of its height), for SETTLE_S.

TaskJudge turns the observations of one episode into "done" and the offsets each task records.
"""

from __future__ import annotations

import math
import random

from kestrel_planner.core.skills import SKILLS, Skill

TASKS = ("bin", "stack", "push")

COLOURS = {"red_cube": ("red", "cube"), "green_cube": ("green", "cube"),
           "blue_cylinder": ("blue", "cylinder")}
TEMPLATES = {
    "bin": ("put the {c} {s} in the bin", "place the {c} {s} into the bin",
            "pick up the {c} {s} and drop it in the bin"),
    "stack": ("stack the {c} {s} on the {c2} {s2}", "put the {c} {s} on top of the {c2} {s2}",
              "place the {c} {s} onto the {c2} {s2}"),
    "push": ("push the {c} {s}", "nudge the {c} {s} forward", "shove the {c} {s}"),
}
# The templates measure the robot on phrasings the trained planner reads: two per task are its
# training templates, one per task is not among them. Its accuracy on phrasings held out of its
# training is measured apart (its weights' record).
BIN_HALF = 0.1  # m, half the bin's footprint (tabletop.xml)
# m: a stack stands when the goal's bottom is within this of the base's top, its centre over
# the base's top face (stacked)
STACK_TOLERANCE = 0.01
SETTLE_S = 0.5  # sim s a finished stack or push stands before it counts
PUSH_DISTANCE = SKILLS[Skill.PUSH].arg("distance").default  # m, along +x
PUSH_TOLERANCE = 0.01  # m, see the module's docstring
# name -> (centre (x, y, z) m, full size (x, y, z) m): the simulator's ground truth
Truth = dict[str, tuple[tuple[float, float, float], tuple[float, float, float]]]


def check_task(task: str) -> str:
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of {', '.join(TASKS)}")
    return task


def oracle_plan(task: str, goal: str, speed: float, base: str = "") -> str:
    """The correct plan for the task, in the plan text form ';'-separated: 'pick <goal>;
    place bin', 'pick <goal>; place <base>' or 'push <goal>'."""
    if check_task(task) == "push":
        return f"push {goal} speed={speed:g} distance={PUSH_DISTANCE:g}; end"
    return f"pick {goal} speed={speed:g}; place {base if task == 'stack' else 'bin'} " \
           f"speed={speed:g}; end"


def _words(name: str) -> tuple[str, str]:
    return COLOURS.get(name, (name.split("_")[0], name.split("_")[-1]))


def instruction_for(task: str, goal: str, rng: random.Random, base: str = "") -> str:
    """An instruction of the task's templates naming `goal` (and, to stack on, `base`)."""
    (c, s), (c2, s2) = _words(goal), _words(base)
    return rng.choice(TEMPLATES[check_task(task)]).format(c=c, s=s, c2=c2, s2=s2)


def over_target(truth: Truth, goal: str, target: str) -> bool | None:
    """Is the goal's centre above the target's footprint: the bin's (BIN_HALF) or another
    object's (half its size); None when either is not in `truth`."""
    if goal not in truth or target not in truth:
        return None
    (gx, gy, _), _ = truth[goal]
    (tx, ty, _), size = truth[target]
    hx, hy = (BIN_HALF, BIN_HALF) if target == "bin" else (size[0] / 2, size[1] / 2)
    return abs(gx - tx) <= hx and abs(gy - ty) <= hy


def stack_offsets(truth: Truth, goal: str, base: str,
                  base_start: tuple[float, float, float]) -> tuple[float, float, float]:
    """(the goal's centre sideways of the base's, the gap between the goal's bottom and the
    base's top, how far the base moved from `base_start`), m."""
    (g, gs), (b, bs) = truth[goal], truth[base]
    side = math.hypot(g[0] - b[0], g[1] - b[1])
    gap = (g[2] - gs[2] / 2) - (b[2] + bs[2] / 2)
    return side, gap, math.dist(b, base_start)


def stacked(truth: Truth, goal: str, base: str, tolerance: float = STACK_TOLERANCE) -> bool:
    """Does the goal rest on the base: its bottom within `tolerance` of the base's top and its
    centre over the base's top face (at most half the base's smaller width sideways of the
    base's centre: its weight is carried)? Whether it is released is the caller's to check;
    where the base stands (stack_offsets' third value) is not part of it."""
    if goal not in truth or base not in truth:
        return False
    side, gap, _ = stack_offsets(truth, goal, base, truth[base][0])
    return abs(gap) <= tolerance and side <= min(truth[base][1][:2]) / 2


def push_offsets(truth: Truth, goal: str,
                 start: tuple[float, float, float]) -> tuple[float, float, float]:
    """(how far the goal's centre moved along +x, sideways (y), up (z)) from `start`, m."""
    g = truth[goal][0]
    return g[0] - start[0], g[1] - start[1], g[2] - start[2]


def pushed(truth: Truth, goal: str, start: tuple[float, float, float],
           distance: float = PUSH_DISTANCE, tolerance: float = PUSH_TOLERANCE) -> bool:
    """Did the goal move `distance` +- tolerance along +x from `start`, at most `tolerance`
    sideways, and does it still stand (its centre's height within `tolerance`: a tipped
    cylinder's centre drops)?"""
    if goal not in truth:
        return False
    along, side, up = push_offsets(truth, goal, start)
    return abs(along - distance) <= tolerance and abs(side) <= tolerance \
        and abs(up) <= tolerance


class TaskJudge:
    """One episode's judge: observation by observation (sim s from the episode's start), is
    the task done? `start`: the ground truth when the plan was asked for (where the base and
    the goal stood)."""

    def __init__(self, task: str, goal: str, base: str = "", start: Truth | None = None) -> None:
        self.task, self.goal, self.base = check_task(task), goal, base
        self.start = {name: centre for name, (centre, _) in (start or {}).items()}
        self.offsets: list[float] = []  # stack: stack_offsets, push: push_offsets (m, rounded)
        self._since: float | None = None  # sim s since the finished state holds

    def observe(self, t: float, held: bool, sim_success: bool, truth: Truth,
                plan_ended: bool) -> bool:
        """held: the goal between both fingers; sim_success: the simulator's "in the bin and
        settled"; plan_ended: the plan's last step ended (or one failed)."""
        if self.task == "bin":
            return sim_success
        ok = False
        if self.task == "stack" and self.goal in truth and self.base in truth \
                and self.base in self.start:
            self.offsets = [round(v, 4) for v in stack_offsets(truth, self.goal, self.base,
                                                               self.start[self.base])]
            ok = not held and stacked(truth, self.goal, self.base)
        elif self.task == "push" and self.goal in truth and self.goal in self.start:
            self.offsets = [round(v, 4) for v in push_offsets(truth, self.goal,
                                                              self.start[self.goal])]
            ok = plan_ended and pushed(truth, self.goal, self.start[self.goal])
        self._since = (self._since if self._since is not None else t) if ok else None
        return self._since is not None and t - self._since >= SETTLE_S
