"""SimWorld: the MuJoCo tabletop world with the 6-DoF position-controlled arm and its
two-finger gripper (kestrel_description's URDF, attached by core/robot.py), episodes (seeded
layouts with a random subset of objects and distractors) and task success (core/episode.py).
No rclpy.

Thread model: `lock` guards the live MjData. Every public method takes it for a short time, so
one thread may step physics while others read joint states, set targets or take snapshots for
rendering (`snapshot_into`: copy the state, then mj_forward on a private MjData outside the lock).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

import mujoco
import numpy as np

from kestrel_sim.core import scene as sc
from kestrel_sim.core.episode import SuccessCriteria, TaskStatus, task_status


class JointCommandError(ValueError):
    """A joint target vector was rejected (wrong length or non-finite); nothing was applied."""


# The arm's rest pose at reset: bent over the table's near edge, gripper pointing down-forward.
HOME_JOINT_POSITIONS: tuple[float, ...] = (0.0, -0.2, 1.4, 1.2, 0.0, 0.0)


@dataclass(frozen=True)
class SimWorldConfig:
    """Validated by SimWorld. world_file "" = the packaged tabletop.xml; robot_file "" =
    kestrel_description's URDF (attached at the world's robot_mount site)."""

    world_file: str | Path = ""
    robot_file: str | Path = ""
    timestep_s: float = 0.001  # physics step, s (1 kHz)
    home_joint_positions: tuple[float, ...] = HOME_JOINT_POSITIONS  # [6] rad, at every reset
    # Randomised placement (reset with seed != 0): objects' centres stay inside this x/y box
    # on the table (m), at a horizontal distance from the arm's base (the origin) within
    # spawn_radius (m: where the gripper reaches them pointing straight down), at least
    # `spawn_min_separation` apart and clear of static objects (the bin).
    spawn_x: tuple[float, float] = (0.28, 0.66)
    spawn_y: tuple[float, float] = (-0.45, 0.45)
    spawn_radius: tuple[float, float] = (0.32, 0.58)
    spawn_min_separation: float = 0.10
    # Episodes (seed != 0): how many of the task objects (the perception classes' free bodies)
    # are on the table, uniform in [min_objects, all], the others parked off the table; and
    # how many distractors (free bodies of no class), uniform in [0, max_distractors].
    min_objects: int = 3
    max_distractors: int = 0

    def validate(self) -> None:
        if not (1e-4 <= self.timestep_s <= 0.01):
            raise ValueError(f"parameter 'timestep_s' = {self.timestep_s}: must be in "
                             "[0.0001, 0.01] s (physics_rate_hz in [100, 10000])")
        for pname in ("spawn_x", "spawn_y", "spawn_radius"):
            lo, hi = getattr(self, pname)
            if not lo < hi:
                raise ValueError(f"parameter '{pname}' = {(lo, hi)}: need min < max")
        if self.spawn_radius[0] < 0.0:
            raise ValueError(f"parameter 'spawn_radius' = {self.spawn_radius}: must be >= 0")
        if self.spawn_min_separation < 0.0:
            raise ValueError(f"parameter 'spawn_min_separation' = {self.spawn_min_separation}:"
                             " must be >= 0")
        if len(self.home_joint_positions) != 6 or not all(
                math.isfinite(v) for v in self.home_joint_positions):
            raise ValueError(f"parameter 'home_joint_positions' = {self.home_joint_positions}:"
                             " need 6 finite values, rad")
        if self.min_objects < 1:
            raise ValueError(f"parameter 'min_objects' = {self.min_objects}: must be >= 1")
        if self.max_distractors < 0:
            raise ValueError(f"parameter 'max_distractors' = {self.max_distractors}: must be "
                             ">= 0")


@dataclass(frozen=True)
class ObjectGT:
    """Ground truth of one object, world frame."""

    name: str
    class_name: str
    class_index: int
    position: np.ndarray  # (3,) m, centre of the object's bounding box
    quaternion: np.ndarray  # (4,) wxyz, body orientation
    size: np.ndarray  # (3,) m, full extents along the body axes


class SimWorld:
    """The simulated world. Sim time advances only through step() and never goes backwards."""

    CLASS_NAMES = sc.CLASS_NAMES
    JOINT_NAMES = sc.JOINT_NAMES
    GRIPPER_JOINT = sc.GRIPPER_JOINT
    PARK_X = 20.0  # m: parked bodies rest on the floor here, out of every sensor's range

    def __init__(self, config: SimWorldConfig | None = None) -> None:
        self.config = config or SimWorldConfig()
        self.config.validate()
        self.model: mujoco.MjModel = sc.load_model(self.config.world_file,
                                                   self.config.robot_file)
        # the arm's URDF text (robot_description; "" for a world with its own MJCF arm)
        self.robot_urdf = sc.robot_urdf(self.config.world_file, self.config.robot_file)
        self.model.opt.timestep = self.config.timestep_s
        self.info: sc.SceneInfo = sc.build_scene_info(self.model)
        self.data: mujoco.MjData = mujoco.MjData(self.model)  # live state: only under `lock`
        self.lock = threading.Lock()
        self._timestep_ns = int(round(self.config.timestep_s * 1e9))
        self._steps_total = 0  # physics steps since construction (drives sim_time_ns)
        self._targets = np.zeros(6)  # rad, current actuator targets
        self._gripper_target = 0.0  # m, finger position target (0 = open)
        self._present = frozenset(o.name for o in self.info.objects)  # on the table now
        self._seed = 0
        self.reset(0)

    # ---- properties ------------------------------------------------------------------------
    @property
    def joint_names(self) -> tuple[str, ...]:
        return sc.JOINT_NAMES

    @property
    def joint_limits(self) -> tuple[np.ndarray, np.ndarray]:
        """(lower [6], upper [6]) rad."""
        return self.info.joint_lower.copy(), self.info.joint_upper.copy()

    @property
    def gripper_travel(self) -> float:
        """m, finger position when closed (each finger; 0 = open)."""
        return self.info.finger_travel

    @property
    def present_objects(self) -> frozenset[str]:
        """Names of the objects on the table in this episode (table and bin included)."""
        return self._present

    @property
    def task_objects(self) -> tuple[str, ...]:
        """Names of the free task objects on the table in this episode (model order)."""
        return tuple(o.name for o in self.info.objects if o.is_free and o.name in self._present)

    @property
    def seed(self) -> int:
        """Seed of the last reset (0 = the default layout)."""
        return self._seed

    @property
    def timestep_ns(self) -> int:
        return self._timestep_ns

    @property
    def sim_time_ns(self) -> int:
        """Sim time, ns: steps taken since construction x timestep (monotonic across reset)."""
        return self._steps_total * self._timestep_ns

    @property
    def table_height(self) -> float:
        """m, z of the table's top surface."""
        return self.info.table_height

    # ---- control ---------------------------------------------------------------------------
    def reset(self, seed: int = 0) -> None:
        """Reset: arm at home_joint_positions, gripper open; seed 0 = the default layout
        (every task object at its place in the world file, no distractors), else an episode
        drawn from the seed (which objects are present, distractors, poses: SimWorldConfig).

        Raises ValueError for a negative seed. Sim time keeps running (it is the ROS clock).
        """
        if seed < 0:
            raise ValueError(f"parameter 'seed' = {seed}: must be >= 0")
        with self.lock:
            m, d, info = self.model, self.data, self.info
            if info.home_key_id >= 0:
                mujoco.mj_resetDataKeyframe(m, d, info.home_key_id)
            else:
                mujoco.mj_resetData(m, d)  # free bodies at their world-file poses
                d.qpos[info.joint_qpos_adr] = self.config.home_joint_positions
            q0 = d.qpos[info.joint_qpos_adr].copy()
            self._targets = np.clip(q0, info.joint_lower, info.joint_upper)
            d.ctrl[info.actuator_ids] = self._targets
            self._gripper_target = 0.0
            d.qpos[info.finger_qpos_adr] = 0.0
            d.ctrl[info.finger_actuator_ids] = 0.0
            for k, ob in enumerate(info.distractors):
                self._park(ob, k)
            present = [o.name for o in info.objects]
            if seed != 0:
                present = self._randomise_objects(np.random.default_rng(seed))
            self._present = frozenset(present)
            self._seed = seed
            mujoco.mj_forward(m, d)

    def _park(self, ob: sc.ObjectInfo, slot: int) -> None:
        """Put a free body on the floor at PARK_X (a row along y), at rest, upright."""
        a = ob.free_qpos_adr
        self.data.qpos[a:a + 3] = (self.PARK_X, 0.5 * slot,
                                   0.5 * ob.size[2] - ob.aabb_center_local[2] + 1e-4)
        self.data.qpos[a + 3:a + 7] = (1.0, 0.0, 0.0, 0.0)
        dof = self.model.jnt_dofadr[self.model.body_jntadr[ob.body_id]]
        self.data.qvel[dof:dof + 6] = 0.0

    def _randomise_objects(self, rng: np.random.Generator) -> list[str]:
        """Draw the episode: which task objects are present (the rest parked), how many
        distractors, and x, y, yaw of each on the table (rejection sampling). Returns the
        names of the objects on the table (static ones and the present free ones)."""
        cfg, d = self.config, self.data
        keep_out = []  # (x, y, radius) of static objects on the table (bin)
        for ob in self.info.objects:
            if not ob.is_free and ob.class_name != "table":
                c = self.model.body_pos[ob.body_id] + ob.aabb_center_local
                keep_out.append((c[0], c[1], 0.5 * float(np.hypot(*ob.size[:2]))))
        free = [ob for ob in self.info.objects if ob.is_free]
        n_obj = int(rng.integers(min(cfg.min_objects, len(free)), len(free) + 1))
        chosen = sorted(rng.choice(len(free), size=n_obj, replace=False).tolist())
        n_dis = int(rng.integers(0, min(cfg.max_distractors, len(self.info.distractors)) + 1))
        dis = sorted(rng.choice(len(self.info.distractors), size=n_dis,
                                replace=False).tolist())
        to_place = [free[i] for i in chosen] + [self.info.distractors[i] for i in dis]
        for k, ob in enumerate(free):
            if k not in chosen:
                self._park(ob, len(self.info.distractors) + k)
        placed: list[tuple[float, float, float]] = []
        r_lo, r_hi = cfg.spawn_radius
        for ob in to_place:
            radius = 0.5 * float(np.hypot(*ob.size[:2]))
            for _ in range(1000):
                x = rng.uniform(*cfg.spawn_x)
                y = rng.uniform(*cfg.spawn_y)
                ok = r_lo <= math.hypot(x, y) <= r_hi and all(
                    math.hypot(x - px, y - py) >= max(cfg.spawn_min_separation, r + radius)
                    for px, py, r in placed + keep_out)
                if ok:
                    break
            else:
                raise RuntimeError(f"cannot place '{ob.name}' on the table: spawn area too full")
            placed.append((x, y, radius))
            yaw = rng.uniform(-math.pi, math.pi)
            a = ob.free_qpos_adr
            # body origin such that the bounding box rests on the table top
            d.qpos[a:a + 3] = (x, y, self.table_height - ob.aabb_center_local[2]
                               + 0.5 * ob.size[2] + 1e-4)
            d.qpos[a + 3:a + 7] = (math.cos(yaw / 2), 0.0, 0.0, math.sin(yaw / 2))
            dof = self.model.jnt_dofadr[self.model.body_jntadr[ob.body_id]]
            d.qvel[dof:dof + 6] = 0.0
        return [o.name for o in self.info.objects if not o.is_free] + \
            [free[i].name for i in chosen]

    def step(self, n: int = 1) -> None:
        """Advance physics by n steps (n >= 0) of timestep_s."""
        if n < 0:
            raise ValueError(f"step count n = {n}: must be >= 0")
        with self.lock:
            for _ in range(n):
                mujoco.mj_step(self.model, self.data)
            self._steps_total += n

    def _validated(self, q: np.ndarray | list[float]) -> np.ndarray:
        q = np.asarray(q, dtype=np.float64).reshape(-1)
        if q.shape != (6,):
            raise JointCommandError(f"joint vector has {q.size} values, expected 6")
        if not np.all(np.isfinite(q)):
            raise JointCommandError("joint vector contains NaN or Inf")
        return np.clip(q, self.info.joint_lower, self.info.joint_upper)

    def set_joint_targets(self, q: np.ndarray | list[float]) -> np.ndarray:
        """Set position targets q [6] rad (JOINT_NAMES order), clamped to the joint limits.

        Returns the applied (clamped) targets. Raises JointCommandError (a ValueError) for a
        wrong length or NaN/Inf; the previous targets are then kept.
        """
        q = self._validated(q)
        with self.lock:
            self._targets = q
            self.data.ctrl[self.info.actuator_ids] = q
        return q.copy()

    def joint_targets(self) -> np.ndarray:
        """Current position targets [6], rad."""
        with self.lock:
            return self._targets.copy()

    def set_joint_positions(self, q: np.ndarray | list[float]) -> None:
        """Teleport the arm to q [6] rad (clamped), zero its velocity, and hold it there."""
        q = self._validated(q)
        with self.lock:
            self.data.qpos[self.info.joint_qpos_adr] = q
            self.data.qvel[self.info.joint_dof_adr] = 0.0
            self._targets = q
            self.data.ctrl[self.info.actuator_ids] = q
            mujoco.mj_forward(self.model, self.data)

    def set_gripper_target(self, position: float) -> float:
        """Finger position target, m (0 = open .. gripper_travel = closed), applied to both
        fingers (the URDF's mimic); clamped. Returns the applied value. Raises
        JointCommandError for NaN/Inf (the previous target is kept)."""
        if not math.isfinite(position):
            raise JointCommandError("gripper position is NaN or Inf")
        value = min(max(float(position), 0.0), self.info.finger_travel)
        with self.lock:
            self._gripper_target = value
            self.data.ctrl[self.info.finger_actuator_ids] = value
        return value

    def gripper_target(self) -> float:
        """m, the finger position target."""
        with self.lock:
            return self._gripper_target

    def gripper_state(self) -> tuple[np.ndarray, np.ndarray]:
        """(positions [2] m, velocities [2] m/s) of the fingers, FINGER_JOINTS order."""
        with self.lock:
            return (self.data.qpos[self.info.finger_qpos_adr].copy(),
                    self.data.qvel[self.info.finger_dof_adr].copy())

    # ---- state -----------------------------------------------------------------------------
    def joint_state(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """(names, q [6] rad, qd [6] rad/s, effort [6] N m = actuator torque)."""
        with self.lock:
            d = self.data
            q = d.qpos[self.info.joint_qpos_adr].copy()
            qd = d.qvel[self.info.joint_dof_adr].copy()
            eff = d.qfrc_actuator[self.info.joint_dof_adr].copy()
        return list(sc.JOINT_NAMES), q, qd, eff

    def joint_state_all(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """joint_state() plus the two finger joints (m, m/s, N): what /joint_states carries."""
        names, q, qd, eff = self.joint_state()
        with self.lock:
            d, f = self.data, self.info.finger_dof_adr
            fq = d.qpos[self.info.finger_qpos_adr].copy()
            fqd, feff = d.qvel[f].copy(), d.qfrc_actuator[f].copy()
        return (names + list(sc.FINGER_JOINTS), np.concatenate([q, fq]),
                np.concatenate([qd, fqd]), np.concatenate([eff, feff]))

    def end_effector_pose(self) -> tuple[np.ndarray, np.ndarray]:
        """((3,) m position, (3, 3) rotation) of the end_effector site, world frame."""
        with self.lock:
            return (self.data.site_xpos[self.info.ee_site_id].copy(),
                    self.data.site_xmat[self.info.ee_site_id].reshape(3, 3).copy())

    def end_effector_position(self) -> np.ndarray:
        """(3,) m, world position of the end_effector site (tool centre point)."""
        with self.lock:
            return self.data.site_xpos[self.info.ee_site_id].copy()

    def ground_truth(self) -> list[ObjectGT]:
        """Every object on the table in this episode (table, present cubes / cylinder, bin),
        world frame, model body order. Parked objects and distractors are not listed."""
        out = []
        with self.lock:
            for ob in self.info.objects:
                if ob.name not in self._present:
                    continue
                rot = self.data.xmat[ob.body_id].reshape(3, 3)
                pos = self.data.xpos[ob.body_id] + rot @ ob.aabb_center_local
                out.append(ObjectGT(ob.name, ob.class_name, ob.class_index, pos.copy(),
                                    self.data.xquat[ob.body_id].copy(), ob.size.copy()))
        return out

    def task_status(self, criteria: SuccessCriteria = SuccessCriteria()) -> TaskStatus:
        """Ground-truth task status now: objects in the bin and settled, objects held
        (core/episode.py)."""
        with self.lock:
            return task_status(self.model, self.data, self.info, self._present, criteria)

    def take_snapshot(self, dst: mujoco.MjData | None = None) -> tuple[mujoco.MjData, int]:
        """A snapshot of the live state (into `dst`, reused, or a new MjData) and its sim time
        (ns): sensors triggered at the same instant render / scan this one (a hardware
        trigger)."""
        dst = mujoco.MjData(self.model) if dst is None else dst
        return dst, self.snapshot_into(dst)

    def snapshot_into(self, dst: mujoco.MjData) -> int:
        """Copy the live state into dst (a MjData of this model) and run mj_forward on it.

        Only the copy holds the lock; returns the snapshot's sim time, ns.
        """
        with self.lock:
            self._copy_state(self.data, dst)
            stamp = self.sim_time_ns
        mujoco.mj_forward(self.model, dst)
        return stamp

    def copy_snapshot(self, src: mujoco.MjData, dst: mujoco.MjData) -> None:
        """dst <- the state of another snapshot `src` (no lock: snapshots are private)."""
        self._copy_state(src, dst)
        mujoco.mj_forward(self.model, dst)

    def _copy_state(self, src: mujoco.MjData, dst: mujoco.MjData) -> None:
        dst.qpos[:] = src.qpos
        dst.qvel[:] = src.qvel
        dst.ctrl[:] = src.ctrl
        if self.model.na:
            dst.act[:] = src.act
        if self.model.nmocap:
            dst.mocap_pos[:] = src.mocap_pos
            dst.mocap_quat[:] = src.mocap_quat
        dst.time = src.time
