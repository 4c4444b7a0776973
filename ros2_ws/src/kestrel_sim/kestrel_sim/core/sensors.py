"""Camera (RGB + metric depth) and LiDAR sensors on a SimWorld (no rclpy).

Both work on a private snapshot of the world's state (SimWorld.snapshot_into), so they can run
on a thread other than the physics thread. A CameraSensor owns an OpenGL context
(MUJOCO_GL=osmesa on CPU, egl on GPU); it is created lazily by the first render() on the calling
thread, so call render() and close() from one thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import mujoco
import numpy as np

from kestrel_sim.core.world import SimWorld

# MuJoCo camera frame (x right, y up, looks along -z) -> ROS optical frame (x right, y down,
# z forward): R_world_optical = R_world_mjcam @ diag(1, -1, -1).
_MJCAM_FROM_OPTICAL = np.diag([1.0, -1.0, -1.0])



def _snapshot(world, dst: mujoco.MjData, source: mujoco.MjData | None, stamp_ns: int) -> int:
    """dst <- a new snapshot of the world (returns its sim time, ns), or a copy of `source`
    (a snapshot the caller took at stamp_ns)."""
    if source is None:
        return world.snapshot_into(dst)
    world.copy_snapshot(source, dst)
    return stamp_ns

@dataclass
class CameraFrame:
    rgb: np.ndarray  # [H, W, 3] uint8, row 0 = top of the image
    depth: np.ndarray  # [H, W] float32, m, along the optical axis; +inf where nothing is hit
    stamp_ns: int  # sim time of the state that was rendered
    t_world_cam: np.ndarray  # [4, 4] T_world_from_cam (optical frame) of that state


@dataclass
class LidarScan:
    points: np.ndarray  # [N, 3] float32, m, world frame, hits only
    ranges: np.ndarray  # [N] float32, m, distance from the sensor origin
    rings: np.ndarray  # [N] uint16, vertical channel (0 = lowest elevation)
    class_index: np.ndarray  # [N] uint8, class of the geom that was hit (CLASS_NAMES index)
    stamp_ns: int


class CameraSensor:
    """Fixed pinhole camera "camera" of the world; intrinsics from the model's fovy."""

    def __init__(self, world: SimWorld, width: int = 320, height: int = 256) -> None:
        for pname, v in (("camera_width", width), ("camera_height", height)):
            if not (16 <= int(v) <= 4096):
                raise ValueError(f"parameter '{pname}' = {v}: must be in [16, 4096] pixels")
        self.world = world
        self.width, self.height = int(width), int(height)
        m = world.model
        # The offscreen buffer must hold the image; set before any MjrContext is made.
        m.vis.global_.offwidth = max(int(m.vis.global_.offwidth), self.width)
        m.vis.global_.offheight = max(int(m.vis.global_.offheight), self.height)
        self._cam_id = world.info.camera_id
        self._data = mujoco.MjData(m)  # private snapshot
        self._rgb_raw = np.empty((self.height, self.width, 3), dtype=np.uint8)
        self._depth_raw = np.empty((self.height, self.width), dtype=np.float32)
        self._gl = None
        self._con = None
        self._scene = mujoco.MjvScene(m, maxgeom=max(1000, 4 * m.ngeom))
        self._opt = mujoco.MjvOption()
        self._cam = mujoco.MjvCamera()
        self._cam.type = mujoco.mjtCamera.mjCAMERA_FIXED
        self._cam.fixedcamid = self._cam_id
        self._rect = mujoco.MjrRect(0, 0, self.width, self.height)
        self._render_lock = threading.Lock()
        # Reversed-Z depth buffer -> metric z (same constants as mujoco.Renderer, float32).
        near = np.float32(m.vis.map.znear * m.stat.extent)
        far = np.float32(m.vis.map.zfar * m.stat.extent)
        c = -(far + near) / (far - near)
        dd = -(np.float32(2) * far * near) / (far - near)
        self._c_coef = float(np.float32(-0.5) * c - np.float32(0.5))
        self._d_coef = float(np.float32(-0.5) * dd)
        self.near, self.far = float(near), float(far)

    def _ensure_context(self) -> None:
        if self._con is not None:
            return
        gl_cls = getattr(mujoco, "GLContext", None)
        if gl_cls is None:
            raise RuntimeError("no OpenGL backend: set MUJOCO_GL=osmesa (CPU) or egl (GPU)")
        self._gl = gl_cls(self.width, self.height)
        self._gl.make_current()
        self._con = mujoco.MjrContext(self.world.model, mujoco.mjtFontScale.mjFONTSCALE_100)
        mujoco.mjr_setBuffer(mujoco.mjtFramebuffer.mjFB_OFFSCREEN, self._con)
        self._con.readDepthMap = mujoco.mjtDepthMap.mjDEPTH_ZEROFAR

    def intrinsics(self) -> np.ndarray:
        """K [3, 3]: fx = fy from fovy, principal point at the image centre (pixel centres at
        integer coordinates, so cx = (W - 1) / 2)."""
        fovy = np.deg2rad(self.world.model.cam_fovy[self._cam_id])
        f = 0.5 * self.height / np.tan(0.5 * fovy)
        return np.array([[f, 0.0, (self.width - 1) / 2.0],
                         [0.0, f, (self.height - 1) / 2.0],
                         [0.0, 0.0, 1.0]])

    def extrinsics(self) -> np.ndarray:
        """T_world_from_cam [4, 4] of the optical frame (x right, y down, z forward), now."""
        with self._render_lock:
            self.world.snapshot_into(self._data)
            return self._extrinsics(self._data)

    def _extrinsics(self, data: mujoco.MjData) -> np.ndarray:
        t = np.eye(4)
        t[:3, :3] = data.cam_xmat[self._cam_id].reshape(3, 3) @ _MJCAM_FROM_OPTICAL
        t[:3, 3] = data.cam_xpos[self._cam_id]
        return t

    def render(self, source: mujoco.MjData | None = None, stamp_ns: int = 0) -> CameraFrame:
        """Render RGB + depth of a snapshot in one GL pass.
        source: a snapshot taken by the caller (stamp_ns its sim time) instead of a new one:
        sensors triggered together see the same instant (take_snapshot)."""
        with self._render_lock:
            stamp = _snapshot(self.world, self._data, source, stamp_ns)
            self._ensure_context()
            self._gl.make_current()
            mujoco.mjv_updateScene(self.world.model, self._data, self._opt, None, self._cam,
                                   mujoco.mjtCatBit.mjCAT_ALL, self._scene)
            mujoco.mjr_render(self._rect, self._scene, self._con)
            mujoco.mjr_readPixels(self._rgb_raw, self._depth_raw, self._rect, self._con)
            rgb = np.flipud(self._rgb_raw).copy()  # GL rows are bottom-up
            z = np.flipud(self._depth_raw).astype(np.float64)
            depth = (self._d_coef / (z + self._c_coef)).astype(np.float32)
            depth[z <= 0.0] = np.inf  # cleared depth (reversed Z: 0 = far plane): no surface
            t_world_cam = self._extrinsics(self._data)
        return CameraFrame(rgb, depth, stamp, t_world_cam)

    def close(self) -> None:
        """Free the GL resources (call from the rendering thread)."""
        with self._render_lock:
            if self._con is not None:
                self._con.free()
                self._con = None
            if self._gl is not None:
                self._gl.free()
                self._gl = None


