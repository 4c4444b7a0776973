"""Scene loading and metadata: MJCF world + the arm's URDF (core/robot.py) -> MjModel, plus the
names/classes the sim needs (no rclpy).

Class convention: every geom takes the class of the top-level body (a direct child of the world
body) it belongs to. That class is the longest entry of CLASS_NAMES (excluding "background")
which prefixes the body's name, e.g. "red_cube_2" -> "red_cube", "robot_base" -> "robot".
Geoms of the world body itself (the floor) and of unmatched bodies are "background".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mujoco
import numpy as np

from kestrel_sim.core.robot import (ARM_JOINTS, EE_SITE, FINGER_JOINTS, MOUNT_SITE,
                                   attach_robot, default_urdf_path)

# The perception class list; a class index is the position in this tuple.
CLASS_NAMES: tuple[str, ...] = (
    "background", "table", "red_cube", "green_cube", "blue_cylinder", "bin", "robot",
)
JOINT_NAMES: tuple[str, ...] = ARM_JOINTS  # the arm's joints, command order
GRIPPER_JOINT = FINGER_JOINTS[0]  # the driven finger joint (the other mimics it)
DISTRACTOR_PREFIX = "distractor"  # free top-level bodies of no class placed by episodes
CAMERA_NAME = "camera"
LIDAR_SITE = "lidar"
HOME_KEY = "home"


def default_world_file() -> Path:
    """The packaged tabletop world (kestrel_sim/worlds/tabletop.xml)."""
    return Path(__file__).resolve().parent.parent / "worlds" / "tabletop.xml"


def class_of_body_name(name: str) -> int:
    """Class index for a top-level body name (longest matching prefix; 0 = background)."""
    best, best_len = 0, 0
    for idx, cls in enumerate(CLASS_NAMES[1:], start=1):
        if name.startswith(cls) and len(cls) > best_len:
            best, best_len = idx, len(cls)
    return best


@dataclass(frozen=True)
class ObjectInfo:
    """A ground-truth object: one top-level body that is not the robot or background."""

    name: str
    class_index: int
    body_id: int
    free_qpos_adr: int  # qpos address of its free joint, -1 for static bodies
    aabb_center_local: np.ndarray  # (3,) m, centre of the geoms' bounding box, body frame
    size: np.ndarray  # (3,) m, full extents of that box (body frame axes)

    @property
    def class_name(self) -> str:
        return CLASS_NAMES[self.class_index]

    @property
    def is_free(self) -> bool:
        return self.free_qpos_adr >= 0


@dataclass(frozen=True)
class SceneInfo:
    """Indices into the model for the parts the simulator uses."""

    joint_qpos_adr: np.ndarray  # (6,) int, qpos address of each arm joint (JOINT_NAMES order)
    joint_dof_adr: np.ndarray  # (6,) int, dof address of each arm joint
    actuator_ids: np.ndarray  # (6,) int, position actuator driving each arm joint
    joint_lower: np.ndarray  # (6,) rad
    joint_upper: np.ndarray  # (6,) rad
    camera_id: int
    lidar_site_id: int
    ee_site_id: int
    home_key_id: int  # -1 if the model has no "home" keyframe
    finger_qpos_adr: np.ndarray  # (2,) int, FINGER_JOINTS order
    finger_dof_adr: np.ndarray  # (2,) int
    finger_actuator_ids: np.ndarray  # (2,) int, both get the gripper's one target
    finger_travel: float  # m, closed position of each finger (upper limit; 0 = open)
    finger_geom_ids: frozenset[int]  # geoms of the finger links (grasp contacts)
    geom_class: np.ndarray  # (ngeom,) int, class index of every geom
    objects: tuple[ObjectInfo, ...]  # table, objects, bin (model body order)
    distractors: tuple[ObjectInfo, ...]  # free bodies named distractor*, class background
    table_height: float  # m, z of the highest table geom's top surface (0 if no table)


def load_model(world_file: str | Path = "", robot_file: str | Path = "") -> mujoco.MjModel:
    """Load an MJCF world ("" = the packaged tabletop) with the arm of the URDF `robot_file`
    ("" = kestrel_description's) attached at its `robot_mount` site (kestrel_sim.core.robot).

    Raises ValueError on a bad file."""
    path = Path(world_file) if str(world_file) else default_world_file()
    if not path.is_file():
        raise ValueError(f"parameter 'world_file' = '{world_file}': file not found")
    try:
        spec = mujoco.MjSpec.from_file(str(path))
    except Exception as exc:  # mujoco raises ValueError with the XML error text
        raise ValueError(f"parameter 'world_file' = '{path}': cannot load MJCF: {exc}") from exc
    attach_robot(spec, robot_file)  # ValueError naming robot_file
    try:
        return spec.compile()
    except Exception as exc:
        raise ValueError(f"parameter 'world_file' = '{path}': cannot compile the world with "
                         f"the arm: {exc}") from exc


def robot_urdf(world_file: str | Path = "", robot_file: str | Path = "") -> str:
    """The URDF text load_model attaches to this world ("" when the world has no robot_mount
    site: its arm is its own MJCF)."""
    path = Path(world_file) if str(world_file) else default_world_file()
    if mujoco.MjSpec.from_file(str(path)).site(MOUNT_SITE) is None:
        return ""
    return (Path(robot_file) if str(robot_file) else default_urdf_path()).read_text()


def _id(model: mujoco.MjModel, obj: mujoco.mjtObj, name: str, what: str) -> int:
    idx = mujoco.mj_name2id(model, obj, name)
    if idx < 0:
        raise ValueError(f"world model has no {what} named '{name}'")
    return idx


def _geom_local_aabb(model: mujoco.MjModel, geom_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) corners, body frame, of one geom's bounding box (planes are skipped by caller)."""
    half = model.geom_aabb[geom_id, 3:]  # half extents in the geom frame
    center = model.geom_aabb[geom_id, :3]
    rot = np.empty(9)
    mujoco.mju_quat2Mat(rot, model.geom_quat[geom_id])
    rot = rot.reshape(3, 3)
    c_body = model.geom_pos[geom_id] + rot @ center
    h_body = np.abs(rot) @ half
    return c_body - h_body, c_body + h_body


def _top_level_body(model: mujoco.MjModel, body_id: int) -> int:
    while body_id != 0 and model.body_parentid[body_id] != 0:
        body_id = int(model.body_parentid[body_id])
    return body_id


def _joint_actuator(model: mujoco.MjModel, name: str, kind: mujoco.mjtJoint,
                    what: str) -> tuple[int, int]:
    """(joint id, id of the actuator driving it); ValueError naming what is missing."""
    jid = _id(model, mujoco.mjtObj.mjOBJ_JOINT, name, "joint")
    if model.jnt_type[jid] != kind:
        raise ValueError(f"world model joint '{name}' must be a {what} joint")
    aid = next((a for a in range(model.nu) if model.actuator_trnid[a, 0] == jid
                and model.actuator_trntype[a] == mujoco.mjtTrn.mjTRN_JOINT), -1)
    if aid < 0:
        raise ValueError(f"world model has no actuator driving joint '{name}'")
    return jid, aid


def build_scene_info(model: mujoco.MjModel) -> SceneInfo:
    """Check the model has the required parts and collect their indices and object metadata."""
    jq, jd, act, lo, hi = [], [], [], [], []
    for name in JOINT_NAMES:
        jid, aid = _joint_actuator(model, name, mujoco.mjtJoint.mjJNT_HINGE,
                                   "hinge (revolute)")
        jq.append(model.jnt_qposadr[jid])
        jd.append(model.jnt_dofadr[jid])
        act.append(aid)
        if model.jnt_limited[jid]:
            lo.append(model.jnt_range[jid, 0])
            hi.append(model.jnt_range[jid, 1])
        else:
            lo.append(-np.pi)
            hi.append(np.pi)
    fq, fd, fa, travel, fgeoms = [], [], [], [], set()
    for name in FINGER_JOINTS:
        jid, aid = _joint_actuator(model, name, mujoco.mjtJoint.mjJNT_SLIDE,
                                   "slide (prismatic)")
        fq.append(model.jnt_qposadr[jid])
        fd.append(model.jnt_dofadr[jid])
        fa.append(aid)
        travel.append(float(model.jnt_range[jid, 1]))
        body = model.jnt_bodyid[jid]
        fgeoms.update(g for g in range(model.ngeom) if model.geom_bodyid[g] == body)
    geom_class = np.zeros(model.ngeom, dtype=np.int64)
    for g in range(model.ngeom):
        top = _top_level_body(model, int(model.geom_bodyid[g]))
        geom_class[g] = 0 if top == 0 else class_of_body_name(model.body(top).name)

    objects: list[ObjectInfo] = []
    distractors: list[ObjectInfo] = []
    table_height = 0.0
    robot_idx = CLASS_NAMES.index("robot")
    for b in range(1, model.nbody):
        if model.body_parentid[b] != 0:
            continue
        name = model.body(b).name
        cls = class_of_body_name(name)
        distractor = cls == 0 and name.startswith(DISTRACTOR_PREFIX)
        if cls == robot_idx or (cls == 0 and not distractor):
            continue
        geoms = [g for g in range(model.ngeom) if model.geom_bodyid[g] == b
                 and model.geom_type[g] != mujoco.mjtGeom.mjGEOM_PLANE]
        if not geoms:
            continue
        boxes = [_geom_local_aabb(model, g) for g in geoms]
        lo_b = np.min([bx[0] for bx in boxes], axis=0)
        hi_b = np.max([bx[1] for bx in boxes], axis=0)
        free_adr = -1
        if model.body_jntnum[b] > 0:
            j = model.body_jntadr[b]
            if model.jnt_type[j] == mujoco.mjtJoint.mjJNT_FREE:
                free_adr = int(model.jnt_qposadr[j])
        info = ObjectInfo(name, cls, b, free_adr, (lo_b + hi_b) / 2.0, hi_b - lo_b)
        if distractor:
            if free_adr >= 0:
                distractors.append(info)
            continue
        objects.append(info)
        if CLASS_NAMES[cls] == "table" and free_adr < 0:
            table_height = max(table_height, float(model.body_pos[b, 2] + hi_b[2]))

    home = mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_KEY, HOME_KEY)
    return SceneInfo(
        joint_qpos_adr=np.asarray(jq, dtype=np.int64),
        joint_dof_adr=np.asarray(jd, dtype=np.int64),
        actuator_ids=np.asarray(act, dtype=np.int64),
        joint_lower=np.asarray(lo, dtype=np.float64),
        joint_upper=np.asarray(hi, dtype=np.float64),
        camera_id=_id(model, mujoco.mjtObj.mjOBJ_CAMERA, CAMERA_NAME, "camera"),
        lidar_site_id=_id(model, mujoco.mjtObj.mjOBJ_SITE, LIDAR_SITE, "site"),
        ee_site_id=_id(model, mujoco.mjtObj.mjOBJ_SITE, EE_SITE, "site"),
        home_key_id=int(home),
        finger_qpos_adr=np.asarray(fq, dtype=np.int64),
        finger_dof_adr=np.asarray(fd, dtype=np.int64),
        finger_actuator_ids=np.asarray(fa, dtype=np.int64),
        finger_travel=min(travel),
        finger_geom_ids=frozenset(fgeoms),
        geom_class=geom_class,
        objects=tuple(objects),
        distractors=tuple(distractors),
        table_height=table_height,
    )
