"""The plan executor's configuration (kestrel_planner.core.executor has what each field does;
the planner node's parameters of the same names, kestrel_planner.params, fill it in).
Validated on construction: a bad value raises ValueError naming the parameter and the value."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ExecutorConfig"]

Vec3 = tuple[float, float, float]


@dataclass(frozen=True)
class ExecutorConfig:
    position_tolerance: float = 0.01  # m
    step_timeout: float = 10.0  # s
    gripper_time: float = 0.5  # s to wait for a gripper command
    home_joint_positions: tuple[float, ...] = ()  # rad, control node's joint order
    home_position: Vec3 | None = None  # m, optional EE position check for HOME
    joint_tolerance: float = 0.02  # rad
    home_speed: float = 0.5  # rad/s
    # m: PICK and PLACE first go this far above their target, then down to its `height`;
    # PICK lifts the object this far above its grasp position once the gripper closed, PLACE
    # goes back up this far above its target once the gripper opened. Every move between two
    # targets then runs at this clearance: the arm and the object in hand clear obstacles on
    # the way (the bin's walls, the other objects). 0 = the skills' points only.
    transit_clearance: float = 0.0
    # a failed Cartesian waypoint: back to where its step began its approach, then hold
    back_off: bool = True
    grasp_retries: int = 0  # a failed PICK approach: tries again this often (module doc)
    grasp_retry_offset: float = 0.015  # m, the retries' moves of the object's position
    # a Cartesian waypoint fails when the arm got no `stall_distance` m closer to it for
    # `stall_timeout` s (0 = off: only step_timeout)
    stall_timeout: float = 0.0  # s
    stall_distance: float = 0.005  # m
    push_speed: float = 0.05  # m/s, top speed of a PUSH's stroke (module doc)
    # m: a PLACE stopped on its way down at most this far straight above its point releases
    # there (module doc); 0 = off: such a place fails
    place_contact_height: float = 0.0

    def __post_init__(self) -> None:
        for name in ("position_tolerance", "step_timeout", "joint_tolerance", "home_speed",
                     "push_speed"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"parameter '{name}' = {v!r}: must be finite and > 0")
        if not (math.isfinite(self.gripper_time) and self.gripper_time >= 0):
            raise ValueError(f"parameter 'gripper_time' = {self.gripper_time!r}: must be >= 0")
        if not (isinstance(self.grasp_retries, int) and 0 <= self.grasp_retries <= 4):
            raise ValueError(f"parameter 'grasp_retries' = {self.grasp_retries!r}: must be "
                             "an integer in [0, 4]")
        if not (math.isfinite(self.grasp_retry_offset) and
                0.0 <= self.grasp_retry_offset <= 0.1):
            raise ValueError(f"parameter 'grasp_retry_offset' = {self.grasp_retry_offset!r}: "
                             "must be in [0, 0.1] m")
        if not (math.isfinite(self.stall_timeout) and self.stall_timeout >= 0):
            raise ValueError(f"parameter 'stall_timeout' = {self.stall_timeout!r}: must be "
                             ">= 0 (0 = off)")
        if not (math.isfinite(self.stall_distance) and 0 < self.stall_distance <= 0.1):
            raise ValueError(f"parameter 'stall_distance' = {self.stall_distance!r}: must be "
                             "in (0, 0.1] m")
        if not (math.isfinite(self.transit_clearance) and self.transit_clearance >= 0):
            raise ValueError(f"parameter 'transit_clearance' = {self.transit_clearance!r}: "
                             "must be >= 0")
        if not (math.isfinite(self.place_contact_height) and
                0.0 <= self.place_contact_height <= 0.2):
            raise ValueError(f"parameter 'place_contact_height' = "
                             f"{self.place_contact_height!r}: must be in [0, 0.2] m")
