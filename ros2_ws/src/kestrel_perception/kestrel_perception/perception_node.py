"""perception node: camera image(s) + CameraInfo + LiDAR cloud -> PerceptionResult.

Thin ROS shell around `core.PerceptionCore` (the reference model, or a user's TorchScript /
ExportedProgram / ONNX model behind an output contract: parameters model_path, model_outputs,
see kestrel_models.perception.external). Inputs (SENSOR_QOS) land in fixed-size
histories (`core.sync.FrameSynchronizer`); a worker thread always takes the NEWEST
synchronised set, runs the model and publishes `~/output/result` (COMMAND_QOS). Bad input is
dropped and counted by name on /diagnostics, never crashes the node.

Topics (i = 0 .. num_cameras-1):
  ~/input/camera_<i>/image        sensor_msgs/Image rgb8 or bgr8
  ~/input/camera_<i>/camera_info  sensor_msgs/CameraInfo (K, size; stamp matched to the image)
  ~/input/camera_<i>/pose         geometry_msgs/PoseStamped, optional: pose of the camera
                                  OPTICAL frame (x right, y down, z forward) in `frame_id`;
                                  overrides the `camera_poses` parameter once received
  ~/input/points                  sensor_msgs/PointCloud2 (x, y, z) in `frame_id`
  ~/output/result                 kestrel_interfaces/PerceptionResult; masks (mono8) and
                                  depths (`depth_encoding`: 16UC1 mm with 0 = no value, or
                                  32FC1 m) subsampled by `output_stride` s: ceil(H/s) x
                                  ceil(W/s), pixel (i, j) = input pixel (s*i, s*j), so the
                                  matching intrinsics are K with fx, fy, cx, cy divided by s
  ~/output/debug_image            sensor_msgs/Image rgb8, cameras side by side with boxes
"""

from __future__ import annotations

import array
import dataclasses
import threading
import time
from typing import Any

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus
from geometry_msgs.msg import PoseStamped
from kestrel_common.base_node import COMMAND_QOS, SENSOR_QOS, KestrelLifecycleNode, run_node
from kestrel_common.conversions import (
    ConversionError,
    camera_info_to_k,
    image_to_numpy,
    make_header,
    numpy_to_image,
    pointcloud2_to_xyz,
    stamp_to_ns,
)
from kestrel_common.counters import StageTimer
from kestrel_interfaces.msg import Detection2D, ObjectHypothesisWithPose, PerceptionResult
from kestrel_interfaces.msg import StageTiming
from kestrel_models.perception import PositionSource
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from sensor_msgs.msg import CameraInfo, Image, PointCloud2

from kestrel_perception.core import (
    STAGES,
    CameraModel,
    FrameSet,
    InputError,
    PerceptionCore,
    PerceptionOutput,
)
from kestrel_perception.core.draw import render_debug
from kestrel_perception.core.sync import FrameSynchronizer, Stamped, SyncedSet
from kestrel_perception.core.params import (
    RUNTIME_PARAMS,
    SPECS,
    core_config,
    pose_to_matrix,
    validate_perception_params,
)

# counters shown on /diagnostics from the start (value 0)
COUNTERS = ("processed", "dropped_bad_encoding", "dropped_bad_image", "dropped_size_mismatch",
            "dropped_bad_camera_info", "dropped_bad_pose", "dropped_bad_cloud",
            "dropped_too_many_points", "out_of_sync", "skipped_stale", "processing_error",
            "nan_points", "truncated_points", "runtime_shape_fallbacks", "nms_slow_path")
# core InputError reason code -> counter
REASON_COUNTER = {"bad_image": "dropped_bad_image", "size_mismatch": "dropped_size_mismatch",
                  "mixed_sizes": "dropped_size_mismatch", "bad_camera": "dropped_bad_camera_info",
                  "bad_points": "dropped_bad_cloud", "too_many_points": "dropped_too_many_points",
                  "no_images": "dropped_bad_image"}
# nominal (not calibrated) 1-sigma position uncertainty written into the covariance, m
POSITION_STD_LIDAR = 0.05
POSITION_STD_DEPTH_REL = 0.1  # fraction of the range for predicted-depth positions
HISTORY = 8  # messages kept per input stream for stamp matching


