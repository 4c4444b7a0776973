"""Ground-truth task status of an episode: which objects are in the bin and settled, which are
held by the gripper (no rclpy). The evaluator's success signal; nothing here is visible to the
robot's stack.

An object is *in the bin* when its bounding-box centre lies inside the bin's inner walls
(x, y within the walls less `wall_margin`) and below the rim (z under the bin's top plus
`rim_margin`, above its floor), and it is *settled* when, in addition, its linear speed is
below `max_speed` m/s, its angular speed below `max_angular_speed` rad/s and no finger touches
it (released). Frames: world; units m, s, rad.
"""

from __future__ import annotations

from dataclasses import dataclass

import mujoco
import numpy as np

from kestrel_sim.core import scene as sc


@dataclass(frozen=True)
class SuccessCriteria:
    wall_margin: float = 0.005  # m, inside the walls' inner faces
    wall_thickness: float = 0.01  # m, the bin's walls (tabletop.xml)
    rim_margin: float = 0.01  # m, above the rim still counts (a cube resting on another)
    max_speed: float = 0.02  # m/s
    max_angular_speed: float = 0.5  # rad/s


@dataclass(frozen=True)
class TaskStatus:
    """At one instant: names of task objects in the bin and settled, and of objects that both
    fingers touch (held)."""

    in_bin: tuple[str, ...]
    held: tuple[str, ...]

    def success(self, goal: str = "") -> bool:
        """goal "" = any object in the bin; else that object."""
        return bool(self.in_bin) if not goal else goal in self.in_bin


def _bin(info: sc.SceneInfo) -> sc.ObjectInfo:
    for ob in info.objects:
        if ob.class_name == "bin":
            return ob
    raise ValueError("world model has no bin")


def finger_contacts(model: mujoco.MjModel, data: mujoco.MjData,
                    info: sc.SceneInfo) -> dict[int, set[int]]:
    """body id -> set of finger geoms touching it (contacts of the current state)."""
    touching: dict[int, set[int]] = {}
    fingers = info.finger_geom_ids
    for i in range(data.ncon):
        c = data.contact[i]
        g1, g2 = int(c.geom1), int(c.geom2)
        if g1 in fingers and g2 not in fingers:
            touching.setdefault(int(model.geom_bodyid[g2]), set()).add(g1)
        elif g2 in fingers and g1 not in fingers:
            touching.setdefault(int(model.geom_bodyid[g1]), set()).add(g2)
    return touching


def task_status(model: mujoco.MjModel, data: mujoco.MjData, info: sc.SceneInfo,
                present: frozenset[str],
                criteria: SuccessCriteria = SuccessCriteria()) -> TaskStatus:
    """Status of the state in `data` (after mj_forward / mj_step: contacts and poses)."""
    b = _bin(info)
    rot_b = data.xmat[b.body_id].reshape(3, 3)
    centre_b = data.xpos[b.body_id] + rot_b @ b.aabb_center_local
    half_inner = 0.5 * b.size[:2] - criteria.wall_thickness - criteria.wall_margin
    top = centre_b[2] + 0.5 * b.size[2]
    bottom = centre_b[2] - 0.5 * b.size[2]
    touching = finger_contacts(model, data, info)
    n_fingers = len(sc.FINGER_JOINTS)
    in_bin, held = [], []
    vel = np.zeros(6)
    for ob in info.objects:
        if not ob.is_free or ob.name not in present:
            continue
        fingers = touching.get(ob.body_id, set())
        finger_bodies = {int(model.geom_bodyid[g]) for g in fingers}
        if len(finger_bodies) >= n_fingers:
            held.append(ob.name)
        rot = data.xmat[ob.body_id].reshape(3, 3)
        centre = data.xpos[ob.body_id] + rot @ ob.aabb_center_local
        local = rot_b.T @ (centre - centre_b)
        inside = bool(np.all(np.abs(local[:2]) <= half_inner)) and \
            bottom < centre[2] <= top + criteria.rim_margin
        if not inside or fingers:
            continue
        mujoco.mj_objectVelocity(model, data, mujoco.mjtObj.mjOBJ_BODY, ob.body_id, vel, 0)
        if np.linalg.norm(vel[3:]) <= criteria.max_speed and \
                np.linalg.norm(vel[:3]) <= criteria.max_angular_speed:
            in_bin.append(ob.name)
    return TaskStatus(tuple(in_bin), tuple(held))
