"""perception node: camera image(s) + CameraInfo + LiDAR cloud -> PerceptionResult.

Thin ROS shell around `core.PerceptionCore` (the reference model, or a user's TorchScript /
ExportedProgram / ONNX model behind an output contract: parameters model.path, model.outputs,
see kestrel_models.perception.external). Inputs (SENSOR_QOS) land in fixed-size
histories (`core.sync.FrameSynchronizer`); the NEWEST synchronised set is processed (model,
result published on `~/output/result`, COMMAND_QOS) by default in the subscription callback
that completed it (`processing`: 'callback'; 'worker' = a worker thread woken by the
callbacks). Bad input is dropped and counted by name on /diagnostics, never crashes the node.
Per sensor, /diagnostics counts the messages taken (received_camera_<i>, received_lidar) and
those overwritten before the node took them (lost_camera_<i>, lost_lidar: the publisher's
sequence numbers, from the subscriptions' message info; core/loss.py).

Latency (measured, docs/benchmarks/perception_node_*.md): receipt of the set's last message
-> publish = wait + the core's stages + build. Every torch call releases the GIL; with
Python's default 5 ms switch interval a busy second Python thread (the executor taking the
next camera messages) made each such call wait up to 5 ms, so the node sets
`gil_switch_interval_us` (200) and, in callback mode, takes no input message while a set is
processed (the subscriptions' callback group is busy, rclpy leaves them out of the wait set).

Topics (i = 0 .. num_cameras-1):
  ~/input/camera_<i>/image        sensor_msgs/Image rgb8 or bgr8
  ~/input/camera_<i>/camera_info  sensor_msgs/CameraInfo (K, size; stamp matched to the image)
  ~/input/camera_<i>/pose         geometry_msgs/PoseStamped, optional: pose of the camera
                                  OPTICAL frame (x right, y down, z forward) in `frame_id`;
                                  overrides the `camera_poses` parameter once received
  ~/input/points                  sensor_msgs/PointCloud2 (x, y, z) in `frame_id`
  ~/output/result                 kestrel_interfaces/PerceptionResult; masks (mono8) and
                                  depths (`output.depth_encoding`: 16UC1 mm with 0 = no value, or
                                  32FC1 m) subsampled by `output.stride` s: ceil(H/s) x
                                  ceil(W/s), pixel (i, j) = input pixel (s*i, s*j), so the
                                  matching intrinsics are K with fx, fy, cx, cy divided by s
  ~/output/debug_image            sensor_msgs/Image rgb8, cameras side by side, mask + boxes
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from typing import Any

import numpy as np
from diagnostic_msgs.msg import DiagnosticStatus
from geometry_msgs.msg import PoseStamped
from kestrel_common.base_node import COMMAND_QOS, SENSOR_QOS, KestrelLifecycleNode, run_node
from kestrel_common.conversions import make_header, numpy_to_image
from kestrel_common.counters import StageTimer
from kestrel_interfaces.msg import PerceptionResult
from kestrel_models.perception import compiled as region_compiled
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.lifecycle import LifecycleState, TransitionCallbackReturn
from rclpy.serialization import deserialize_message, serialize_message
from sensor_msgs.msg import CameraInfo, Image, PointCloud2

from kestrel_perception.core import STAGES, CameraModel, FrameSet, InputError, PerceptionCore
from kestrel_perception.core.draw import render_debug
from kestrel_perception.core.health import COUNTERS, REASON_COUNTER, perception_status
from kestrel_perception.core.input_rings import RingLayout
from kestrel_perception.core.loss import InputLoss
from kestrel_perception.core.params import (
    RUNTIME_PARAMS,
    SPECS,
    core_config,
    enabled_heads,
    missing_model_heads,
    no_head_enabled,
    pose_to_matrix,
    resolve_receive,
    validate_perception_params,
)
from kestrel_perception.core.receivers import InputReceivers, ReceiverError
from kestrel_perception.core.sync import FrameSynchronizer, SyncedSet
from kestrel_perception.perception_inputs import PerceptionInputs
from kestrel_perception.result_msg import ResultBuilder, ResultPublisher, matches_rmw

HISTORY = 8  # messages kept per input stream for stamp matching


class PerceptionNode(PerceptionInputs, KestrelLifecycleNode):
    """Lifecycle shell: parameters -> PerceptionCore; topics <-> FrameSet/PerceptionOutput.
    The input callbacks are PerceptionInputs' (perception_inputs.py)."""

    runtime_params = frozenset(RUNTIME_PARAMS)

    def __init__(self, **kwargs: Any) -> None:  # kwargs: rclpy Node's (context, overrides)
        super().__init__("perception", SPECS, **kwargs)
        for name in COUNTERS:
            self.counters.inc(name, 0)
        self.core: PerceptionCore | None = None
        self.sync: FrameSynchronizer | None = None
        self.timer = StageTimer((*STAGES, "wait", "total"))
        self._compile_errors_logged = 0  # region_compile failures already logged
        self._subs: list[Any] = []
        self._result_pub = None
        self._debug_pub = None
        self._poses: list[np.ndarray] = []  # per camera T_frame_from_cam [4,4]
        self._active = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._inline = True  # parameter processing == "callback"
        self._proc_lock = threading.Lock()  # one set at a time; cleanup waits for it
        self._results: ResultPublisher | None = None  # CDR bytes or message objects
        self._receivers: InputReceivers | None = None  # receive.mode == "processes"
        self._release_timer = None  # calls _ready() every cloud_timeout / 2
        self._runtime: dict[str, Any] = {}
        # messages taken and lost before this node saw them (core/loss.py): per camera image
        # stream, then the LiDAR
        self._gaps: list[InputLoss] = []
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
        why = self._no_model_head(p)
        if why:
            self.get_logger().error(f"configure failed: {why}")
            self.core = None
            return TransitionCallbackReturn.FAILURE
        if self.core.external is not None and self.core.external.host_outputs:
            self.get_logger().warning(
                f"model.path: the model returns {self.core.external.host_outputs} on the CPU, "
                f"not on {self.core.device}: copied to the device every frame (make them on "
                "the input's device to avoid it)")
        n = p["num_cameras"]
        self._inline = p["processing"] == "callback"
        if p["gil_switch_interval_us"] > 0:  # process-wide: this process is the node
            # +0.5 us: CPython truncates the interval to whole microseconds
            sys.setswitchinterval((p["gil_switch_interval_us"] + 0.5) * 1e-6)
        self.sync = FrameSynchronizer(n, p["sync.slop"], HISTORY, count=self.counters.inc,
                                      cloud_required=p["sync.cloud_required"],
                                      cloud_timeout_s=p["sync.cloud_timeout"],
                                      jump_back_s=p["sync.jump_back"], on_jump=self._on_jump)
        self._gaps = [InputLoss(f"camera_{i}", p["sync.jump_back"], self.counters.inc)
                      for i in range(n)]
        self._gaps.append(InputLoss("lidar", p["sync.jump_back"], self.counters.inc))
        for g in self._gaps:
            self.counters.inc(g.received_counter, 0)
            self.counters.inc(g.counter, 0)
        poses = p["camera_poses"]
        self._poses = [pose_to_matrix(poses[7 * i: 7 * i + 7]) if poses else np.eye(4)
                       for i in range(n)]
        self._runtime = {k: p[k] for k in RUNTIME_PARAMS}
        builder = ResultBuilder(p["frame_id"], self.core.config.class_names)
        # results go out as CDR bytes when this encoder writes what the rmw would
        cdr = matches_rmw(builder, serialize_message, deserialize_message)
        if not cdr:
            self.get_logger().warning(
                "result CDR encoder differs from the rmw's serialisation of PerceptionResult "
                "(changed .msg or rmw?): publishing message objects (slower)")
        p["receive.mode"] = resolve_receive(p["receive.mode"], self.core.device.type, n)
        in_node = p["receive.mode"] == "executor"
        if in_node and p["receive.cpus"]:
            self.get_logger().warning("receive.cpus is set but the inputs are received by the "
                                      "executor (receive.mode resolved to 'executor'): not used")
        if not in_node and not self._start_receivers(p):  # before any ROS entity exists:
            self.core = self.sync = None  # a failed configure leaves nothing behind
            return TransitionCallbackReturn.FAILURE
        self._result_pub = self.create_publisher(PerceptionResult, "~/output/result",
                                                 COMMAND_QOS)
        self._results = ResultPublisher(builder, self._result_pub, cdr)
        if p["output.debug_image"]:
            self._debug_pub = self.create_publisher(Image, "~/output/debug_image", SENSOR_QOS)
        group = MutuallyExclusiveCallbackGroup()
        for i in range(n):
            if in_node:
                self._subs.append(self.create_subscription(  # (with the message info:
                    Image, f"~/input/camera_{i}/image",  # its sequence number, core/loss.py)
                    lambda m, info, i=i: self._on_image(i, m, info),
                    SENSOR_QOS, callback_group=group))
                self._subs.append(self.create_subscription(  # (else: the receivers take it)
                    CameraInfo, f"~/input/camera_{i}/camera_info",
                    lambda m, i=i: self._on_info(i, m), SENSOR_QOS, callback_group=group))
            self._subs.append(self.create_subscription(
                PoseStamped, f"~/input/camera_{i}/pose", lambda m, i=i: self._on_pose(i, m),
                SENSOR_QOS, callback_group=group))
        # releases a set that waits for the cloud of a LiDAR that fell silent (core/sync.py):
        # no message may come to trigger it; in the subscriptions' group (never concurrent)
        self._release_timer = self.create_timer(p["sync.cloud_timeout"] / 2, self._ready,
                                                callback_group=group)
        if in_node:
            # (two arguments: rclpy then passes the message info, as for the images)
            self._subs.append(self.create_subscription(
                PointCloud2, "~/input/points", lambda m, info: self._on_points(m, info),
                SENSOR_QOS, callback_group=group))
        graphs = self.core.region.graphs
        for why in (graphs.failed.values() if graphs is not None else ()):
            self.get_logger().warning(f"device region signature runs without a CUDA graph: {why}")
        self._log_compile_errors()
        m = self.core.config.model
        self.get_logger().info(
            f"configured: {n} camera(s), ResNet-{m.backbone_depth} width {m.base_width}, "
            f"FPN {m.fpn_channels}, device {p['runtime.device']}, forward "
            f"{self._forward_text()}, heads {sorted(self._heads())}, "
            f"inputs received by the {p['receive.mode']}, processing in the {p['processing']}, "
            f"GIL switch interval {round(sys.getswitchinterval() * 1e6)} us, results published "
            f"as {'CDR bytes' if cdr else 'message objects'}")
        return TransitionCallbackReturn.SUCCESS

    def _forward_text(self) -> str:
        """How the forward runs, for the configure log line."""
        assert self.core is not None
        cfg = self.core.config
        if cfg.model_path:
            return f"user model ({self.core.external.format if self.core.external else '?'})"
        return cfg.options.describe()

    def _start_receivers(self, p: dict[str, Any]) -> bool:
        """receive.mode 'processes': the receiver processes (core/receivers.py), subscribed to
        this node's resolved (remapped) image and cloud topics."""
        n = p["num_cameras"]
        topics = [self.resolve_topic_name(f"~/input/camera_{i}/image") for i in range(n)]
        topics.append(self.resolve_topic_name("~/input/points"))
        infos = [self.resolve_topic_name(f"~/input/camera_{i}/camera_info") for i in range(n)]
        w, h = p["warmup_size"]
        use_sim = self.get_parameter("use_sim_time").value
        # each sensor's ring: HISTORY + 3 slots held by this node (its synchroniser history,
        # a set being processed, pending copies) + 2 for the receiver (input_rings.py)
        self._receivers = InputReceivers(
            RingLayout(n, h, w, p["lidar.max_points"], slots=HISTORY + 5), topics, self._take_image,
            self._take_points,
            frame_id=p["frame_id"], node_name=self.get_name(), namespace=self.get_namespace(),
            ros_args=["-p", f"use_sim_time:={'true' if use_sim else 'false'}"],
            pool=HISTORY + 3, start_timeout_s=p["receive.start_timeout"],
            pin=self.core.staging.pin_host_memory, info_topics=infos, on_info=self._take_info,
            cpus=p["receive.cpus"])
        try:
            self._receivers.start()
        except (ReceiverError, OSError) as exc:
            self._receivers = None
            self.get_logger().error(f"configure failed: parameter 'receive.mode' = 'processes': "
                                   f"{exc}")
            return False
        self.get_logger().info(f"input receivers started: {topics + infos}; "
                               f"{self._receivers.pin_status}; {self._receivers.cpu_status}")
        return True

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop.clear()
        with self._proc_lock:  # nothing from before: receivers' slots were reused meanwhile
            if self.sync is not None:
                self.sync.clear()
            for g in self._gaps:  # no gap across the time inactive
                g.restart()
        self._active = True
        if not self._inline:
            self._worker = threading.Thread(target=self._work, name="perception_worker",
                                            daemon=True)
            self._worker.start()
        self.start_diagnostics(self._status)
        self.get_logger().info("active")
        return super().on_activate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.stop_workers()
        if self._receivers is not None:
            self._receivers.close()
            self._receivers = None
        for sub in self._subs:
            self.destroy_subscription(sub)
        self._subs = []
        if self._release_timer is not None:
            self.destroy_timer(self._release_timer)
            self._release_timer = None
        for pub in (self._result_pub, self._debug_pub):
            if pub is not None:
                self.destroy_publisher(pub)
        self._result_pub = self._debug_pub = None
        self._results = None
        with self._proc_lock:  # a set being processed in a callback finishes first
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
        if self._proc_lock.acquire(timeout=10.0):  # callback mode: the current set ends
            self._proc_lock.release()

    # ---- parameters changed at run time -----------------------------------------------------
    def _check_runtime_params(self, params: list) -> Any:
        from rcl_interfaces.msg import SetParametersResult
        new = {k: self.get_parameter(k).value for k in
               ("enable_detection", "enable_segmentation", "enable_depth")}
        new.update({p.name: p.value for p in params if p.name in new})
        why = no_head_enabled(new) or self._no_model_head(new)
        if why:
            return SetParametersResult(successful=False, reason=why)
        return SetParametersResult(successful=True)

    def _no_model_head(self, enabled: dict[str, Any]) -> str:
        """Why the enabled heads leave the configured model none of its own ('' if fine)."""
        return "" if self.core is None else missing_model_heads(enabled, self.core.heads)

    def _heads(self) -> frozenset[str]:
        return enabled_heads(self._runtime)

    def _refresh_runtime(self) -> None:
        """Apply thresholds / enabled heads changed with `ros2 param set` (same weights)."""
        assert self.core is not None
        now = {k: self.get_parameter(k).value for k in RUNTIME_PARAMS}
        if now == self._runtime:
            return
        try:
            model = dataclasses.replace(self.core.config.model,
                                        score_threshold=float(now["detection.score_threshold"]),
                                        nms_iou=float(now["detection.nms_iou"]))
        except ValueError as exc:
            self.get_logger().error(f"runtime parameter change ignored: {exc}")
            return
        self.core.config = dataclasses.replace(self.core.config, model=model)
        self._runtime = now
        self.get_logger().info(f"runtime parameters applied: {now}")

    # ---- processing: in the completing callback, or in the worker thread ----------------------
    def _drain(self) -> None:
        while self._active and not self._stop.is_set() and self.sync is not None:
            synced = self.sync.pop_newest_set()
            if synced is None:
                break
            try:
                self._refresh_runtime()
                self._process(synced)
            except Exception as exc:  # never let the worker die; count and log
                self.drop("processing_error", f"{type(exc).__name__}: {exc}")

    def _work(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(timeout=0.1)
            self._wake.clear()
            with self._proc_lock:
                self._drain()

    def _process(self, s: SyncedSet) -> None:
        assert self.core is not None
        t_start = time.monotonic()
        cams = [CameraModel(info.data[0], info.data[1], info.data[2], img.data[1] or f"cam{i}",
                            self._poses[i])
                for i, (img, info) in enumerate(zip(s.images, s.infos, strict=True))]
        frames = FrameSet(s.stamp_ns, [img.data[0] for img in s.images], cams,
                          s.cloud.data if s.cloud is not None else None)
        # worker thread + receiver processes: the receiver thread keeps claiming ring slots
        # while this frame runs (in callback mode that thread is the one running it)
        debug_images = [im.copy() for im in frames.images] if (
            self._debug_pub is not None and self._receivers is not None
            and not self._inline) else None
        try:
            out = self.core.process(frames, self._heads())
        except InputError as exc:
            self.drop(REASON_COUNTER.get(exc.reason_code, "dropped_bad_image"), str(exc))
            return
        rx = self._receivers
        if rx is not None and not rx.intact([m.ticket for m in (*s.images, s.cloud) if m]):
            self.drop("dropped_input_overwritten", "an input's shared-memory slot was reused "
                      "while its set was processed: result not published")
            return
        if out.dropped_points:
            self.counters.inc("nan_points", out.dropped_points)
        if out.truncated_points:
            n = self.counters.inc("truncated_points", out.truncated_points)
            self.get_logger().warning(
                f"a LiDAR cloud of {out.used_points + out.truncated_points + out.dropped_points}"
                f" points is larger than the largest point bucket: {out.truncated_points} "
                f"left out, the rest an even subsample (total {n}; raise 'lidar.point_buckets')",
                throttle_duration_sec=5.0)
        if out.runtime_fallback:
            self.counters.inc("runtime_shape_fallbacks")
        if out.nms_fallback:
            self.counters.inc("nms_slow_path")
        # extra timings: wait (last message received -> processing starts), build (this
        # message), and on CUDA the host clock of the device stages (<stage>_host)
        t_build = time.monotonic()
        extra = {f"{k}_host": v for k, v in out.host_timings.items()}
        extra["wait"] = t_start - s.newest_recv_s
        # input_age: age of the set (node clock - header stamp) when its last message arrived
        # = publish + DDS + deserialisation of the inputs, as seen by this node
        extra["input_age"] = ((self.get_clock().now().nanoseconds - s.stamp_ns) * 1e-9
                              - (time.monotonic() - s.newest_recv_s))
        # input_spread: first -> last message of the set received (the node's serial takes
        # and callbacks when the sensors publish in parallel)
        extra["input_spread"] = s.newest_recv_s - s.oldest_recv_s
        if s.cloud is not None:  # cloud receipt - the last image's: > 0 when the cloud is last
            extra["cloud_lag"] = s.cloud.recv_s - max(img.recv_s for img in s.images)
        if rx is not None and self._inline and threading.current_thread() is rx.thread:
            extra.update(rx.timings(s.newest_recv_s))  # this set completed by the receivers
        build, latency = self._results.publish(s.stamp_ns, [img.stamp_ns for img in s.images],
                                               cams, out, extra, t_build, s.newest_recv_s)
        for name, dt in {**out.timings, **extra, "build": build}.items():
            self.timer.add(name, dt)
        self.timer.add("total", latency)
        self.counters.inc("processed")
        if self._debug_pub is not None:
            # (receive: processes: the images are ring slots, written again after `pool` newer
            # messages of their sensor; a slow frame could see them overwritten by now, so
            # the debug image is drawn from copies taken when the frame started)
            canvas = render_debug(debug_images or frames.images, out.detections,
                                  masks=out.masks, mask_stride=out.output_stride)
            self._debug_pub.publish(numpy_to_image(
                canvas, "rgb8", make_header(s.images[0].stamp_ns, cams[0].frame_id)))

    # ---- diagnostics ----------------------------------------------------------------------------
    def _log_compile_errors(self) -> None:
        """Log (once each) why the region's compiled steps were switched off, if they were."""
        errs = region_compiled.errors
        if self.core is not None and self.core.region.compile:
            for why in errs[self._compile_errors_logged:]:
                self.get_logger().warning(f"device region runs uncompiled (region_compile): "
                                          f"{why}")
        self._compile_errors_logged = len(errs)

    def _status(self) -> tuple[int, str, dict]:
        self._log_compile_errors()  # a failure after configure shows in the log too
        level, message, values = perception_status(
            self.core, self._results, self._receivers, self.counters,
            self.timer.summary((50.0, 99.0)), self.params.get("target_fps", 10.0))
        return {"ok": DiagnosticStatus.OK, "warn": DiagnosticStatus.WARN,
                "error": DiagnosticStatus.ERROR}[level], message, values


def main(args: list[str] | None = None) -> int:
    return run_node(PerceptionNode, args)


if __name__ == "__main__":
    raise SystemExit(main())
