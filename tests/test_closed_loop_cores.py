"""The pick-and-place loop closes in the cores (no ROS): the planner's executor turns a plan
into Cartesian and gripper targets, the reference controller (IkRunner) turns them into joint
commands at 500 Hz, the MuJoCo world moves the arm and the object; success is the simulator's
ground truth (object in the bin and settled)."""

from __future__ import annotations

import pytest

from kestrel_bringup.core_loop import run_plan
from kestrel_sim.core import SimWorld


@pytest.mark.parametrize("name", ["red_cube", "blue_cylinder"])
def test_pick_and_place_plan_succeeds(name: str) -> None:
    world = SimWorld()
    world.reset(0)
    ex = run_plan(world, f"pick {name} speed=0.3\nplace bin speed=0.3\nend", 15.0)
    assert not ex.running and all(s.name == "SUCCEEDED" for s in ex.statuses), ex.statuses
    status = world.task_status()
    assert status.success(name), status
