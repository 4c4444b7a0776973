"""Pick and place in the MuJoCo world through the reference controller and the gripper: the
grasp holds the cube through the move to the bin by contact and friction only (no ROS)."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_control.core.cartesian import CartesianConfig, CartesianController
from kestrel_control.core.kinematics import ArmKinematics
from kestrel_sim.core import SimWorld, SimWorldConfig

RATE_HZ = 500.0


class Robot:
    """The controller closing the loop on the sim (what the control node does per tick)."""

    def __init__(self, world: SimWorld, kin: ArmKinematics) -> None:
        self.world, self.kin = world, kin
        self.ctl = CartesianController(kin, CartesianConfig(rate_hz=RATE_HZ))
        self.sub = round(self.ctl.dt / world.config.timestep_s)
        self.out = np.zeros(6)
        self.held_ticks = 0

    def tick(self, object_name: str) -> None:
        _, q, _, _ = self.world.joint_state()
        if self.ctl.step(q, self.out):
            self.world.set_joint_targets(self.out)
        self.world.step(self.sub)
        if object_name in self.world.task_status().held:
            self.held_ticks += 1

    def move(self, target, speed: float = 0.5, timeout_s: float = 3.0, tol: float = 0.005,
             object_name: str = "") -> float:
        target = np.asarray(target, dtype=float)
        self.ctl.set_target(target, speed)
        for _ in range(round(timeout_s * RATE_HZ)):
            self.tick(object_name)
            if np.linalg.norm(self.world.end_effector_position() - target) < tol:
                break
        return float(np.linalg.norm(self.world.end_effector_position() - target))

    def gripper(self, closure: float, seconds: float = 0.4, object_name: str = "") -> None:
        self.world.set_gripper_target(closure * self.world.gripper_travel)
        for _ in range(round(seconds * RATE_HZ)):
            self.tick(object_name)


def pick_and_place(world: SimWorld, kin: ArmKinematics, name: str) -> tuple[Robot, dict]:
    robot = Robot(world, kin)
    obj = {o.name: o for o in world.ground_truth()}[name]
    bin_ = {o.name: o for o in world.ground_truth()}["bin"]
    above = obj.position + [0, 0, 0.12]
    robot.gripper(0.0, 0.1)
    assert robot.move(above) < 0.01
    assert robot.move(obj.position, speed=0.2) < 0.01
    robot.gripper(1.0, 0.5)
    z_before = {o.name: o for o in world.ground_truth()}[name].position[2]
    robot.move(obj.position + [0, 0, 0.18], speed=0.3, object_name=name)
    lifted = {o.name: o for o in world.ground_truth()}[name].position[2] - z_before
    drop = bin_.position + [0, 0, 0.13]
    robot.move(drop, speed=0.3, object_name=name)
    in_hand = name in world.task_status().held
    robot.gripper(0.0, 0.6)
    robot.move(drop + [0, 0, 0.08], speed=0.3)
    for _ in range(round(0.5 * RATE_HZ)):  # settle
        robot.tick("")
    return robot, {"lifted": lifted, "in_hand_over_bin": in_hand}


@pytest.fixture(scope="module")
def kin() -> ArmKinematics:
    return ArmKinematics.from_default()


@pytest.mark.slow
def test_grasp_holds_cube_to_the_bin(kin) -> None:
    world = SimWorld()
    world.reset(0)
    assert world.task_status().in_bin == ()
    robot, out = pick_and_place(world, kin, "red_cube")
    assert out["lifted"] > 0.15  # came up with the gripper
    assert out["in_hand_over_bin"]  # still between both fingers over the bin
    assert robot.held_ticks > 0.8 * RATE_HZ  # held through the whole move
    status = world.task_status()
    assert status.in_bin == ("red_cube",) and status.held == ()
    assert status.success("red_cube") and not status.success("green_cube")


@pytest.mark.slow
def test_open_gripper_does_not_lift(kin) -> None:
    world = SimWorld(SimWorldConfig())
    world.reset(0)
    robot = Robot(world, kin)
    cube = {o.name: o for o in world.ground_truth()}["red_cube"]
    robot.move(cube.position + [0, 0, 0.12])
    robot.move(cube.position, speed=0.2)
    robot.gripper(0.0, 0.3)  # stays open
    robot.move(cube.position + [0, 0, 0.15], speed=0.3)
    after = {o.name: o for o in world.ground_truth()}["red_cube"]
    assert after.position[2] < cube.position[2] + 0.01  # the cube stayed on the table
    assert world.task_status().held == ()
