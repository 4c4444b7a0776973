"""The pick-and-place loop closes in the cores (no ROS): the planner's executor turns a plan
into Cartesian and gripper targets, the reference controller (IkRunner) turns them into joint
commands at 500 Hz, the MuJoCo world moves the arm and the object; success is the simulator's
ground truth (object in the bin and settled)."""

from __future__ import annotations

import mujoco
import numpy as np
import pytest

from kestrel_bringup.core_loop import EVAL_WORLD, layout_pairs, layouts, run_plan, truth
from kestrel_bringup.episode_tasks import push_offsets
from kestrel_sim.core import SimWorld, SimWorldConfig


def test_layouts_give_every_task_object_of_each_seed_its_own_reset_layout() -> None:
    world, ref = SimWorld(EVAL_WORLD), SimWorld(EVAL_WORLD)
    seen = []
    for seed, name in layouts(world, 3):
        ref.reset(seed)
        assert name in ref.task_objects and world.task_objects == ref.task_objects
        # as reset, whatever ran before
        assert [tuple(o.position) for o in world.ground_truth()] == \
            [tuple(o.position) for o in ref.ground_truth()]
        seen.append((seed, name))
        # an episode moves things (here: the object 10 cm along x); the next starts as reset
        joint = mujoco.mj_name2id(world.model, mujoco.mjtObj.mjOBJ_JOINT, f"{name}_free")
        world.data.qpos[world.model.jnt_qposadr[joint]] += 0.1
        world.step(10)
    assert seen == [(s, n) for s in (1, 2, 3) for n in (ref.reset(s) or ref.task_objects)]


def test_layout_pairs_give_every_ordered_pair_of_each_seed_its_own_reset_layout() -> None:
    """eval_stack's episodes: every (top, base) of two different task objects of a layout, in
    both orders, each from the layout as reset."""
    world, ref = SimWorld(EVAL_WORLD), SimWorld(EVAL_WORLD)
    seen = []
    for seed, top, base in layout_pairs(world, 4):
        ref.reset(seed)
        assert top != base and {top, base} <= set(ref.task_objects)
        assert [tuple(o.position) for o in world.ground_truth()] == \
            [tuple(o.position) for o in ref.ground_truth()]
        seen.append((seed, top, base))
        world.step(10)
    for seed in (1, 2, 3, 4):
        n = len(ref.reset(seed) or ref.task_objects)
        assert sum(s == seed for s, _, _ in seen) == n * (n - 1)
    assert len(set(seen)) == len(seen) > 0


@pytest.mark.parametrize("name", ["red_cube", "blue_cylinder"])
def test_pick_and_place_plan_succeeds(name: str) -> None:
    world = SimWorld()
    world.reset(0)
    ex = run_plan(world, f"pick {name} speed=0.3\nplace bin speed=0.3\nend", 15.0)
    assert not ex.running and all(s.name == "SUCCEEDED" for s in ex.statuses), ex.statuses
    status = world.task_status()
    assert status.success(name), status


def test_a_plan_without_speeds_runs_at_the_planner_nodes_default_speed() -> None:
    """As the node: steps that name no speed get default_speed (the same episode, step for
    step, as the plan that names it)."""
    from kestrel_planner.params import SPECS

    speed = next(s.default for s in SPECS if s.name == "default_speed")
    ends = []
    for plan in ("pick red_cube\nplace bin\nend",
                 f"pick red_cube speed={speed}\nplace bin speed={speed}\nend"):
        world = SimWorld()
        world.reset(0)
        start = world.sim_time_ns
        run_plan(world, plan, 20.0)
        assert world.task_status().success("red_cube")
        ends.append(world.sim_time_ns - start)
    assert ends[0] == ends[1], ends


def test_pick_and_place_in_the_far_corner() -> None:
    """Seed 47 puts the cylinder in the table's far corner (0.46, -0.36): with the tool
    pointing down the arm does not reach 15 cm above it, and the pick's first waypoint (over
    the object at the transit clearance) stalled 2.5 cm short. The planner's default clearance
    is within reach there and still clears the bin's walls."""
    from kestrel_bringup.core_loop import TRANSIT_CLEARANCE

    world = SimWorld(SimWorldConfig(min_objects=1, max_distractors=2))
    world.reset(47)
    assert world.task_objects == ("blue_cylinder",)
    ex = run_plan(world, "pick blue_cylinder\nplace bin\nend", 30.0)
    assert [s.name for s in ex.statuses] == ["SUCCEEDED"] * 2, (TRANSIT_CLEARANCE, ex.statuses)
    assert world.task_status().success("blue_cylinder")


def _push(world: SimWorld, seed: int, name: str) -> tuple[list[str], float, float]:
    """'push <name> distance=0.05' at 0.3 m/s on seed's layout: the step statuses and how far
    the object moved along x and y, m."""
    world.reset(seed)
    before = truth(world)[name][0]
    ex = run_plan(world, f"push {name} speed=0.3 distance=0.05\nend", 15.0)
    dx, dy, _ = push_offsets(truth(world), name, before)
    return [s.name for s in ex.statuses], dx, dy


@pytest.mark.parametrize(("seed", "name"), [(0, "red_cube"), (0, "blue_cylinder")])
def test_a_push_moves_the_object_by_its_distance(seed: int, name: str) -> None:
    """The push comes down behind the object with the gripper closed and moves it `distance`
    along +x, within 5 mm: the stroke's end waits for the arm's trail behind its command to
    be worked off before the arm lifts (lifting once within position_tolerance left the
    cylinder 7 mm short)."""
    statuses, dx, dy = _push(SimWorld(), seed, name)
    assert statuses == ["SUCCEEDED"], statuses
    assert abs(dx - 0.05) < 0.005 and abs(dy) < 0.005, (dx, dy)


