"""sim: the embedded MuJoCo world as a ROS 2 lifecycle node, and the stack's clock.

Threads (started on activate, stopped on deactivate/shutdown):
- physics: steps SimWorld in small batches against a wall-clock deadline (real_time_factor x
  wall time), and publishes /clock, ~/output/joint_states and ~/output/ground_truth at their
  rates in SIM time. A batch that finishes after the next deadline is a counted overrun.
- sensors: renders the camera (image, camera_info, camera_pose, optional depth) and scans the
  LiDAR (points, frame "world") at their rates in sim time, from snapshots of the state, so
  rendering never blocks physics for more than a state copy. It owns the GL context.
Every output is stamped with the sim time of the state it shows.
Episodes: ~/reset (ResetWorld) starts one from a seed (which task objects, distractors, poses:
the episode.* parameters) and a goal object; ~/output/episode (EpisodeStatus) carries its seed
and the ground-truth task status (objects in the bin and settled, held) at ground_truth_rate_hz.
Input: ~/input/joint_command (JointState, position = targets: the arm's joints in rad, and the
gripper's driven finger joint `finger_left` in m, 0 = open; the other finger mimics it, as in
the URDF). ~/output/joint_states carries the arm's joints and both fingers;
~/output/robot_description (std_msgs/String, latched) the URDF the arm was built from.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

import mujoco
import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus
from geometry_msgs.msg import Point, PointStamped, Pose, PoseStamped, Vector3
from kestrel_interfaces.msg import EpisodeStatus, GroundTruth, ObjectState
from kestrel_interfaces.srv import ResetWorld
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rclpy.qos import QoSProfile, ReliabilityPolicy
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import CameraInfo, Image, JointState, PointCloud2
from std_msgs.msg import String

from kestrel_common.base_node import (COMMAND_QOS, LATCHED_QOS, SENSOR_QOS,
                                      KestrelLifecycleNode, run_node)
from kestrel_common.conversions import (make_camera_info, make_header, ns_to_stamp,
                                        numpy_to_image, xyz_to_pointcloud2)
from kestrel_sim.core import (GRIPPER_JOINT, JOINT_NAMES, CameraSensor, LidarSensor,
                              SimWorld, SimWorldConfig)
from kestrel_sim.params import SPECS, validate_sim_params
from kestrel_sim.rates import Periodic, RateMeter

# /clock: reliable keep-last-1 matches both best-effort (rclpy TimeSource) and reliable readers.
CLOCK_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE)
MAX_LAG_S = 0.05  # physics further behind than this re-anchors (sim runs slower than asked)
# At the process exit: how long stop_workers waits for a thread busy in a render or a LiDAR
# scan (which it cannot leave) before leaving it to the exit, s
EXIT_JOIN_S = 0.25


class SimNode(KestrelLifecycleNode):
    runtime_params = frozenset({"real_time_factor"})

    def __init__(self) -> None:
        super().__init__("sim", SPECS)
        self.world: SimWorld | None = None
        self.camera: CameraSensor | None = None
        self.lidar: LidarSensor | None = None
        self._pubs: dict[str, Any] = {}
        self._sub = None
        self._srv = None
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        # held while the sensor thread publishes; stop_workers takes it once after setting
        # _stop, so no publish is in flight when a sensor thread is left to the process exit
        self._publish_lock = threading.Lock()
        self._tick = threading.Event()  # set by physics after every batch
        self._active = False
        self._meters = {k: RateMeter() for k in ("physics", "clock", "joint_states", "camera",
                                                  "lidar")}
        self._gt_due: Periodic | None = None
        self._sensor_ms = {"render_ms": float("nan"), "scan_ms": float("nan")}
        self._goal = ""  # goal object of the episode ("" = any)
        self._episode = 0  # resets since configure
        for name in ("joint_command_applied", "joint_command_bad_length",
                     "joint_command_unknown_joint", "joint_command_nonfinite",
                     "joint_command_clamped", "joint_command_inactive", "physics_overruns",
                     "physics_lag_resets", "sensor_errors", "publish_errors", "resets"):
            self.counters.inc(name, 0)  # visible on /diagnostics from the start

    # ---- lifecycle -------------------------------------------------------------------------
    def validate_extra(self, values: dict[str, Any]) -> None:
        validate_sim_params(values)

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        p = self.load_params()
        if p is None:
            return TransitionCallbackReturn.FAILURE
        try:
            self.world = SimWorld(SimWorldConfig(
                world_file=p["world_file"], robot_file=p["robot_file"],
                timestep_s=1.0 / p["physics_rate_hz"],
                min_objects=p["episode.min_objects"],
                max_distractors=p["episode.max_distractors"]))
            self.world.reset(p["seed"])
            self.camera = CameraSensor(self.world, p["camera_width"], p["camera_height"])
            self.lidar = LidarSensor(self.world, p["lidar_n_vertical"], p["lidar_n_horizontal"],
                                     max_range=p["lidar_max_range"])
        except (ValueError, RuntimeError) as exc:
            self.get_logger().error(f"configure failed: {exc}")
            self.world = self.camera = self.lidar = None
            return TransitionCallbackReturn.FAILURE
        mk = self.create_publisher
        self._pubs = {
            "clock": mk(Clock, "/clock", CLOCK_QOS),
            "image": mk(Image, "~/output/image", SENSOR_QOS),
            "camera_info": mk(CameraInfo, "~/output/camera_info", SENSOR_QOS),
            "camera_pose": mk(PoseStamped, "~/output/camera_pose", LATCHED_QOS),
            "points": mk(PointCloud2, "~/output/points", SENSOR_QOS),
            "joint_states": mk(JointState, "~/output/joint_states", SENSOR_QOS),
            # tool-centre-point position (forward kinematics), what a robot driver's TF gives
            "ee_position": mk(PointStamped, "~/output/ee_position", SENSOR_QOS),
            "ground_truth": mk(GroundTruth, "~/output/ground_truth", LATCHED_QOS),
            # latched: an evaluator that subscribes late still gets the episode's status
            "episode": mk(EpisodeStatus, "~/output/episode", LATCHED_QOS),
            # the URDF the arm was built from, latched, as robot_state_publisher offers it
            "robot_description": mk(String, "~/output/robot_description", LATCHED_QOS),
        }
        self._pubs["robot_description"].publish(String(data=self.world.robot_urdf))
        if p["publish_depth"]:
            self._pubs["depth"] = mk(Image, "~/output/depth", SENSOR_QOS)
        self._sub = self.create_subscription(JointState, "~/input/joint_command",
                                             self._on_joint_command, COMMAND_QOS)
        self._srv = self.create_service(ResetWorld, "~/reset", self._on_reset)
        self.get_logger().info(
            f"configured: {self.world.model.nbody} bodies, dt {self.world.timestep_ns} ns, "
            f"camera {p['camera_width']}x{p['camera_height']}, lidar {self.lidar.n_rays} rays "
            f"({self.lidar.ray_method})")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop.clear()
        self._active = True
        self._threads = [threading.Thread(target=self._physics_loop, name="physics", daemon=True),
                         threading.Thread(target=self._sensor_loop, name="sensors", daemon=True)]
        for t in self._threads:
            t.start()
        self.start_diagnostics(self._status)
        self.get_logger().info("active: physics and sensor threads running")
        return TransitionCallbackReturn.SUCCESS

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_workers()
        for pub in self._pubs.values():
            self.destroy_publisher(pub)
        self._pubs = {}
        if self._sub is not None:
            self.destroy_subscription(self._sub)
            self._sub = None
        if self._srv is not None:
            self.destroy_service(self._srv)
            self._srv = None
        self.world = self.camera = self.lidar = None
        return TransitionCallbackReturn.SUCCESS

    def stop_workers(self) -> None:
        self._active = False
        self._stop.set()
        self._tick.set()
        with self._publish_lock:  # a publish in flight ends; none starts after this
            pass
        for t in self._threads:
            # at the process exit a render or scan in flight is not waited for: once stopped
            # the thread publishes nothing (_publish_camera/_lidar) and the exit ends it
            t.join(timeout=EXIT_JOIN_S if self.exiting else 5.0)
            if t.is_alive() and not self.exiting:
                self.get_logger().error(f"thread '{t.name}' did not stop within 5 s")
        self._threads = []

    def _shutting_down(self) -> bool:
        return self._stop.is_set() or not self.context.ok()

    # ---- physics thread --------------------------------------------------------------------
    def _physics_loop(self) -> None:
        world, p = self.world, self.params
        dt_ns = world.timestep_ns
        batch_s = p["physics_batch_s"]
        clock_due, js_due = Periodic(p["clock_rate_hz"]), Periodic(p["joint_state_rate_hz"])
        self._gt_due = Periodic(p["ground_truth_rate_hz"])
        rtf = float(p["real_time_factor"])
        anchor_wall, anchor_sim = time.monotonic(), world.sim_time_ns
        deadline = anchor_wall
        last_rtf_check = anchor_wall
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_rtf_check > 0.1:  # real_time_factor is live
                last_rtf_check = now
                new_rtf = float(self.get_parameter("real_time_factor").value)
                if new_rtf != rtf:
                    rtf, anchor_wall, anchor_sim = new_rtf, now, world.sim_time_ns
            due_ns = anchor_sim + int((now - anchor_wall) * rtf * 1e9)
            lag_ns = due_ns - world.sim_time_ns
            if lag_ns > MAX_LAG_S * rtf * 1e9:  # too far behind: give up on that time
                self.counters.inc("physics_lag_resets")
                anchor_wall, anchor_sim = now, world.sim_time_ns
                lag_ns = int(batch_s * rtf * 1e9)
            n = max(0, lag_ns // dt_ns)
            if n:
                world.step(n)
                self._meters["physics"].tick(n)
                try:
                    self._publish_physics_outputs(clock_due, js_due)
                except Exception as exc:  # e.g. the context was shut down by SIGINT
                    if self._shutting_down():
                        break
                    self.counters.inc("publish_errors")
                    self.get_logger().error(f"publish failed: {exc!r}",
                                            throttle_duration_sec=5.0)
                self._tick.set()
            deadline += batch_s
            slack = deadline - time.monotonic()
            if slack < 0.0:
                self.counters.inc("physics_overruns")
                deadline = time.monotonic()
            else:
                self._stop.wait(slack)

    def _publish_physics_outputs(self, clock_due: Periodic, js_due: Periodic) -> None:
        world = self.world
        now_ns = world.sim_time_ns
        if clock_due.due(now_ns):
            self._pubs["clock"].publish(Clock(clock=ns_to_stamp(now_ns)))
            self._meters["clock"].tick()
        if js_due.due(now_ns):
            names, q, qd, eff = world.joint_state_all()  # the arm, then both fingers
            msg = JointState(header=make_header(now_ns, ""), name=names, position=q.tolist(),
                             velocity=qd.tolist(), effort=eff.tolist())
            self._pubs["joint_states"].publish(msg)
            self._meters["joint_states"].tick()
            ee = world.end_effector_position()  # (3,) m, world frame
            self._pubs["ee_position"].publish(PointStamped(
                header=make_header(now_ns, self.params["world_frame"]),
                point=Point(x=float(ee[0]), y=float(ee[1]), z=float(ee[2]))))
        if self._gt_due.due(now_ns):
            self._pubs["ground_truth"].publish(self._ground_truth_msg(now_ns))
            self._pubs["episode"].publish(self._episode_msg(now_ns))

    def _ground_truth_msg(self, stamp_ns: int) -> GroundTruth:
        msg = GroundTruth(header=make_header(stamp_ns, self.params["world_frame"]))
        for o in self.world.ground_truth():
            pose = Pose()
            pose.position.x, pose.position.y, pose.position.z = (float(v) for v in o.position)
            w, x, y, z = (float(v) for v in o.quaternion)
            pose.orientation.w, pose.orientation.x = w, x
            pose.orientation.y, pose.orientation.z = y, z
            msg.objects.append(ObjectState(
                name=o.name, class_name=o.class_name, class_index=o.class_index, pose=pose,
                size=Vector3(x=float(o.size[0]), y=float(o.size[1]), z=float(o.size[2]))))
        return msg

    def _episode_msg(self, stamp_ns: int) -> EpisodeStatus:
        status = self.world.task_status()
        goal = self._goal
        present = list(self.world.task_objects)
        return EpisodeStatus(
            header=make_header(stamp_ns, self.params["world_frame"]), seed=self.world.seed,
            episode=self._episode, goal_object=goal, success=status.success(goal),
            objects_present=present, objects_in_bin=list(status.in_bin),
            objects_held=list(status.held))

    # ---- sensor thread ---------------------------------------------------------------------
    def _sensor_loop(self) -> None:
        cam_due = Periodic(self.params["camera_rate_hz"])
        lidar_due = Periodic(self.params["lidar_rate_hz"])
        trigger = None  # the snapshot both sensors use when they are due together
        try:
            while not self._stop.is_set():
                self._tick.wait(0.1)
                self._tick.clear()
                if self._stop.is_set():
                    break
                now_ns = self.world.sim_time_ns
                try:
                    cam, lidar = cam_due.due(now_ns), lidar_due.due(now_ns)
                    # due together: one snapshot for both, so the image and the cloud carry
                    # the same stamp (a rig's hardware trigger; the perception node pairs
                    # them within sync_slop). The render (tens of ms on the CPU) would else
                    # put the scan's snapshot that much sim time after the image's.
                    snap = (None, 0)
                    if cam and lidar:  # (the MjData is reused from the previous trigger)
                        snap = self.world.take_snapshot(trigger)
                        trigger = snap[0]
                    if cam:
                        self._publish_camera(*snap)
                    if lidar and not self._stop.is_set():
                        self._publish_lidar(*snap)
                except Exception as exc:  # a render/scan failure must not kill the thread
                    if self._shutting_down():
                        break
                    self.counters.inc("sensor_errors")
                    self.get_logger().error(f"sensor update failed: {exc!r}",
                                            throttle_duration_sec=5.0)
                    self._stop.wait(0.5)
        finally:
            if self.camera is not None:
                self.camera.close()  # the GL context belongs to this thread

    def _publish_camera(self, source=None, stamp_ns: int = 0) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        frame = self.camera.render(source, stamp_ns)
        self._sensor_ms["render_ms"] = (time.perf_counter() - t0) * 1e3
        with self._publish_lock:
            if not self._stop.is_set():  # (stopped during the render: the node may be going)
                self._publish_frame(frame)

    def _publish_frame(self, frame) -> None:  # noqa: ANN001 - a CameraSensor frame
        p, cam = self.params, self.camera
        header = make_header(frame.stamp_ns, p["camera_frame"])
        info = make_camera_info(cam.intrinsics(), cam.width, cam.height, header)
        self._pubs["image"].publish(numpy_to_image(frame.rgb, "rgb8", header))
        self._pubs["camera_info"].publish(info)
        if "depth" in self._pubs:
            self._pubs["depth"].publish(numpy_to_image(frame.depth, "32FC1", header))
        t = frame.t_world_cam  # the pose of the snapshot just rendered
        pose = PoseStamped(header=make_header(frame.stamp_ns, p["world_frame"]))
        pose.pose.position.x, pose.pose.position.y, pose.pose.position.z = (
            float(v) for v in t[:3, 3])
        quat = np.empty(4)
        mujoco.mju_mat2Quat(quat, t[:3, :3].reshape(-1))
        pose.pose.orientation.w, pose.pose.orientation.x = float(quat[0]), float(quat[1])
        pose.pose.orientation.y, pose.pose.orientation.z = float(quat[2]), float(quat[3])
        self._pubs["camera_pose"].publish(pose)
        self._meters["camera"].tick()

    def _publish_lidar(self, source=None, stamp_ns: int = 0) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        scan = self.lidar.scan(source, stamp_ns)
        self._sensor_ms["scan_ms"] = (time.perf_counter() - t0) * 1e3
        with self._publish_lock:
            if self._stop.is_set():  # stopped during the scan
                return
            header = make_header(scan.stamp_ns, self.params["world_frame"])
            self._pubs["points"].publish(xyz_to_pointcloud2(scan.points, header))
        self._meters["lidar"].tick()

    # ---- inputs ----------------------------------------------------------------------------
    def _on_joint_command(self, msg: JointState) -> None:
        if not self._active or self.world is None:
            self.counters.inc("joint_command_inactive")
            return
        pos = list(msg.position)
        known = (*JOINT_NAMES, GRIPPER_JOINT)
        if msg.name:
            if len(msg.name) != len(pos):
                self.drop("joint_command_bad_length",
                          f"{len(msg.name)} names but {len(pos)} positions")
                return
            unknown = [n for n in msg.name if n not in known]
            if unknown or len(set(msg.name)) != len(msg.name):
                self.drop("joint_command_unknown_joint",
                          f"unknown or repeated joint names {unknown or list(msg.name)}")
                return
        elif len(pos) != len(JOINT_NAMES):
            self.drop("joint_command_bad_length",
                      f"{len(pos)} unnamed positions, expected {len(JOINT_NAMES)}")
            return
        if not all(math.isfinite(v) for v in pos):
            self.drop("joint_command_nonfinite", f"positions {pos}")
            return
        gripper = None
        if msg.name:  # a named subset: the other joints keep their targets
            q = self.world.joint_targets()
            arm = False
            for n, v in zip(msg.name, pos, strict=True):
                if n == GRIPPER_JOINT:
                    gripper = v
                else:
                    q[JOINT_NAMES.index(n)] = v
                    arm = True
            if not arm:
                q = None
        else:
            q = np.asarray(pos, dtype=np.float64)
        clamped = False
        if q is not None:
            applied = self.world.set_joint_targets(q)
            clamped = not np.allclose(applied, q)
        if gripper is not None:  # m, finger position (0 = open)
            clamped |= self.world.set_gripper_target(gripper) != gripper
        if clamped:
            self.counters.inc("joint_command_clamped")
        self.counters.inc("joint_command_applied")

    def _on_reset(self, req: ResetWorld.Request, resp: ResetWorld.Response) -> Any:
        if not self._active or self.world is None:
            resp.success, resp.message = False, "sim is not active"
            return resp
        goal = str(req.goal_object)
        if goal and goal not in {o.name for o in self.world.info.objects if o.is_free}:
            resp.success, resp.message = False, (f"goal_object '{goal}': not a task object of "
                                                 "this world")
            return resp
        try:
            self.world.reset(int(req.seed))
        except (ValueError, RuntimeError) as exc:
            resp.success, resp.message = False, str(exc)
            return resp
        self._goal = goal
        self._episode += 1
        if self._gt_due is not None:
            self._gt_due.next_ns = 0  # publish the new layout with the next batch
        self.counters.inc("resets")
        resp.success = True
        resp.seed = int(req.seed)
        resp.objects = list(self.world.task_objects)
        resp.message = (f"reset with seed {req.seed} at sim time "
                        f"{self.world.sim_time_ns / 1e9:.3f} s: {', '.join(resp.objects)}")
        return resp

    # ---- diagnostics -----------------------------------------------------------------------
    def _status(self) -> tuple[int, str, dict]:
        rates = {f"{k}_rate_hz": round(m.rate(), 2) for k, m in self._meters.items()}
        sim_rate = rates.pop("physics_rate_hz")
        asked = self.params["physics_rate_hz"] * self.params["real_time_factor"]
        rtf = sim_rate / self.params["physics_rate_hz"]
        values = {"physics_steps_per_s": sim_rate, "real_time_factor_achieved": round(rtf, 3),
                  **rates, **{k: round(v, 2) for k, v in self._sensor_ms.items()},
                  "sim_time_s": round(self.world.sim_time_ns / 1e9, 3) if self.world else 0.0}
        level, message = DiagnosticStatus.OK, "ok"
        if self._active and sim_rate < 0.8 * asked:
            level, message = DiagnosticStatus.WARN, f"physics behind: {rtf:.2f}x real time"
        return level, message, values


def main(args: list[str] | None = None) -> int:
    return run_node(SimNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