def map_image(arr: np.ndarray, encoding: str, header: Any) -> Image:
    """[H,W] mono8 / 16UC1 / 32FC1 map (e.g. a view into the core's pinned buffer) -> Image
    with ONE memcpy into an array('B') (assigning bytes would make the generated setter check
    every byte in Python)."""
    a = np.ascontiguousarray(arr)
    msg = Image()
    msg.header = header
    msg.height, msg.width = int(a.shape[0]), int(a.shape[1])
    msg.encoding = encoding
    msg.is_bigendian = 0
    msg.step = int(a.shape[1] * a.itemsize)
    data = array.array("B")
    data.frombytes(memoryview(a).cast("B"))
    msg.data = data
    return msg


class PerceptionNode(KestrelLifecycleNode):
    """Lifecycle shell: parameters -> PerceptionCore; topics <-> FrameSet/PerceptionOutput."""

    def __init__(self) -> None:
        super().__init__("perception", SPECS)
        for name in COUNTERS:
            self.counters.inc(name, 0)
        self.core: PerceptionCore | None = None
        self.sync: FrameSynchronizer | None = None
        self.timer = StageTimer((*STAGES, "wait", "total"))
        self._subs: list[Any] = []
        self._result_pub = None
        self._debug_pub = None
        self._poses: list[np.ndarray] = []  # per camera T_frame_from_cam [4,4]
        self._active = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._runtime: dict[str, Any] = {}
        self.add_on_set_parameters_callback(self._check_runtime_params)

    # ---- lifecycle ------------------------------------------------------------------------
    def validate_extra(self, values: dict[str, Any]) -> None:
        validate_perception_params(values)

    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        p = self.load_params()
        if p is None:
            return TransitionCallbackReturn.FAILURE
        try:
            self.core = PerceptionCore(core_config(p))
        except (ValueError, RuntimeError) as exc:  # names the parameter and value
            self.get_logger().error(f"configure failed: {exc}")
            return TransitionCallbackReturn.FAILURE
        n = p["num_cameras"]
        self.sync = FrameSynchronizer(n, p["sync_slop"], HISTORY, count=self.counters.inc)
        poses = p["camera_poses"]
        self._poses = [pose_to_matrix(poses[7 * i: 7 * i + 7]) if poses else np.eye(4)
                       for i in range(n)]
        self._runtime = {k: p[k] for k in RUNTIME_PARAMS}
        self._result_pub = self.create_publisher(PerceptionResult, "~/output/result",
                                                 COMMAND_QOS)
        if p["publish_debug_image"]:
            self._debug_pub = self.create_publisher(Image, "~/output/debug_image", SENSOR_QOS)
        group = MutuallyExclusiveCallbackGroup()
        for i in range(n):
            self._subs += [
                self.create_subscription(Image, f"~/input/camera_{i}/image",
                                         lambda m, i=i: self._on_image(i, m), SENSOR_QOS,
                                         callback_group=group),
                self.create_subscription(CameraInfo, f"~/input/camera_{i}/camera_info",
                                         lambda m, i=i: self._on_info(i, m), SENSOR_QOS,
                                         callback_group=group),
                self.create_subscription(PoseStamped, f"~/input/camera_{i}/pose",
                                         lambda m, i=i: self._on_pose(i, m), SENSOR_QOS,
                                         callback_group=group)]
        self._subs.append(self.create_subscription(PointCloud2, "~/input/points",
                                                   self._on_points, SENSOR_QOS,
                                                   callback_group=group))
        m = self.core.config.model
        self.get_logger().info(
            f"configured: {n} camera(s), ResNet-{m.backbone_depth} width {m.base_width}, "
            f"FPN {m.fpn_channels}, device {p['device']}, heads {sorted(self._heads())}")
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop.clear()
        self._active = True
        self._worker = threading.Thread(target=self._work, name="perception_worker",
                                        daemon=True)
        self._worker.start()
        self.start_diagnostics(self._status)
        self.get_logger().info("active")
        return super().on_activate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_workers()
        for sub in self._subs:
            self.destroy_subscription(sub)
        self._subs = []
        for pub in (self._result_pub, self._debug_pub):
            if pub is not None:
                self.destroy_publisher(pub)
        self._result_pub = self._debug_pub = None
        self.core = None
        self.sync = None
        return TransitionCallbackReturn.SUCCESS

    def stop_workers(self) -> None:
        self._active = False
        self._stop.set()
        self._wake.set()
        worker, self._worker = self._worker, None
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout=10.0)

    # ---- parameters changed at run time -----------------------------------------------------
    def _check_runtime_params(self, params: list) -> Any:
        from rcl_interfaces.msg import SetParametersResult
        new = {k: self.get_parameter(k).value for k in
               ("enable_detection", "enable_segmentation", "enable_depth")}
        new.update({p.name: p.value for p in params if p.name in new})
        if not any(new.values()):
            return SetParametersResult(successful=False, reason=(
                "parameters 'enable_detection', 'enable_segmentation', 'enable_depth' are all "
                "false: at least one head must stay enabled"))
        return SetParametersResult(successful=True)

    def _heads(self) -> frozenset[str]:
        r = self._runtime
        return frozenset(h for h, on in (("detection", r["enable_detection"]),
                                         ("segmentation", r["enable_segmentation"]),
                                         ("depth", r["enable_depth"])) if on)

    def _refresh_runtime(self) -> None:
        """Apply thresholds / enabled heads changed with `ros2 param set` (same weights)."""
        assert self.core is not None
        now = {k: self.get_parameter(k).value for k in RUNTIME_PARAMS}
        if now == self._runtime:
            return
        try:
            model = dataclasses.replace(self.core.config.model,
                                        score_threshold=float(now["score_threshold"]),
                                        nms_iou=float(now["nms_iou"]),
                                        max_detections=int(now["max_detections"]))
        except ValueError as exc:
            self.get_logger().error(f"runtime parameter change ignored: {exc}")
            return
        self.core.config = dataclasses.replace(self.core.config, model=model)
        self._runtime = now
        self.get_logger().info(f"runtime parameters applied: {now}")

    # ---- input callbacks (cheap: convert, validate, store) -------------------------------------
    def _on_image(self, cam: int, msg: Image) -> None:
        if not self._active or self.sync is None:
            return
        try:
            rgb = image_to_numpy(msg, accept=("rgb8", "bgr8"))  # [H,W,3] uint8 view
        except ConversionError as exc:
            reason = "dropped_bad_encoding" if exc.reason == "bad_encoding" else \
                "dropped_bad_image"
            self.drop(reason, f"camera {cam}: {exc}")
            return
        self.sync.add_image(cam, Stamped(stamp_to_ns(msg.header.stamp), time.monotonic(),
                                         (rgb, msg.header.frame_id)))
        self._wake.set()

    def _on_info(self, cam: int, msg: CameraInfo) -> None:
        if not self._active or self.sync is None:
            return
        try:
            k = camera_info_to_k(msg)
        except ConversionError as exc:
            self.drop("dropped_bad_camera_info", f"camera {cam}: {exc}")
            return
        self.sync.add_info(cam, Stamped(stamp_to_ns(msg.header.stamp), time.monotonic(),
                                        (k, int(msg.width), int(msg.height))))
        self._wake.set()

    def _on_pose(self, cam: int, msg: PoseStamped) -> None:
        if not self._active:
            return
        frame = self.params["frame_id"]
        p, q = msg.pose.position, msg.pose.orientation
        try:
            if msg.header.frame_id not in ("", frame):
                raise ValueError(f"frame '{msg.header.frame_id}' is not frame_id '{frame}'")
            self._poses[cam] = pose_to_matrix([p.x, p.y, p.z, q.x, q.y, q.z, q.w])
        except ValueError as exc:
            self.drop("dropped_bad_pose", f"camera {cam}: {exc}")

    def _on_points(self, msg: PointCloud2) -> None:
        if not self._active or self.sync is None:
            return
        n = int(msg.width) * int(msg.height)
        if n > self.params["max_points"]:  # before touching the data
            self.drop("dropped_too_many_points",
                      f"{n} points > max_points {self.params['max_points']}")
            return
        frame = self.params["frame_id"]
        try:
            if msg.header.frame_id not in ("", frame):
                raise ConversionError("bad_cloud", f"cloud frame '{msg.header.frame_id}' is "
                                                   f"not frame_id '{frame}' (no TF here)")
            xyz = pointcloud2_to_xyz(msg)  # [N,3] float32, NaN kept
            if n > 0 and not np.isfinite(xyz).all(axis=1).any():
                raise ConversionError("bad_cloud", f"all {n} points are NaN/inf")
        except ConversionError as exc:
            self.drop("dropped_bad_cloud", str(exc))
            return
        self.sync.add_cloud(Stamped(stamp_to_ns(msg.header.stamp), time.monotonic(), xyz))

    # ---- worker ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=0.1)
            self._wake.clear()
            while not self._stop.is_set() and self.sync is not None:
                synced = self.sync.pop_newest_set()
                if synced is None:
                    break
                try:
                    self._refresh_runtime()
                    self._process(synced)
                except Exception as exc:  # never let the worker die; count and log
                    self.drop("processing_error", f"{type(exc).__name__}: {exc}")

    def _process(self, s: SyncedSet) -> None:
        assert self.core is not None
        t_start = time.monotonic()
        cams = [CameraModel(info.data[0], info.data[1], info.data[2], img.data[1] or f"cam{i}",
                            self._poses[i])
                for i, (img, info) in enumerate(zip(s.images, s.infos, strict=True))]
        frames = FrameSet(s.stamp_ns, [img.data[0] for img in s.images], cams,
                          s.cloud.data if s.cloud is not None else None)
        try:
            out = self.core.process(frames, self._heads())
        except InputError as exc:
            self.drop(REASON_COUNTER.get(exc.reason_code, "dropped_bad_image"), str(exc))
            return
        if out.dropped_points:
            self.counters.inc("nan_points", out.dropped_points)
        if out.truncated_points:
            self.counters.inc("truncated_points", out.truncated_points)
        if out.runtime_fallback:
            self.counters.inc("runtime_shape_fallbacks")
        if out.nms_fallback:
            self.counters.inc("nms_slow_path")
        msg = self._result_msg(s, cams, out)
        msg.timings.append(StageTiming(name="wait", duration=t_start - s.newest_recv_s))
        msg.latency = time.monotonic() - s.newest_recv_s
        self._result_pub.publish(msg)
        for name, dt in out.timings.items():
            self.timer.add(name, dt)
        self.timer.add("wait", t_start - s.newest_recv_s)
        self.timer.add("total", msg.latency)
        self.counters.inc("processed")
        if self._debug_pub is not None:
            canvas = render_debug(frames.images, out.detections)
            self._debug_pub.publish(numpy_to_image(
                canvas, "rgb8", make_header(s.images[0].stamp_ns, cams[0].frame_id)))

    def _result_msg(self, s: SyncedSet, cams: list[CameraModel], out: PerceptionOutput
                    ) -> PerceptionResult:
        frame = self.params["frame_id"]
        res = PerceptionResult()
        res.header = make_header(s.stamp_ns, frame)
        res.class_names = list(self.core.config.class_names)
        headers = [make_header(img.stamp_ns, cam.frame_id)
                   for img, cam in zip(s.images, cams, strict=True)]
        for det in out.detections:
            d = Detection2D()
            d.header = headers[det.camera_index]
            x1, y1, x2, y2 = (float(v) for v in det.box_xyxy)
            d.bbox.center.x, d.bbox.center.y = (x1 + x2) / 2, (y1 + y2) / 2
            d.bbox.size_x, d.bbox.size_y = x2 - x1, y2 - y1
            hyp = ObjectHypothesisWithPose()
            hyp.hypothesis.class_id = det.class_name
            hyp.hypothesis.score = float(det.score)
            hyp.pose.pose.orientation.w = 1.0
            if det.position is not None:
                px, py, pz = (float(v) for v in det.position)
                hyp.pose.pose.position.x, hyp.pose.pose.position.y = px, py
                hyp.pose.pose.position.z = pz
                cam_pos = cams[det.camera_index].T_base_from_cam[:3, 3]
                rng = float(np.linalg.norm(det.position - cam_pos))
                std = POSITION_STD_LIDAR if det.position_source == PositionSource.LIDAR else \
                    POSITION_STD_DEPTH_REL * rng
                cov = np.zeros(36)
                cov[[0, 7, 14]] = std * std
                hyp.pose.covariance = cov
            d.results = [hyp]
            d.camera_index = det.camera_index
            d.class_index = det.class_index
            d.position_source = int(det.position_source)
            d.position_frame_id = frame
            res.detections.append(d)
        res.masks = [map_image(m, "mono8", headers[i]) for i, m in enumerate(out.masks)]
        res.depths = [map_image(d, out.depth_encoding, headers[i])
                      for i, d in enumerate(out.depths)]
        res.timings = [StageTiming(name=k, duration=float(v)) for k, v in out.timings.items()]
        return res

    # ---- diagnostics ----------------------------------------------------------------------------
    def _status(self) -> tuple[int, str, dict]:
        values: dict[str, float] = {}
        summary = self.timer.summary((50.0, 99.0))
        for stage, q in summary.items():
            values[f"latency_{stage}_p50_s"] = q["p50"]
            values[f"latency_{stage}_p99_s"] = q["p99"]
        budget = 1.0 / float(self.params.get("target_fps", 10.0))
        p99 = summary["total"]["p99"]
        if p99 == p99 and p99 > budget:  # not NaN
            return (DiagnosticStatus.WARN, f"p99 latency {p99:.3f} s > 1/target_fps "
                                           f"{budget:.3f} s", values)
        return DiagnosticStatus.OK, "ok", values


def main(args: list[str] | None = None) -> int:
    return run_node(PerceptionNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
