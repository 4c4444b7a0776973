"""The pick-and-place loop through the cores, without ROS: the planner's executor turns a plan
into Cartesian and gripper targets (at 20 Hz, fed back the tool position), the control node's
reference controller (IkRunner, with its safety filter) turns them into joint commands at
500 Hz, the MuJoCo world moves the arm and the objects. Object positions come from the
simulator's ground truth (no perception): what the robot side of the loop achieves.

    world = SimWorld(); world.reset(seed)
    executor = run_plan(world, "pick red_cube speed=0.3\\nplace bin speed=0.3\\nend", 15.0)
    world.task_status().success("red_cube")
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
import time
from collections.abc import Callable, Iterator

import numpy as np

from kestrel_bringup.episode_tasks import Truth
from kestrel_control.core.cartesian import CartesianConfig
from kestrel_control.core.ik_runner import MODE_CARTESIAN, MODE_HOLD, IkRunner
from kestrel_control.core.kinematics import ArmKinematics
from kestrel_control.core.policy_runner import RunnerConfig
from kestrel_planner.core.executor import PlanExecutor, StepEvent, TargetMode
from kestrel_planner.core.plan import SceneObject, fill_defaults, parse_plan
from kestrel_planner.params import SPECS, executor_config
from kestrel_sim.core import SimWorld, SimWorldConfig

CONTROL_HZ, PLANNER_HZ = 500.0, 20.0
# the planner node's defaults (kestrel_planner.params), so this loop runs what the stack runs
_DEFAULTS = {s.name: s.default for s in SPECS}
TRANSIT_CLEARANCE = _DEFAULTS["transit_clearance"]  # m
PUSH_SPEED = _DEFAULTS["push_speed"]  # m/s
# the evaluations through the cores (scripts/eval_pick_place.py, eval_push.py): 1-3 task
# objects and 0-2 distractors per seeded layout
EVAL_WORLD = SimWorldConfig(min_objects=1, max_distractors=2)


def layouts(world: SimWorld, seeds: int) -> Iterator[tuple[int, str]]:
    """(seed, task object) for every task object of the layouts of seeds 1..`seeds`, the world
    reset to that seed's layout before each: one episode per object."""
    for seed in range(1, seeds + 1):
        world.reset(seed)
        for name in world.task_objects:
            world.reset(seed)
            yield seed, name


def layout_pairs(world: SimWorld, seeds: int) -> Iterator[tuple[int, str, str]]:
    """(seed, top, base) for every ordered pair of task objects of the layouts of seeds
    1..`seeds`, the world reset to that seed's layout before each (one stacking episode per
    pair)."""
    for seed in range(1, seeds + 1):
        world.reset(seed)
        for top, base in itertools.permutations(world.task_objects, 2):
            world.reset(seed)
            yield seed, top, base


def truth(world: SimWorld) -> Truth:
    """The world's ground truth as the evaluations take it: name -> (centre, full size), m."""
    return {o.name: (tuple(map(float, o.position)), tuple(map(float, o.size)))
            for o in world.ground_truth()}


def eval_config(options: argparse.Namespace, t0: float) -> dict:
    """An evaluation script's config record: its options, the loop's rates and the wall s
    since `t0` (time.monotonic())."""
    return {**vars(options), "control_hz": int(CONTROL_HZ), "planner_hz": int(PLANNER_HZ),
            "wall_s": round(time.monotonic() - t0, 1)}


def eval_command(script: str, argv: list[str] | None) -> str:
    """The command line a record names: 'python <script> <arguments>' (argv None: the
    process's own)."""
    return f"python {script} " + " ".join(sys.argv[1:] if argv is None else argv)


def run_plan(world: SimWorld, plan_text: str, seconds: float,
             kinematics: ArmKinematics | None = None,
             position_errors: dict[str, tuple[float, float, float]] | None = None,
             events: list[StepEvent] | None = None,
             observe: Callable[[float], None] | None = None, **executor: float) -> PlanExecutor:
    """Execute `plan_text` on the world's current layout for at most `seconds` of sim time
    (then 0.5 s to settle). Returns the executor (its step statuses).

    position_errors: object name -> (dx, dy, dz) m added to its position in the scene the
    executor plans with (a perception error; the object stays where it is). events: a list
    the executor's step events are appended to, in order (the node's StepStatus messages).
    observe: called with the sim time (s from the start) at every executor tick, before it,
    and once after the settling (an evaluator's look at the world). `executor`:
    ExecutorConfig fields that replace the planner node's defaults (e.g. stall_timeout=0)."""
    lo, hi = world.joint_limits
    runner = IkRunner(RunnerConfig(joint_lower=lo, joint_upper=hi, max_obs_age_s=0.05),
                      kinematics or ArmKinematics.from_default(),
                      CartesianConfig(rate_hz=CONTROL_HZ))
    runner.reset()
    ex = PlanExecutor(dataclasses.replace(executor_config(_DEFAULTS), **executor))
    errors = position_errors or {}
    scene = [SceneObject(o.name, o.class_name, tuple(
        float(v) + e for v, e in zip(o.position, errors.get(o.name, (0.0, 0.0, 0.0)),
                                     strict=True)))
             for o in world.ground_truth()]
    log = events if events is not None else []
    plan = parse_plan(plan_text)
    # as the planner node: a step that names no speed gets its default_speed
    fill_defaults(plan, {"speed": _DEFAULTS["default_speed"]})
    log += ex.start(plan, scene, 0.0)
    robot = runner.robots[0]
    sub = round(1.0 / CONTROL_HZ / world.config.timestep_s)
    every = round(CONTROL_HZ / PLANNER_HZ)
    now_ns, dt_ns = 10**9, int(1e9 / CONTROL_HZ)
    row = np.zeros(5)
    t0 = world.sim_time_ns
    for k in range(int(seconds * CONTROL_HZ)):
        if k % every == 0:
            if observe is not None:
                observe((world.sim_time_ns - t0) * 1e-9)
            out = ex.tick(k / CONTROL_HZ, world.end_effector_position())
            log += out.events
            tg = out.target
            if tg is None:
                break
            world.set_gripper_target(tg.gripper * world.gripper_travel)
            if tg.mode == TargetMode.CARTESIAN:
                row[:] = (*tg.position, tg.max_speed, MODE_CARTESIAN)
            else:
                row[:] = (0.0, 0.0, 0.0, 0.0, MODE_HOLD)
            robot.mode.write(row, now_ns)
        _, q, qd, _ = world.joint_state()
        robot.joint_states.write(np.stack([q, qd]), now_ns)
        cmd, info = runner.step(now_ns)
        if info.valid:
            world.set_joint_targets(cmd)
        world.step(sub)
        now_ns += dt_ns
    world.step(500)  # let it settle
    if observe is not None:
        observe((world.sim_time_ns - t0) * 1e-9)
    return ex