def test_a_turned_cube_is_pushed_its_distance_and_drifts_as_it_turns() -> None:
    """Seed 2's cube is turned: its corner reaches 3.5 cm behind its centre, the push comes
    down behind that. The cube turns square to the fingers as it goes and drifts sideways
    about 1 cm over the 5 cm."""
    statuses, dx, dy = _push(SimWorld(), 2, "green_cube")
    assert statuses == ["SUCCEEDED"], statuses
    assert abs(dx - 0.05) < 0.01 and abs(dy) < 0.015, (dx, dy)


@pytest.mark.parametrize(("seed", "name"), [(12, "blue_cylinder"), (20, "red_cube")])
def test_a_push_stroke_at_push_speed_neither_tips_nor_wedges(seed: int, name: str) -> None:
    """The arm's position servos lag their command in proportion to speed. Stroked at the
    step's 0.3 m/s, the tool centre trails about 1.5 cm high: seed 12's 8 cm cylinder tips
    against the fingers, and on seed 20's cube the fingers wedge on its face (friction holds
    the arm up, the cube is pressed into the table) 1.2 cm short of the end. At the planner's
    push_speed both move 5 +- 1 cm along x (the turned cube drifts 1.2 cm sideways)."""
    statuses, dx, dy = _push(SimWorld(EVAL_WORLD), seed, name)
    assert statuses == ["SUCCEEDED"], statuses
    assert abs(dx - 0.05) < 0.01 and abs(dy) < 0.015, (dx, dy)


@pytest.mark.parametrize(("top", "base"), [("red_cube", "blue_cylinder"),
                                          ("blue_cylinder", "green_cube")])
def test_stacking_onto_or_with_a_taller_object_releases_on_contact(top: str, base: str) -> None:
    """'stack A on B' is 'pick A; place B': the place lowers A's centre to 5 cm over B's, right
    for two 5 cm cubes. With the 8 cm cylinder on either side, A lands on B 1.5 cm before that
    and the arm stalls: the place releases there (place_contact_height) and A rests on B.
    Without it the step failed and the arm backed off holding A."""
    world = SimWorld(EVAL_WORLD)
    world.reset(17)
    events: list = []
    ex = run_plan(world, f"pick {top}\nplace {base}\nend", 30.0, events=events)
    assert [s.name for s in ex.statuses] == ["SUCCEEDED"] * 2, ex.statuses
    assert any(e.message.startswith("landed") for e in events)
    gt = {o.name: o for o in world.ground_truth()}
    a, b = gt[top], gt[base]
    gap = (a.position[2] - a.size[2] / 2) - (b.position[2] + b.size[2] / 2)
    assert abs(gap) < 0.01 and np.hypot(*(a.position[:2] - b.position[:2])) < 0.01, (a, b)
    assert top not in world.task_status().held


def test_a_pick_past_the_reach_recovers_for_its_retry() -> None:
    """The scene puts seed 3's cylinder (at the table's far edge, 0.58 m from the base) 2 cm
    further out than it is: the point over it is past what the arm reaches with the tool down,
    so the arm stretches to its elbow limit, tool tilted, and stalls short of it. From there
    the retry's points, which it reaches from home, must still be reached: the pick succeeds.
    The step events go into `events` in order (the retry's among them); `observe` sees the
    world at every executor tick and after the settling."""
    world = SimWorld()
    world.reset(3)
    events: list = []
    seen: list[tuple[float, bool]] = []  # (sim s, the cylinder between the fingers)
    ex = run_plan(world, "pick blue_cylinder speed=0.3\nplace bin speed=0.3\nend", 20.0,
                  position_errors={"blue_cylinder": (0.02, 0.0, 0.0)}, events=events,
                  observe=lambda t: seen.append((t, "blue_cylinder" in world.task_status().held)))
    times = [t for t, _ in seen]
    assert times[0] == 0.0 and times == sorted(times) and len(times) > 20 * 5
    assert any(held for _, held in seen) and not seen[-1][1]  # held, then let go
    assert [s.name for s in ex.statuses] == ["SUCCEEDED"] * 2, [e.message for e in events]
    assert world.task_status().success("blue_cylinder")
    first, last = events[0], events[-1]  # the pick started ... the place ended
    assert (first.step_index, first.status.name) == (0, "ACTIVE"), events
    assert (last.step_index, last.status.name) == (1, "SUCCEEDED"), events
    assert any(e.message.startswith("retry 1/") for e in events), events


@pytest.mark.slow
def test_a_grasp_blocked_by_a_position_error_is_retried_after_the_stall() -> None:
    """The scene puts seed 28's cylinder 2.5 cm beyond where it is along x (a perception
    error): the fingers come down on it. The stall watch starts the retry (1.5 cm toward the
    base) about 1 s after the arm stopped, and the cube ends in the bin well before the
    step_timeout (10 s) would have let the retry begin; without the watch it waits that out."""
    times = {}
    for stall in (1.0, 0.0):
        world = SimWorld()
        world.reset(28)
        ex = run_plan(world, "pick blue_cylinder speed=0.3\nplace bin speed=0.3\nend", 30.0,
                      position_errors={"blue_cylinder": (0.025, 0.0, 0.0)},
                      stall_timeout=stall)
        assert [s.name for s in ex.statuses] == ["SUCCEEDED"] * 2, (stall, ex.statuses)
        assert world.task_status().success("blue_cylinder")
        times[stall] = world.sim_time_ns * 1e-9
    assert times[1.0] < 10.0 < times[0.0], times
