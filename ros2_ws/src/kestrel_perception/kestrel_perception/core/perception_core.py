"""PerceptionCore: FrameSet (images + cameras + cloud) -> detections with 3D positions, masks,
depth maps. Pure Python + torch, no ROS."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from kestrel_models.perception.external import (ExternalPerceptionModel, OutputContract,
                                                parse_outputs, resolve_format)
from kestrel_models.perception.options import RuntimeOptions, resolve_options
from kestrel_models.perception.runtime import VARIANTS, PerceptionRuntime, VariantSpec
from kestrel_models.perception.lidar import DEFAULT_SUPPORT_TOLERANCE
from kestrel_models.perception.model import load_weights
from kestrel_models.perception import (
    DEFAULT_BUCKETS,
    MultiTaskPerceptionModel,
    PerceptionConfig,
    PositionSource,
)

from .device_region import DeviceRegion, _Clock, validate_output_params
from .region_graph import RegionGraphs
from .staging import InputStaging, StagedPoints

from .types import (
    DEFAULT_CLASS_NAMES,
    CameraModel,
    DetectionArrays,
    FrameSet,
    PerceptionOutput,
    validate_frames,
)

# preprocess: images + cloud to the device; model: forward; postprocess: decode + NMS, seg
# argmax, depth encoding (device); lidar_fusion: projection + box positions (device);
# download: the one device->host copy + sync wait; unpack: the host detection arrays
STAGES: tuple[str, ...] = ("preprocess", "model", "postprocess", "lidar_fusion", "download",
                           "unpack")


def _fail(name: str, value: object, why: str) -> ValueError:
    return ValueError(f"parameter '{name}' = {value!r}: {why}")


PACKAGE_URI = "package://"
_SOURCE_ROOT = Path(__file__).resolve().parents[2]  # ros2_ws/src/kestrel_perception


def resolve_weights_path(path: str) -> str:
    """weights_path -> an existing file path. "package://<pkg>/<rel>" resolves to
    <share of pkg>/<rel> (ament index), falling back to the source tree <pkg source>/<rel>
    (for this package, when it is not installed); other values are plain file paths.
    Raises ValueError naming 'weights_path' (and the paths tried) when no file exists."""
    if not path.startswith(PACKAGE_URI):
        if not os.path.isfile(path):
            raise _fail("model.weights_path", path, "file not found")
        return path
    pkg, _, rel = path[len(PACKAGE_URI):].partition("/")
    if not pkg or not rel:
        raise _fail("model.weights_path", path, "expected package://<package>/<relative path>")
    tried = []
    try:
        from ament_index_python.packages import get_package_share_directory
        tried.append(os.path.join(get_package_share_directory(pkg), rel))
    except Exception:  # ament_index_python missing, or the package is not installed
        pass
    if pkg == _SOURCE_ROOT.name:
        tried.append(str(_SOURCE_ROOT / rel))
    for cand in tried:
        if os.path.isfile(cand):
            return cand
    where = tried if tried else f"nothing: package '{pkg}' is not installed"
    raise _fail("model.weights_path", path, f"file not found (tried: {where})")


@dataclass(frozen=True)
class PerceptionCoreConfig:
    """Runtime settings of the core around the model's own `PerceptionConfig`.

    `model.num_classes` must equal len(class_names). The default model is the tiny CPU config.
    Errors name the node's parameters (`model.weights_path`, `runtime.precision`, ...).
    """

    model: PerceptionConfig = field(default_factory=PerceptionConfig.tiny)
    class_names: tuple[str, ...] = DEFAULT_CLASS_NAMES
    device: str = "cpu"  # "cpu" or "cuda" (or "cuda:N")
    weights_path: str = ""  # "" = random init from `seed`; else a state_dict file
    # A user's own model instead of the reference architecture (kestrel_models.perception.
    # external): file, format (auto|torchscript|exported_program|onnx), the output contract
    # ('role:name' for boxes/scores/labels/seg/depth), input name (ONNX) and input format.
    model_path: str = ""
    model_format: str = "auto"
    model_outputs: tuple[str, ...] = ()
    model_input_name: str = "images"
    model_input_format: str = "uint8"
    seed: int = 0
    max_points: int = 500_000  # larger clouds are rejected (InputError too_many_points)
    point_buckets: tuple[int, ...] = DEFAULT_BUCKETS  # static cloud sizes (NaN padded)
    min_lidar_points: int = 5  # LiDAR points needed inside a box for a LiDAR position
    # LiDAR positions of objects standing on these classes' surfaces: the object's own points
    # above the support plane, its centre (kestrel_models perception/support.py); () = the
    # median depth of all points in the box. support_tolerance: m above the plane still
    # counted as the support (about 3x the LiDAR's range noise)
    support_classes: tuple[str, ...] = ("table",)
    support_tolerance: float = DEFAULT_SUPPORT_TOLERANCE
    channels_last: bool = True
    warmup_image_hw: tuple[int, int] | None = (256, 320)  # (H, W) px of the warm-up run
    warmup_cameras: int = 1
    num_threads: int = 0  # torch intra-op threads; 0 = leave torch's setting
    # How the forward runs (kestrel_models.perception.options: "auto" = the fastest measured
    # for the device). Unless they resolve to the plain model, a runtime is prepared at
    # warm-up for (warmup_cameras, warmup_image_hw) with every head subset; other shapes fall
    # back to the plain model (PerceptionOutput.runtime_fallback)
    engine: str = "auto"  # torch | onnxruntime | tensorrt
    precision: str = "auto"  # fp32 | bf16 | fp16 | int8 (tensorrt)
    compile: str = "auto"  # off | whole | branched
    cuda_graph: str | bool = "auto"
    optimize: str | bool = "auto"
    # a runtime.VARIANTS name instead of the options ("" = the options): for benchmarks
    variant: str = ""
    # engine tensorrt: the folder of the prebuilt engines ("" = ~/.cache/kestrel/trt)
    engine_dir: str = ""
    depth_encoding: str = "32FC1"  # "32FC1" (m) or "16UC1" (mm, 0 = no value, REP 118)
    output_stride: int = 1  # masks/depths subsampled [::s, ::s] (1, 2, 4 or 8)
    nms_rounds: int = 8  # fixed-point NMS rounds in the device region before the slow path
    # True: PerceptionOutput.masks/depths are views into the (double-buffered) host buffers,
    # valid until the process() call after the next one (the node publishes before that);
    # False: private copies
    zero_copy_maps: bool = False
    # CUDA: capture the static device region (post-processing + LiDAR fusion) in CUDA graphs,
    # one pair per heads x point bucket, prepared at warm-up (core/region_graph.py)
    region_graph: bool = True
    # CUDA: the static region's element-wise steps torch.compile'd (kestrel_models
    # perception/compiled.py), compiled during the warm-up (_prepare_region)
    region_compile: bool = True
    # set in __post_init__: the resolved options and the runtime's spec (None: plain model)
    options: RuntimeOptions = field(init=False, repr=False, compare=False)
    spec: VariantSpec | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "class_names", tuple(self.class_names))
        if len(self.class_names) != self.model.num_classes:
            raise _fail("model.class_names", list(self.class_names),
                        f"has {len(self.class_names)} names but the model has "
                        f"num_classes = {self.model.num_classes}")
        if len(set(self.class_names)) != len(self.class_names) or not all(self.class_names):
            raise _fail("model.class_names", list(self.class_names),
                        "must be unique, non-empty")
        if "segmentation" in self.model.heads and self.model.num_classes > 255:
            raise _fail("model.class_names", len(self.class_names),
                        "at most 255 for mono8 masks")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise _fail("runtime.device", self.device, "must be 'cpu' or 'cuda'")
        if self.weights_path:  # package:// URIs become file paths here
            object.__setattr__(self, "weights_path", resolve_weights_path(self.weights_path))
        object.__setattr__(self, "model_outputs", tuple(self.model_outputs))
        user_format = None
        if self.model_path:
            if self.weights_path:
                raise _fail("model.path", self.model_path, "set model.path (a whole model) or "
                            "model.weights_path (reference-architecture weights), not both")
            user_format = resolve_format(self.model_path, self.model_format)
            parse_outputs(self.model_outputs)  # raises naming model.outputs
        options = resolve_options(self.device, self.engine, self.precision, self.compile,
                                  self.cuda_graph, self.optimize, user_format=user_format,
                                  prefix="runtime.")  # raises naming the option
        object.__setattr__(self, "options", options)
        if not 1 <= self.max_points <= 50_000_000:
            raise _fail("lidar.max_points", self.max_points, "must be in [1, 50000000]")
        if not self.point_buckets or min(self.point_buckets) < 1:
            raise _fail("lidar.point_buckets", self.point_buckets, "must be positive sizes")
        if self.min_lidar_points < 1:
            raise _fail("lidar.min_points", self.min_lidar_points, "must be >= 1")
        object.__setattr__(self, "support_classes", tuple(self.support_classes))
        unknown = [c for c in self.support_classes if c not in self.class_names]
        if unknown:
            raise _fail("lidar.support_classes", list(self.support_classes),
                        f"{unknown} not in model.class_names (set [] for the box median)")
        if not 0.0 <= self.support_tolerance <= 1.0:
            raise _fail("lidar.support_tolerance", self.support_tolerance,
                        "must be in [0, 1] m")
        if self.warmup_image_hw is not None and min(self.warmup_image_hw) < 1:
            raise _fail("warmup_size", self.warmup_image_hw, "must be positive")
        if not 1 <= self.warmup_cameras <= 16:
            raise _fail("num_cameras", self.warmup_cameras, "must be in [1, 16]")
        validate_output_params(self.depth_encoding, self.output_stride)
        if not 1 <= self.nms_rounds <= 10000:
            raise _fail("detection.nms_rounds", self.nms_rounds, "must be in [1, 10000]")
        if self.num_threads < 0:
            raise _fail("runtime.torch_threads", self.num_threads, "must be >= 0")
        spec = options.spec
        if self.variant:
            if self.variant not in VARIANTS:
                raise _fail("variant", self.variant,
                            f"must be '' or one of {sorted(VARIANTS)}")
            if self.model_path:
                raise _fail("variant", self.variant, "a user model (model.path) runs as "
                            "exported")
            spec = VARIANTS[self.variant]
            if (spec.cuda_graph or spec.engine) and not self.device.startswith("cuda"):
                raise _fail("variant", self.variant, f"uses CUDA graphs or TensorRT: needs "
                            f"device 'cuda', got {self.device!r}")
        if spec is not None and self.warmup_image_hw is None:
            raise _fail("warmup_size", None, f"the runtime ({options.describe()}) needs the "
                        "static input shape")
        object.__setattr__(self, "spec", spec)



class PerceptionCore:
    """Builds the model once (seeded or from weights), warms it up, then `process()`es sets.

    Not thread-safe: call `process` from one thread (the node's worker).
    """

    def __init__(self, config: PerceptionCoreConfig) -> None:
        self.config = config
        self._support_classes = tuple(config.class_names.index(c)
                                      for c in config.support_classes)
        if config.device.startswith("cuda") and not torch.cuda.is_available():
            raise _fail("runtime.device", config.device,
                        "CUDA is not available on this machine")
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        self.external: ExternalPerceptionModel | None = None
        if config.model_path:
            self.external = self._load_external()
            self.model = self.external
            self.heads = self.external.heads
        else:
            self.model = self._build_model()
            self.heads = config.model.heads
        self.staging = InputStaging(self.device, config.point_buckets)
        graphs = RegionGraphs() if config.region_graph and self.device.type == "cuda" \
            else None
        self.region = DeviceRegion(self.device, config.depth_encoding, config.output_stride,
                                   config.nms_rounds, graphs=graphs,
                                   compile=config.region_compile and
                                   self.device.type == "cuda")
        self.runtime: PerceptionRuntime | None = None
        spec = config.spec  # the plain model runs other shapes in the runtime's precision
        self._fallback_dtype = spec.dtype if spec is not None and not spec.engine and \
            not spec.onnxruntime and spec.precision != "fp32" else None
        if config.warmup_image_hw is not None:
            self.warmup(config.warmup_image_hw, config.warmup_cameras)

    def _load_external(self) -> ExternalPerceptionModel:
        cfg = self.config
        contract = OutputContract(parse_outputs(cfg.model_outputs), cfg.model_input_name,
                                  cfg.model_input_format)
        ext = ExternalPerceptionModel(cfg.model_path, cfg.model_format, contract, self.device)
        hw = cfg.warmup_image_hw or (256, 320)
        ext.check(cfg.warmup_cameras, hw, len(cfg.class_names))  # fails configure if wrong
        return ext

    def _build_model(self) -> MultiTaskPerceptionModel:
        cfg = self.config
        with torch.random.fork_rng(devices=[]):  # seeded init without touching global RNG
            torch.manual_seed(cfg.seed)
            model = MultiTaskPerceptionModel(cfg.model)
        if cfg.weights_path:
            try:
                load_weights(model, cfg.weights_path)
            except Exception as exc:  # any load failure is a parameter error
                msg = str(exc).splitlines()[0][:300]
                raise _fail("model.weights_path", cfg.weights_path,
                            f"cannot load: {msg}") from exc
        model = model.to(self.device).eval()
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    def warmup(self, image_hw: tuple[int, int], cameras: int, iterations: int = 2) -> None:
        """Run `iterations` full process() calls on synthetic input (allocations, kernels)."""
        h, w = image_hw
        self.region.configure(cameras, (h, w), self.config.model.max_detections)
        self.staging.configure_images(cameras, (h, w))
        self.staging.configure_cameras(cameras)
        if self.config.spec is not None:
            built = sorted(self.config.model.heads)
            subsets = [frozenset(h for i, h in enumerate(built) if mask >> i & 1)
                       for mask in range(1, 2 ** len(built))]
            self.runtime = PerceptionRuntime(self.model, self.config.spec, (h, w),
                                             cameras, 1, heads=subsets, device=self.device,
                                             engine_dir=self.config.engine_dir,
                                             option_prefix="runtime.")
        K = np.array([[w, 0.0, w / 2], [0.0, w, h / 2], [0.0, 0.0, 1.0]])
        cams = [CameraModel(K, w, h, f"warmup_{i}") for i in range(cameras)]
        imgs = [np.zeros((h, w, 3), np.uint8) for _ in range(cameras)]
        pts = np.array([[0.0, 0.0, 2.0]] * 8, dtype=np.float32)
        for _ in range(iterations):
            self.process(FrameSet(0, imgs, cams, pts))
        if self.region.graphs is not None or self.region.compile:  # capture / compile now
            self._prepare_region(imgs, cams)

    def _prepare_region(self, imgs: list[np.ndarray], cams: list[CameraModel]) -> None:
        """One process() per enabled-head subset (of a user model's heads too) x (no cloud,
        each point bucket: a cloud of exactly the bucket size in front of the cameras), so the
        hot path never captures a region graph nor compiles a region step (score_threshold
        and nms_iou set at run time are read from the region's device buffer: neither)."""
        built = sorted(self.heads)
        subsets = [frozenset(h for i, h in enumerate(built) if mask >> i & 1)
                   for mask in range(1, 2 ** len(built))]
        rng = np.random.default_rng(0)
        for nb in (0, *sorted(self.config.point_buckets)):  # 0: a set without a cloud
            pts = None if nb == 0 else np.stack(
                [rng.uniform(-1, 1, nb), rng.uniform(-1, 1, nb), rng.uniform(1, 10, nb)],
                axis=1).astype(np.float32)
            for hs in subsets:
                self.process(FrameSet(0, imgs, cams, pts), hs)

    def _input_tensor(self, images: list[np.ndarray]) -> torch.Tensor:
        """The images -> [C,3,H,W] uint8 on the device (`InputStaging.images`: one copy each
        into the preallocated (pinned) buffer, one non_blocking host->device copy)."""
        return self.staging.images(images)

    def _lidar_inputs(self, frames: FrameSet
                      ) -> tuple[StagedPoints, dict[str, torch.Tensor]]:
        """Camera matrices (T_cam_from_base, K, K_inv, T_base_from_cam [C,..] float64) and the
        cloud (bucketed [Nb,3] m, NaN padded) on the device via `InputStaging`."""
        T_base = np.stack([np.asarray(c.T_base_from_cam, np.float64) for c in frames.cameras])
        Ks = np.stack([np.asarray(c.K, np.float64) for c in frames.cameras])
        return self.staging.points(frames.points), self.staging.cameras(T_base, Ks)

    def process(self, frames: FrameSet, heads: frozenset[str] | None = None
                ) -> PerceptionOutput:
        """Run the enabled (or the given subset of) heads on one FrameSet.

        One device region after the forward and ONE sync per frame (`DeviceRegion`); stage
        timings come from CUDA events on CUDA (no extra syncs), from the clock on the CPU.
        Raises InputError for bad input (nothing else is expected at runtime).
        """
        cfg = self.config
        heads = self.heads if heads is None else frozenset(heads)
        hw = validate_frames(frames, cfg.max_points)
        out = PerceptionOutput(frames.stamp_ns, [], [], [], {},
                               depth_encoding=cfg.depth_encoding,
                               output_stride=cfg.output_stride)
        clock = _Clock(self.device)
        clock.mark("start")
        x = self._input_tensor(frames.images)
        staged, cams = self._lidar_inputs(frames)
        points = staged.points
        clock.mark("preprocess")

        rt = self.runtime
        fallback = rt is not None and (tuple(x.shape) != rt.input_shape
                                       or heads not in rt.head_sets)
        out.runtime_fallback = fallback
        # the runtime's CUDA-graph outputs are fixed buffers, as the staged points and cameras
        persistent = rt is not None and not fallback and rt.spec.cuda_graph
        if rt is not None and not fallback:
            raw = rt.run(x, heads=heads)  # static buffers: consumed before the next call
        else:  # the plain model (in the runtime's torch precision, if any)
            with torch.inference_mode(), torch.autocast(
                    self.device.type, dtype=self._fallback_dtype or torch.bfloat16,
                    enabled=self._fallback_dtype is not None):
                raw = self.model(x, heads)
        clock.mark("model")

        m = cfg.model
        det = {"score_thr": m.score_threshold, "iou_thr": m.nms_iou,
               "max_det": m.max_detections, "pre_nms_top_k": m.pre_nms_top_k,
               "class_offset": m.det_class_offset, "min_points": cfg.min_lidar_points,
               "support_classes": self._support_classes,
               "support_tolerance": cfg.support_tolerance,
               "num_classes": len(cfg.class_names)}
        res = self.region.run(raw, hw, det, points, cams, clock, persistent=persistent)
        if not res.nms_converged:  # exact slow path (rare, counted): NMS to its fixed point
            out.nms_fallback = True
            first, first_host = res.stage_s, res.host_s
            res = self.region.run(raw, hw, det, points, cams, _Clock(self.device),
                                  exact_nms=True)
            res.stage_s = {k: first.get(k, 0.0) + res.stage_s.get(k, 0.0)
                           for k in {*first, *res.stage_s}}
            if res.host_s is not None and first_host is not None:
                res.host_s = {k: first_host.get(k, 0.0) + res.host_s.get(k, 0.0)
                              for k in {*first_host, *res.host_s}}
        t_unpack = time.monotonic()
        if staged.rows_in:  # LiDAR counts: the device counted the bucket's non-finite rows
            dropped = staged.host_dropped if staged.host_dropped is not None else \
                res.bad_points - staged.pad
            out.dropped_points = int(dropped)
            out.truncated_points = int(staged.truncated)
            out.used_points = staged.rows_in - out.dropped_points - out.truncated_points
        own = (lambda a: a) if cfg.zero_copy_maps else np.copy
        out.masks = [own(a) for a in res.masks] if res.masks is not None else []
        out.depths = [own(a) for a in res.depths] if res.depths is not None else []
        # valid slots come first in each camera's row: the boolean mask keeps camera order,
        # then slot order; boolean indexing copies (the host views are reused next frame)
        valid = res.valid  # [C,M] bool
        src = res.src[valid].astype(np.uint8)  # [D]
        pos = res.pos[valid].astype(np.float64)  # [D,3] m
        pos[src == int(PositionSource.NONE)] = np.nan
        out.arrays = DetectionArrays(
            camera_index=np.nonzero(valid)[0].astype(np.uint32),
            class_index=res.classes[valid].astype(np.uint16),
            score=res.scores[valid].astype(np.float32),
            box_xyxy=res.boxes[valid].astype(np.float32), position=pos, position_source=src)
        out.class_names = tuple(cfg.class_names)
        out.detections = None  # built from the arrays when read
        stages = res.stage_s
        out.timings = {"preprocess": stages.get("preprocess", 0.0),
                       "model": stages.get("model", 0.0),
                       "postprocess": stages.get("postprocess", 0.0),
                       "lidar_fusion": stages.get("lidar_fusion", 0.0),
                       "download": stages.get("download", 0.0),
                       "unpack": time.monotonic() - t_unpack}
        if self.device.type == "cuda" and res.host_s:  # host clock of the device stages
            out.host_timings = {k: res.host_s.get(k, 0.0) for k in
                                ("preprocess", "model", "postprocess", "lidar_fusion",
                                 "download")}
        return out