class LidarSensor:
    """Spinning LiDAR at the world's "lidar" site: n_vertical rings x n_horizontal azimuths.

    fov = (min, max) elevation in rad (negative = below the site's x-y plane); azimuth covers
    360 degrees. Rays are cast against all geoms up to max_range (m).

    ray_method: "exact" casts one mj_ray per ray (slower; releases the GIL between rays);
    "multiray" uses mj_multiRay (several times faster, holds the GIL), whose geom culling in
    MuJoCo < 3.5 misses some geoms (rays pass through the gripper, a bin wall, whole table
    legs); "auto" picks "multiray" only on MuJoCo >= 3.5.
    """

    def __init__(self, world: SimWorld, n_vertical: int = 32, n_horizontal: int = 360,
                 fov: tuple[float, float] = (-1.50, -0.25), max_range: float = 5.0,
                 ray_method: str = "auto") -> None:
        if not (1 <= int(n_vertical) <= 256):
            raise ValueError(f"parameter 'lidar_n_vertical' = {n_vertical}: must be in [1, 256]")
        if not (1 <= int(n_horizontal) <= 4096):
            raise ValueError(
                f"parameter 'lidar_n_horizontal' = {n_horizontal}: must be in [1, 4096]")
        lo, hi = float(fov[0]), float(fov[1])
        if not (-np.pi / 2 <= lo <= hi <= np.pi / 2):
            raise ValueError(f"parameter 'lidar_fov' = {fov}: need -pi/2 <= min <= max <= pi/2")
        if not max_range > 0.0:
            raise ValueError(f"parameter 'lidar_max_range' = {max_range}: must be > 0")
        if ray_method not in ("auto", "exact", "multiray"):
            raise ValueError(f"parameter 'lidar_ray_method' = '{ray_method}': must be one of "
                             "auto, exact, multiray")
        if ray_method == "auto":
            major, minor = (int(x) for x in mujoco.__version__.split(".")[:2])
            ray_method = "multiray" if (major, minor) >= (3, 5) else "exact"
        self.ray_method = ray_method
        self.world = world
        self.n_vertical, self.n_horizontal = int(n_vertical), int(n_horizontal)
        self.max_range = float(max_range)
        self._site = world.info.lidar_site_id
        self._data = mujoco.MjData(world.model)
        elev = np.linspace(lo, hi, self.n_vertical)
        azim = np.linspace(-np.pi, np.pi, self.n_horizontal, endpoint=False)
        e, a = np.meshgrid(elev, azim, indexing="ij")  # [V, H]
        # unit directions in the site frame, ring-major: [V*H, 3]
        self._dirs_local = np.stack([np.cos(e) * np.cos(a), np.cos(e) * np.sin(a), np.sin(e)],
                                    axis=-1).reshape(-1, 3)
        self._rings = np.repeat(np.arange(self.n_vertical, dtype=np.uint16), self.n_horizontal)
        n = self._dirs_local.shape[0]
        self._vec = np.empty(n * 3)
        self._dist = np.empty(n)
        self._geomid = np.empty(n, dtype=np.int32)
        self._geom_class = world.info.geom_class.astype(np.uint8)
        self._lock = threading.Lock()

    @property
    def n_rays(self) -> int:
        return self._dirs_local.shape[0]

    def scan(self, source: mujoco.MjData | None = None, stamp_ns: int = 0) -> LidarScan:
        """Cast all rays from a snapshot; returns the hits (no-hit rays are dropped).
        source / stamp_ns: as CameraSensor.render."""
        with self._lock:
            stamp = _snapshot(self.world, self._data, source, stamp_ns)
            m, d = self.world.model, self._data
            origin = d.site_xpos[self._site].copy()
            rot = d.site_xmat[self._site].reshape(3, 3)
            dirs = self._dirs_local @ rot.T  # [N, 3] world frame
            self._vec[:] = dirs.reshape(-1)
            if self.ray_method == "multiray":
                mujoco.mj_multiRay(m, d, origin, self._vec, None, 1, -1, self._geomid,
                                   self._dist, self.n_rays, self.max_range)
            else:
                self._cast_exact(m, d, origin)
            hit = (self._dist >= 0.0) & (self._dist <= self.max_range)
            r = self._dist[hit]
            pts = origin[None, :] + dirs[hit] * r[:, None]
            cls = self._geom_class[self._geomid[hit]]
            return LidarScan(pts.astype(np.float32), r.astype(np.float32),
                             self._rings[hit].copy(), cls, stamp)

    def _cast_exact(self, m: mujoco.MjModel, d: mujoco.MjData, origin: np.ndarray) -> None:
        """One mj_ray per ray into self._dist / self._geomid (-1 = no hit)."""
        ray, dist, gids = mujoco.mj_ray, self._dist, self._geomid
        dirs = self._vec.reshape(-1, 3)
        gid = np.zeros(1, dtype=np.int32)
        for i in range(dirs.shape[0]):
            dist[i] = ray(m, d, origin, dirs[i], None, 1, -1, gid)
            gids[i] = gid[0]
