"""The perception node's parameters (ParamSpecs) and their mapping to PerceptionCoreConfig.

No rclpy: the specs are plain data (kestrel_common.params), testable without ROS.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
from kestrel_common.params import ParamError, ParamSpec
from kestrel_models.perception import DEFAULT_BUCKETS, PerceptionConfig
from kestrel_models.perception.external import FORMATS, INPUT_FORMATS
from kestrel_models.perception.options import COMPILES, ENGINES, PRECISIONS, SWITCH

from .device_region import DEPTH_ENCODINGS, OUTPUT_STRIDES
from .perception_core import PerceptionCoreConfig
from .types import DEFAULT_CLASS_NAMES

_CONF = " Applied at configure."
_RUN = " Applied at run time (no reconfigure, same weights)."
_AUTO = " 'auto' = the fastest measured for the device (kestrel_models.perception.options)."

SPECS: tuple[ParamSpec, ...] = (
    ParamSpec("num_cameras", 1, "Number of cameras (topics ~/input/camera_<i>/...).",
              min=1, max=8, read_only=True),
    # ---- model: the reference architecture, or a user's own model file -------------------
    ParamSpec("model.backbone_depth", 18, "ResNet depth of the backbone." + _CONF,
              choices=(18, 34, 50)),
    ParamSpec("model.base_width", 16, "Channels of the ResNet stem (64 = real ResNet)." + _CONF,
              min=8, max=128, check=lambda v: None if v % 4 == 0 else "must be a multiple of 4"),
    ParamSpec("model.fpn_channels", 64, "Channels of the FPN and heads." + _CONF, min=8,
              max=1024, check=lambda v: None if v % 8 == 0 else "must be a multiple of 8"),
    ParamSpec("model.head_convs", 1, "3x3 convs per detection tower (FCOS: 4)." + _CONF,
              min=0, max=8),
    ParamSpec("model.class_names", list(DEFAULT_CLASS_NAMES),
              "Class names; index 0 is background (mask values index this list)." + _CONF),
    ParamSpec("model.max_depth", 20.0, "Upper bound of the predicted depth, m." + _CONF,
              min=0.1, max=1000.0),
    ParamSpec("model.weights_path", "", "state_dict file of the reference architecture "
              "(package://<pkg>/<path> or a file path); '' = random init from model.seed."
              + _CONF),
    ParamSpec("model.seed", 0, "Seed of the random initialisation." + _CONF, min=0,
              max=2**31 - 1),
    ParamSpec("model.path", "", "A user's own multi-task model instead of the reference "
              "architecture: TorchScript, ExportedProgram (.pt2) or ONNX file; '' = the "
              "reference model. Its outputs are declared in model.outputs; it runs as "
              "exported (runtime options resolve to fp32, no compile, no graph)." + _CONF),
    ParamSpec("model.format", "auto", "Format of model.path (auto = by extension)." + _CONF,
              choices=FORMATS),
    ParamSpec("model.outputs", [], "Output contract of model.path: 'role:output name' for "
              "roles boxes [B,N,4] xyxy px, scores [B,N], labels [B,N] (together), seg "
              "[B,K,h,w] logits, depth [B,1,h,w] m, or fcos:<prefix> for the reference FCOS "
              "head's raw maps (<prefix>det_cls_p3.. as export_onnx names them; instead of "
              "boxes); torch models returning a tuple name their outputs output0, "
              "output1, ..." + _CONF, element_type=str),
    ParamSpec("model.input_name", "images", "Input name of an ONNX model.path." + _CONF),
    ParamSpec("model.input_format", "uint8", "Input of model.path: uint8 0..255, float01, or "
              "imagenet (normalised float)." + _CONF, choices=INPUT_FORMATS),
    # ---- runtime: where and how the forward runs ----------------------------------------
    ParamSpec("runtime.device", "cpu", "Torch device." + _CONF, choices=("cpu", "cuda")),
    ParamSpec("runtime.engine", "auto", "What executes the forward: torch, onnxruntime (the "
              "reference model exported at configure) or tensorrt (an engine built offline, "
              "looked up in runtime.trt_engine_dir). 'auto' = torch, or onnxruntime for an "
              "ONNX model.path." + _CONF, choices=ENGINES),
    ParamSpec("runtime.precision", "auto", "Arithmetic of the forward: fp32, bf16, fp16 "
              "(CUDA) or int8 (tensorrt only)." + _AUTO + _CONF, choices=PRECISIONS),
    ParamSpec("runtime.compile", "auto", "torch.compile of the forward: off, whole (one "
              "region per head set) or branched (the parts after the trunk as regions on CUDA "
              "streams of their own)." + _AUTO + _CONF, choices=COMPILES),
    ParamSpec("runtime.cuda_graph", "auto", "Capture the forward in one CUDA graph per head "
              "set (true needs a CUDA device)." + _AUTO + _CONF, choices=SWITCH),
    ParamSpec("runtime.optimize", "auto", "Exact rewrites of the model at configure: "
              "BatchNorm folded into the convs, space-to-depth(4) stem, padded conv outputs, "
              "grouped FCOS towers, conv epilogues in cuDNN." + _AUTO + _CONF, choices=SWITCH),
    ParamSpec("runtime.trt_engine_dir", "", "runtime.engine tensorrt: folder of the engines "
              "built offline, looked up by key (model hash, heads, shapes, GPU, TensorRT, "
              "precision) and never built at configure; '' = ~/.cache/kestrel/trt." + _CONF),
    ParamSpec("runtime.torch_threads", 0, "Torch intra-op threads (0 = torch's default).",
              min=0, max=256, read_only=True),
    ParamSpec("runtime.region_graph", True, "CUDA: capture the post-processing + LiDAR "
              "fusion (static shapes) in CUDA graphs at configure, one pair per head set x "
              "point bucket, each validated against the launched ops (a failing one stays "
              "launched, logged, counted as region_graphs_failed)." + _CONF),
    ParamSpec("runtime.region_compile", True, "CUDA: torch.compile the element-wise steps "
              "of the post-processing + LiDAR fusion (decode candidates, slot selection, mask "
              "/ depth encoding, projection, box positions) into fused kernels, compiled at "
              "configure for every head set x point bucket. Thresholds set at run time are "
              "read from a device buffer: no recompile, no recapture. A compile failure "
              "switches them back to plain torch (logged, region_compile_failed on "
              "/diagnostics)." + _CONF),
    ParamSpec("warmup_size", [320, 256], "Image [width, height] px the runtime is prepared "
              "for (warm-up, compile, graphs); other sizes run the plain model (counted "
              "runtime_shape_fallbacks)." + _CONF, element_type=int, length=2, min=1,
              max=8192),
    # ---- heads and detection --------------------------------------------------------------
    ParamSpec("enable_detection", True, "Run the detection head." + _RUN),
    ParamSpec("enable_segmentation", True, "Run the segmentation head." + _RUN),
    ParamSpec("enable_depth", True, "Run the depth head." + _RUN),
    ParamSpec("detection.score_threshold", 0.3, "Detection score threshold." + _RUN,
              min=0.0, max=1.0),
    ParamSpec("detection.nms_iou", 0.5, "Class-wise NMS IoU threshold." + _RUN, min=0.0,
              max=1.0),
    ParamSpec("detection.max_detections", 100, "Detections per camera after NMS (sizes the "
              "result slots and the post-processing graphs)." + _CONF, min=1, max=1000),
    ParamSpec("detection.nms_rounds", 8, "Fixed-point NMS rounds run without a host sync; "
              "longer suppression chains take the exact slow path (counted: nms_slow_path)."
              + _CONF, min=1, max=10000),
    # ---- LiDAR ----------------------------------------------------------------------------
    ParamSpec("lidar.max_points", 500_000, "Clouds with more points are dropped (counted)."
              + _CONF, min=1, max=50_000_000),
    ParamSpec("lidar.point_buckets", list(DEFAULT_BUCKETS), "Static cloud sizes, ascending: "
              "a cloud is NaN-padded to the smallest bucket that holds it (one prepared graph "
              "per bucket); a larger cloud is subsampled evenly to the largest (counted "
              "truncated_points, logged). Sizes the device buffers, so read-only." + _CONF,
              element_type=int, min=1, max=50_000_000, read_only=True,
              check=lambda v: None if v and list(v) == sorted(set(v)) and len(v) <= 8
              else "must be 1-8 distinct sizes in ascending order"),
    ParamSpec("lidar.min_points", 5, "LiDAR points needed in a box for a LiDAR position."
              + _CONF, min=1, max=100_000),
    ParamSpec("lidar.support_classes", ["table"], "Classes whose surfaces objects stand on. "
              "Where a camera sees one as a horizontal plane (base frame z up), a detection "
              "of another class gets its LiDAR position from its own points (segmentation "
              "class at their pixel = its class) above that plane: the object's centre, half "
              "way between its top and the plane, on the ray through the box centre "
              "(kestrel_models perception/support.py); with fewer than lidar.min_points such "
              "points, the predicted depth. Other detections, and all without segmentation, "
              "take the median depth of the points in the box. [] = the box median for "
              "all." + _CONF, element_type=str),
    ParamSpec("lidar.support_tolerance", 0.01, "Points up to this far above the support "
              "plane belong to it (about 3x the LiDAR's range noise), m." + _CONF, min=0.0,
              max=1.0),
    # ---- sync: which images, camera_infos and cloud form one set --------------------------
    ParamSpec("sync.slop", 0.02, "Max stamp difference between the images, camera_infos and "
              "cloud of one set, s." + _CONF, min=0.0, max=1.0),
    ParamSpec("sync.cloud_required", True, "A set waits for its cloud (within sync.slop) "
              "while one may still come: the LiDAR is live (see sync.cloud_timeout) and no "
              "cloud stamped after the set + sync.slop has arrived; false = a set goes out as "
              "soon as its images are complete, with the newest cloud within sync.slop if one "
              "is there. Sets without a cloud are counted (missing_cloud)." + _CONF),
    ParamSpec("sync.cloud_timeout", 0.5, "LiDAR silence after which sets stop waiting for a "
              "cloud, s (at least 1.5 x the LiDAR's period, measured from the clouds' receipt "
              "times, at most 5 s); a waiting set is released within half of it." + _CONF,
              min=0.01, max=60.0),
    ParamSpec("sync.jump_back", 1.0, "A message stamped more than this before the newest "
              "stamp seen is a backwards time jump (a bag loop or replay, a sim restart): the "
              "synchroniser forgets every stamp, counts it (time_jumps_back) and goes on. Also "
              "the longest stamp gap counted as lost messages (lost_<sensor>), s; must be > "
              "sync.slop." + _CONF, min=0.001, max=3600.0),
    # ---- geometry -------------------------------------------------------------------------
    ParamSpec("frame_id", "world", "Frame of the cloud, camera poses and 3D positions." + _CONF),
    ParamSpec("camera_poses", [], "Per camera x y z qx qy qz qw (m): pose of its optical "
              "frame in frame_id ([] = identity for all; ~/input/camera_<i>/pose overrides)."
              + _CONF, element_type=float),
    # ---- output: what the result carries --------------------------------------------------
    ParamSpec("output.depth_encoding", "16UC1", "Encoding of the published depth maps: "
              "'16UC1' (uint16 mm, 0 = no value, REP 118; half the bytes) or '32FC1' "
              "(float32 m)." + _CONF, choices=DEPTH_ENCODINGS),
    ParamSpec("output.stride", 4, "Masks and depth maps are published subsampled [::s, ::s]: "
              "size ceil(H/s) x ceil(W/s), pixel (i, j) = input pixel (s*i, s*j), i.e. the "
              "camera's K with fx, fy, cx, cy divided by s (1 = full resolution). The "
              "reference model predicts them at its dense_stride (8, or 4) and upsamples "
              "bilinearly: a finer output only interpolates, and costs bytes on every hop."
              + _CONF, choices=OUTPUT_STRIDES),
    ParamSpec("output.debug_image", False, "Publish ~/output/debug_image." + _CONF),
    # ---- receive: who takes the inputs off DDS --------------------------------------------
    ParamSpec("receive.mode", "auto", "Who takes the camera images and the cloud off DDS: "
              "'executor' = this node's subscriptions (one after the other, deserialised "
              "under the GIL), 'processes' = one receiver process per image topic (with its "
              "camera_info) and one for the cloud, in parallel, writing into shared-memory "
              "slots the node reads without a copy (kestrel_perception/core/receivers.py; "
              "their drops are counted under the node's own names, rx_received counts their "
              "messages), 'auto' = 'processes' on a CUDA device with at least 2 CPUs per "
              "receiver, else 'executor' (resolve_receive). The pose topics stay on the "
              "executor. Images larger than warmup_size are dropped in 'processes'." + _CONF,
              choices=("auto", "executor", "processes"), read_only=True),
    ParamSpec("receive.start_timeout", 60.0, "receive.mode 'processes': how long configure "
              "waits for every receiver process to subscribe, s.", min=1.0, max=600.0,
              read_only=True),
    ParamSpec("receive.cpus", [], "receive.mode 'processes': CPUs of the receiver processes, "
              "receiver i (cameras, then the cloud) on receive.cpus[i % len] alone "
              "(sched_setaffinity); [] = they run where the node may. Give them CPUs the "
              "sensor drivers and the node's threads do not use.", element_type=int, min=0,
              max=4095, read_only=True),
    # ---- the process ----------------------------------------------------------------------
    ParamSpec("processing", "callback", "Where a complete input set is processed: 'callback' "
              "= in the subscription callback that completed it (no thread hand-off; the "
              "input subscriptions take no message while a set is processed, and with "
              "receive.mode 'processes' the receiver thread waits too), 'worker' = in a "
              "dedicated worker thread woken by the callbacks." + _CONF,
              choices=("callback", "worker"), read_only=True),
    ParamSpec("executor", "single", "The node's executor: 'single' = SingleThreadedExecutor "
              "(no thread-pool hand-off per input message), 'multi' = MultiThreadedExecutor "
              "(the diagnostics timer may run while a set is processed).",
              choices=("single", "multi"), read_only=True),
    ParamSpec("gil_switch_interval_us", 200, "sys.setswitchinterval of the node process, us "
              "(Python's default 5000): a thread waiting for the GIL gets it after at most "
              "this long; every torch call releases the GIL, so with the default a busy "
              "executor thread can add up to 5 ms per call to the processing (0 = leave "
              "Python's setting)." + _CONF, min=0, max=100_000, read_only=True),
    ParamSpec("target_fps", 10.0, "Diagnostics warn when p99 latency > 1/target_fps, Hz."
              + _CONF, min=0.1, max=1000.0),
)

RUNTIME_PARAMS: tuple[str, ...] = ("enable_detection", "enable_segmentation", "enable_depth",
                                   "detection.score_threshold", "detection.nms_iou")


def pose_to_matrix(pose: list[float] | np.ndarray) -> np.ndarray:
    """x y z qx qy qz qw -> T [4,4] (the quaternion is normalised). ValueError if degenerate."""
    x, y, z, qx, qy, qz, qw = (float(v) for v in pose)
    norm = math.sqrt(qx * qx + qy * qy + qz * qz + qw * qw)
    if not all(math.isfinite(v) for v in (x, y, z, norm)) or norm < 1e-9:
        raise ValueError(f"pose {list(pose)}: needs finite values and a non-zero quaternion")
    qx, qy, qz, qw = qx / norm, qy / norm, qz / norm, qw / norm
    T = np.eye(4)
    T[:3, :3] = [
        [1 - 2 * (qy * qy + qz * qz), 2 * (qx * qy - qz * qw), 2 * (qx * qz + qy * qw)],
        [2 * (qx * qy + qz * qw), 1 - 2 * (qx * qx + qz * qz), 2 * (qy * qz - qx * qw)],
        [2 * (qx * qz - qy * qw), 2 * (qy * qz + qx * qw), 1 - 2 * (qx * qx + qy * qy)],
    ]
    T[:3, 3] = (x, y, z)
    return T


def validate_perception_params(values: dict[str, Any]) -> None:
    """Cross-parameter checks; raises ParamError naming the parameter and value."""
    names = values["model.class_names"]
    if not 2 <= len(names) <= 255 or len(set(names)) != len(names) or not all(names):
        raise ParamError("model.class_names", names, "needs 2..255 unique, non-empty names")
    if not (values["enable_detection"] or values["enable_segmentation"]
            or values["enable_depth"]):
        raise ParamError("enable_detection", values["enable_detection"],
                         "enable_detection/segmentation/depth are all false")
    unknown = [c for c in values["lidar.support_classes"] if c not in names]
    if unknown:
        raise ParamError("lidar.support_classes", values["lidar.support_classes"],
                         f"{unknown} not in model.class_names ([] = the box median)")
    if not values["sync.jump_back"] > values["sync.slop"]:
        raise ParamError("sync.jump_back", values["sync.jump_back"],
                         f"must be > sync.slop ({values['sync.slop']})")
    if not values["frame_id"]:
        raise ParamError("frame_id", values["frame_id"], "must not be empty")
    poses, n = values["camera_poses"], values["num_cameras"]
    if poses and len(poses) != 7 * n:
        raise ParamError("camera_poses", poses, f"needs 7 values per camera ({7 * n} for "
                                                f"num_cameras = {n}) or none")
    for i in range(len(poses) // 7):
        try:
            pose_to_matrix(poses[7 * i: 7 * i + 7])
        except ValueError as exc:
            raise ParamError("camera_poses", poses, f"camera {i}: {exc}") from None
    # CPUs of the machine, not the node's own mask: a node pinned (taskset) to some CPUs gives
    # its receivers others. A CPU the cgroup's cpuset excludes fails the receiver at start
    # (reported: configure fails naming 'receive.mode')
    cpus, count = values.get("receive.cpus", []), os.cpu_count() or 1
    if any(c >= count for c in cpus):
        raise ParamError("receive.cpus", cpus, f"CPUs {sorted(c for c in cpus if c >= count)}"
                                               f" do not exist (this machine has {count})")


def resolve_receive(receive: str, device: str, num_cameras: int,
                    cpus: int | None = None) -> str:
    """The parameter `receive` -> 'executor' or 'processes' ('auto': processes on a CUDA
    device when the machine has at least 2 CPUs per receiver process, i.e. 2 * (cameras + 1);
    with fewer the receivers, the publishers and the node compete for the cores)."""
    if receive != "auto":
        return receive
    if cpus is None:  # the CPUs this process may use (affinity / cpuset), not the host's
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count()
    cuda = str(device).startswith("cuda")
    return "processes" if cuda and (cpus or 1) >= 2 * (num_cameras + 1) else "executor"


def core_config(values: dict[str, Any]) -> PerceptionCoreConfig:
    """Validated node parameters -> PerceptionCoreConfig. All three heads are always built so
    they can be switched at run time; ValueError (naming the parameter) on bad values."""
    model = PerceptionConfig(
        backbone_depth=values["model.backbone_depth"], base_width=values["model.base_width"],
        fpn_channels=values["model.fpn_channels"],
        num_classes=len(values["model.class_names"]), head_convs=values["model.head_convs"],
        max_depth=values["model.max_depth"],
        score_threshold=values["detection.score_threshold"],
        nms_iou=values["detection.nms_iou"],
        max_detections=values["detection.max_detections"])
    w, h = values["warmup_size"]
    return PerceptionCoreConfig(
        model=model, class_names=tuple(values["model.class_names"]),
        device=values["runtime.device"], weights_path=values["model.weights_path"],
        seed=values["model.seed"], model_path=values["model.path"],
        model_format=values["model.format"], model_outputs=tuple(values["model.outputs"]),
        model_input_name=values["model.input_name"],
        model_input_format=values["model.input_format"],
        max_points=values["lidar.max_points"], min_lidar_points=values["lidar.min_points"],
        support_classes=tuple(values["lidar.support_classes"]),
        support_tolerance=values["lidar.support_tolerance"],
        point_buckets=tuple(values["lidar.point_buckets"]),
        warmup_image_hw=(h, w), warmup_cameras=values["num_cameras"],
        num_threads=values["runtime.torch_threads"], engine=values["runtime.engine"],
        precision=values["runtime.precision"], compile=values["runtime.compile"],
        cuda_graph=values["runtime.cuda_graph"], optimize=values["runtime.optimize"],
        engine_dir=values["runtime.trt_engine_dir"],
        depth_encoding=values["output.depth_encoding"], output_stride=values["output.stride"],
        nms_rounds=values["detection.nms_rounds"], zero_copy_maps=True,
        region_graph=values["runtime.region_graph"],
        region_compile=values["runtime.region_compile"])


def missing_model_heads(enabled: dict, model_heads: frozenset[str] | set[str]) -> str:
    """Why the `enable_*` values leave the model none of its own heads ('' if they do not).
    A user model provides only the heads of its output contract (`model.outputs`); a frame
    with none of them enabled would have nothing to compute, so such a setting is refused at
    configure and at `ros2 param set`, naming the parameters that would help."""
    on = {h for h in ("detection", "segmentation", "depth") if enabled.get(f"enable_{h}")}
    if on & set(model_heads):
        return ""
    names = ", ".join(f"'enable_{h}'" for h in sorted(model_heads))
    return (f"the enabled heads {sorted(on)} are none of the model's heads "
            f"{sorted(model_heads)}: set {names} to true")


def no_head_enabled(enabled: dict) -> str:
    """Why the `enable_*` values (parameter name -> bool) cannot all be false ('' if one is
    true): a frame with no head would compute nothing."""
    if any(enabled.values()):
        return ""
    return ("parameters 'enable_detection', 'enable_segmentation', 'enable_depth' are all "
            "false: at least one head must stay enabled")


def enabled_heads(values: dict[str, Any]) -> frozenset[str]:
    """The heads a frame computes ('detection', 'segmentation', 'depth') from the node's
    `enable_*` parameter values."""
    return frozenset(h for h in ("detection", "segmentation", "depth")
                     if values[f"enable_{h}"])
