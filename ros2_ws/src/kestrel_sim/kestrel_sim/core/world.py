"""SimWorld: the MuJoCo tabletop world with a 6-DoF position-controlled arm (no rclpy).

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


class JointCommandError(ValueError):
    """A joint target vector was rejected (wrong length or non-finite); nothing was applied."""


@dataclass(frozen=True)
class SimWorldConfig:
    """Validated by SimWorld. world_file "" = the packaged tabletop.xml."""

    world_file: str | Path = ""
    timestep_s: float = 0.001  # physics step, s (1 kHz)
    # Randomised placement (reset with seed != 0): objects' centres stay inside this x/y box
    # on the table (m), at least `spawn_min_separation` apart and clear of static objects.
    spawn_x: tuple[float, float] = (0.38, 0.80)
    spawn_y: tuple[float, float] = (-0.38, 0.38)
    spawn_min_separation: float = 0.10

    def validate(self) -> None:
        if not (1e-4 <= self.timestep_s <= 0.01):
            raise ValueError(f"parameter 'timestep_s' = {self.timestep_s}: must be in "
                             "[0.0001, 0.01] s (physics_rate_hz in [100, 10000])")
        for pname in ("spawn_x", "spawn_y"):
            lo, hi = getattr(self, pname)
            if not lo < hi:
                raise ValueError(f"parameter '{pname}' = {(lo, hi)}: need min < max")
        if self.spawn_min_separation < 0.0:
            raise ValueError(f"parameter 'spawn_min_separation' = {self.spawn_min_separation}:"
                             " must be >= 0")


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

    def __init__(self, config: SimWorldConfig | None = None) -> None:
        self.config = config or SimWorldConfig()
        self.config.validate()
        self.model: mujoco.MjModel = sc.load_model(self.config.world_file)
        self.model.opt.timestep = self.config.timestep_s
        self.info: sc.SceneInfo = sc.build_scene_info(self.model)
        self.data: mujoco.MjData = mujoco.MjData(self.model)  # live state: only under `lock`
        self.lock = threading.Lock()
        self._timestep_ns = int(round(self.config.timestep_s * 1e9))
        self._steps_total = 0  # physics steps since construction (drives sim_time_ns)
        self._targets = np.zeros(6)  # rad, current actuator targets
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
        """Reset to the home keyframe; seed 0 = default layout, else random object placement.

        Raises ValueError for a negative seed. Sim time keeps running (it is the ROS clock).
        """
        if seed < 0:
            raise ValueError(f"parameter 'seed' = {seed}: must be >= 0")
        with self.lock:
            m, d = self.model, self.data
            if self.info.home_key_id >= 0:
                mujoco.mj_resetDataKeyframe(m, d, self.info.home_key_id)
            else:
                mujoco.mj_resetData(m, d)
            q0 = d.qpos[self.info.joint_qpos_adr].copy()
            self._targets = np.clip(q0, self.info.joint_lower, self.info.joint_upper)
            d.ctrl[self.info.actuator_ids] = self._targets
            if seed != 0:
                self._randomise_objects(np.random.default_rng(seed))
            mujoco.mj_forward(m, d)

    def _randomise_objects(self, rng: np.random.Generator) -> None:
        """Place free objects on the table at random x, y, yaw (rejection sampling)."""
        cfg, d = self.config, self.data
        keep_out = []  # (x, y, radius) of static objects on the table (bin)
        for ob in self.info.objects:
            if not ob.is_free and ob.class_name != "table":
                c = self.model.body_pos[ob.body_id] + ob.aabb_center_local
                keep_out.append((c[0], c[1], 0.5 * float(np.hypot(*ob.size[:2]))))
        placed: list[tuple[float, float, float]] = []
        for ob in self.info.objects:
            if not ob.is_free:
                continue
            radius = 0.5 * float(np.hypot(*ob.size[:2]))
            for _ in range(1000):
                x = rng.uniform(*cfg.spawn_x)
                y = rng.uniform(*cfg.spawn_y)
                ok = all(math.hypot(x - px, y - py) >= max(cfg.spawn_min_separation, r + radius)
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

    # ---- state -----------------------------------------------------------------------------
    def joint_state(self) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
        """(names, q [6] rad, qd [6] rad/s, effort [6] N m = actuator torque)."""
        with self.lock:
            d = self.data
            q = d.qpos[self.info.joint_qpos_adr].copy()
            qd = d.qvel[self.info.joint_dof_adr].copy()
            eff = d.qfrc_actuator[self.info.joint_dof_adr].copy()
        return list(sc.JOINT_NAMES), q, qd, eff

    def end_effector_position(self) -> np.ndarray:
        """(3,) m, world position of the end_effector site (tool centre point)."""
        with self.lock:
            return self.data.site_xpos[self.info.ee_site_id].copy()

    def ground_truth(self) -> list[ObjectGT]:
        """Every object (table, cubes, cylinder, bin), world frame, model body order."""
        out = []
        with self.lock:
            for ob in self.info.objects:
                rot = self.data.xmat[ob.body_id].reshape(3, 3)
                pos = self.data.xpos[ob.body_id] + rot @ ob.aabb_center_local
                out.append(ObjectGT(ob.name, ob.class_name, ob.class_index, pos.copy(),
                                    self.data.xquat[ob.body_id].copy(), ob.size.copy()))
        return out

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
