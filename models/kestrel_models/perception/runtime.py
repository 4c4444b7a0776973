"""PerceptionRuntime: a `MultiTaskPerceptionModel` prepared once for fixed shapes and run fast.

Everything is decided at configure time (the constructor): device placement, memory format,
precision, torch.compile per submodule group, static input buffers and, for the `*_graph`
variants, one CUDA graph per enabled head set (so switching heads in the hot path replays
another graph, never recompiles). Inputs stay uint8 until the device (normalised inside the
model). No ROS here.

A `VariantSpec` says how the model runs. The node builds it from orthogonal options
(options.py: engine, precision, compile, cuda_graph, optimize); VARIANTS names the specs the
benchmark compares:
  eager_* / compile_* / whole_* / branch*_: no torch.compile / torch.compile per submodule
  group (trunk = backbone + FPN, heads = det/neck/seg/depth/BEV, each group with its own mode)
  / ONE torch.compile region per head set over the whole forward (normalisation, backbone,
  FPN, heads, seg/depth upsampling, LiDAR projection), so inductor sees every pointwise op
  after each conv / the parts after the trunk as compiled regions on CUDA streams of their
  own, in one CUDA graph (branches.py: branch = P4+P5 on one stream, dense on another;
  branch4 = P4, P5 and dense each on its own; branchp = branch with P3 on a highest-priority
  stream).
  fp32 / bf16 / fp16: autocast; bf16w / fp16w: weights cast (no per-call casts);
  _cl: channels_last (the others with a precision cast use it too); _graph: whole-forward
  CUDA graph (CUDA only); _at / _tat: heads / trunk compiled with
  "max-autotune-no-cudagraphs"; _ro: "reduce-overhead" (inductor's CUDA graphs instead of
  ours); _fold: BatchNorm folded into the convs at configure; _freeze: inductor freezing
  (weights become constants), compiled under inference mode.
  Output-preserving transforms of optimize.py (`VariantSpec.optimize`): stem8 (stem input
  3 -> 8 channels), pad (+ conv outputs padded to multiples of 8), pad_merge (+ FCOS first
  tower convs and box/ctr preds merged), pad_group (+ FCOS towers as groups=2 convs), s2dpad
  (space-to-depth(2) stem + output pad), s2d_group (+ grouped FCOS towers), s2d_group_cudnn
  (+ the trunk's conv epilogues fused in cuDNN, conv_act.py), _stem (+ the stem's bias and
  ReLU in cuDNN's epilogue), s2d4 (the stem over a space-to-depth(4) input).
  tensorrt_<precision>: a prebuilt TensorRT engine (trt_runtime.py); onnxruntime: the fp32
  forward exported to ONNX Runtime at configure (onnx_runtime.py).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .branches import BranchedForward, BranchParts, BranchPlan, own_code
from .config import HEAD_NAMES
from .lidar import project_points
from .model import MultiTaskPerceptionModel
from .onnx_runtime import OnnxRuntimePerceptionModel
from .optimize import OptimizeSpec, optimize_model
from .trt_runtime import TensorRTPerceptionModel
from ..trt import PRECISIONS

Outputs = dict[str, "torch.Tensor | list[torch.Tensor]"]
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune",
                 "max-autotune-no-cudagraphs")


class RuntimeInputError(ValueError):
    """An input of `PerceptionRuntime.run` does not match the configured shapes."""


@dataclass(frozen=True)
class VariantSpec:
    """How a variant runs the model."""

    precision: str = "fp32"  # "fp32", "bf16", "fp16"
    cast_weights: bool = False  # True: weights cast to `precision`; False: autocast
    channels_last: bool = False
    trunk_compile: str | None = None  # torch.compile mode of backbone + FPN (None = eager)
    heads_compile: str | None = None  # torch.compile mode of the heads (and BEV)
    cuda_graph: bool = False  # capture the whole forward in one CUDA graph per head set
    fold_bn: bool = False  # fold eval BatchNorm into the preceding convs at configure
    whole_compile: str | None = None  # torch.compile mode of ONE region over the forward
    freeze: bool = False  # inductor freezing (only with whole_compile)
    backend: str = "inductor"  # torch.compile backend ("eager" in CPU tests of the tracing)
    optimize: OptimizeSpec = OptimizeSpec()  # output-preserving transforms (optimize.py)
    # branched forward (branches.py): the parts after the trunk as separate regions (compiled
    # with whole_compile's mode, or eager without it) on their own CUDA streams
    branches: BranchPlan | None = None
    # a prebuilt TensorRT engine of this precision instead of the torch model (trt_runtime.py;
    # "" = torch): looked up by key at configure, never built here
    engine: str = ""
    # the fp32 forward exported to ONNX Runtime at configure instead (onnx_runtime.py)
    onnxruntime: bool = False

    def __post_init__(self) -> None:
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"parameter 'precision' = {self.precision!r}: must be fp32, "
                             "bf16 or fp16")
        for name in ("trunk_compile", "heads_compile", "whole_compile"):
            if getattr(self, name) not in COMPILE_MODES:
                raise ValueError(f"parameter '{name}' = {getattr(self, name)!r}: must be one "
                                 f"of {COMPILE_MODES}")
        if self.whole_compile is not None and (self.trunk_compile or self.heads_compile):
            raise ValueError(f"parameter 'whole_compile' = {self.whole_compile!r}: excludes "
                             "trunk_compile/heads_compile (one region or per-module regions)")
        if self.branches is not None and (self.trunk_compile or self.heads_compile):
            raise ValueError(f"parameter 'branches' = {self.branches!r}: compiles each part "
                             "with whole_compile's mode; excludes trunk_compile/heads_compile")
        if self.freeze and self.whole_compile is None:
            raise ValueError("parameter 'freeze' = True: needs whole_compile")
        if self.engine and (self.engine not in PRECISIONS or self.compiled or self.cuda_graph
                            or self.branches is not None):
            raise ValueError(f"parameter 'engine' = {self.engine!r}: one of {PRECISIONS}, "
                             "without torch.compile, CUDA graphs or branches (the engine is "
                             "the whole forward)")
        if self.onnxruntime and (self.engine or self.compiled or self.cuda_graph
                                 or self.branches is not None or self.precision != "fp32"
                                 or self.fold_bn or self.optimize.active):
            raise ValueError("parameter 'onnxruntime' = True: runs the exported fp32 forward "
                             "as it is (no TensorRT engine, torch.compile, CUDA graphs, "
                             "branches, precision or rewrites)")

    @property
    def compiled(self) -> bool:
        return any((self.trunk_compile, self.heads_compile, self.whole_compile))

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
            self.precision]


VARIANTS: dict[str, VariantSpec] = {
    "eager_fp32": VariantSpec(),
    "eager_fp32_cl": VariantSpec(channels_last=True),
    "eager_bf16_cl": VariantSpec("bf16", channels_last=True),
    "eager_fp16_cl": VariantSpec("fp16", channels_last=True),
    "eager_bf16w_graph": VariantSpec("bf16", True, True, cuda_graph=True),
    "compile_fp32": VariantSpec(trunk_compile="default", heads_compile="default"),
    "compile_bf16": VariantSpec("bf16", False, True, "default", "default"),
    "compile_bf16_graph": VariantSpec("bf16", False, True, "default", "default", True),
    "compile_bf16w_graph": VariantSpec("bf16", True, True, "default", "default", True),
    "compile_bf16w_graph_at": VariantSpec("bf16", True, True, "default",
                                          "max-autotune-no-cudagraphs", True),
    "eager_fp32_fold": VariantSpec(fold_bn=True),
    "compile_bf16w_fold_graph": VariantSpec("bf16", True, True, "default", "default", True,
                                            fold_bn=True),
    "whole_bf16w_graph": VariantSpec("bf16", True, True, cuda_graph=True,
                                     whole_compile="default"),
    "whole_bf16w_fold_graph": VariantSpec("bf16", True, True, cuda_graph=True, fold_bn=True,
                                          whole_compile="default"),
    "whole_bf16w_freeze_graph": VariantSpec("bf16", True, True, cuda_graph=True,
                                            whole_compile="default", freeze=True),
    "whole_fp16w_freeze_graph": VariantSpec("fp16", True, True, cuda_graph=True,
                                            whole_compile="default", freeze=True),
}
_OPTIMIZED = {"stem8": OptimizeSpec("pad8"), "pad": OptimizeSpec("pad8", 8),
              "pad_merge": OptimizeSpec("pad8", 8, "merged"),
              "pad_group": OptimizeSpec("pad8", 8, "grouped"), "s2dpad": OptimizeSpec("s2d", 8),
              "s2d_group": OptimizeSpec("s2d", 8, "grouped"),
              "s2d_group_cudnn": OptimizeSpec("s2d", 8, "grouped", conv_act="cudnn"),
              "s2d_group_cudnn_stem": OptimizeSpec("s2d", 8, "grouped", conv_act="cudnn",
                                                   fuse_stem=True),
              "s2d4_group_cudnn_stem": OptimizeSpec("s2d4", 8, "grouped", conv_act="cudnn",
                                                    fuse_stem=True)}
for _name, _opt in _OPTIMIZED.items():
    VARIANTS[f"whole_bf16w_fold_{_name}_graph"] = VariantSpec(
        "bf16", True, True, cuda_graph=True, fold_bn=True, whole_compile="default", optimize=_opt)
VARIANTS["compile_bf16w_fold_pad_merge_graph"] = VariantSpec(
    "bf16", True, True, "default", "default", True, fold_bn=True,
    optimize=_OPTIMIZED["pad_merge"])
# torch.compile modes per submodule group on top of the transforms s2d_group_cudnn, for the
# compile-mode comparison (docs/benchmarks/perception_h200.md): trunk (backbone + FPN) / heads
# each "default", "reduce-overhead" (inductor's own CUDA graphs, so no whole-forward graph of
# ours) or "max-autotune-no-cudagraphs" (Triton conv/GEMM templates timed against cuDNN/cuBLAS
# at compile time; our graph on top); `whole_*_at`: the one-region form with max-autotune.
_BEST = _OPTIMIZED["s2d_group_cudnn"]
_AT = "max-autotune-no-cudagraphs"
for _name, (_trunk, _heads, _graph) in {
        "compile_bf16w_fold_s2d_group_cudnn_graph": ("default", "default", True),
        "compile_bf16w_fold_s2d_group_cudnn_ro": ("reduce-overhead", "reduce-overhead", False),
        "compile_bf16w_fold_s2d_group_cudnn_graph_at": ("default", _AT, True),
        "compile_bf16w_fold_s2d_group_cudnn_graph_tat": (_AT, "default", True)}.items():
    VARIANTS[_name] = VariantSpec("bf16", True, True, _trunk, _heads, _graph, fold_bn=True,
                                  optimize=_BEST)
VARIANTS["whole_bf16w_fold_s2d_group_cudnn_at_graph"] = VariantSpec(
    "bf16", True, True, cuda_graph=True, fold_bn=True, whole_compile=_AT, optimize=_BEST)
# The best transforms as a branched forward (branches.py): FCOS P3 on the capture stream, the
# other parts on streams of their own, all in the one CUDA graph. branch: P4+P5 on one stream,
# dense on another; branch4: P4, P5 and dense each on its own; branchp: as branch, with P3 on
# a highest-priority stream.
# *_stem: + the stem's bias and ReLU in cuDNN's epilogue (conv_act.fuse_stem).
for _name, _plan in {"branch": BranchPlan(),
                     "branch4": BranchPlan((("det0",), ("det1",), ("det2",), ("dense",))),
                     "branchp": BranchPlan(priority=True)}.items():
    for _suffix, _opt in (("", _BEST), ("_stem", _OPTIMIZED["s2d_group_cudnn_stem"])):
        VARIANTS[f"{_name}_bf16w_fold_s2d_group_cudnn{_suffix}_graph"] = VariantSpec(
            "bf16", True, True, cuda_graph=True, fold_bn=True, whole_compile="default",
            optimize=_opt, branches=_plan)
# *_s2d4_*: the stem over a space-to-depth(4) input (optimize.py, stem "s2d4"); what the node's
# options resolve to on CUDA by default (options.py)
VARIANTS["branch_bf16w_fold_s2d4_group_cudnn_stem_graph"] = VariantSpec(
    "bf16", True, True, cuda_graph=True, fold_bn=True, whole_compile="default",
    optimize=_OPTIMIZED["s2d4_group_cudnn_stem"], branches=BranchPlan())
# tensorrt_<precision>: the engine built offline (trt_runtime.py); CUDA only, needs `tensorrt`
for _p in PRECISIONS:
    VARIANTS[f"tensorrt_{_p}"] = VariantSpec(engine=_p)
VARIANTS["onnxruntime"] = VariantSpec(onnxruntime=True)


def enable_cudnn_autotune(device: torch.device) -> bool:
    """On CUDA: torch.backends.cudnn.benchmark = True (process-wide), so cuDNN times its
    algorithms once per conv shape during the warm-up instead of picking by heuristics. The
    runtime's shapes are static, so the choice is made once, before any graph capture.
    Returns whether it was set (False off CUDA)."""
    if device.type != "cuda":
        return False
    torch.backends.cudnn.benchmark = True
    return True


def fold_batchnorm(module: nn.Module) -> int:
    """Fold every eval-mode BatchNorm2d into the Conv2d before it, in place (ResNet pairs
    conv{i}/bn{i} and downsample Sequential(conv, bn)); the BN becomes Identity. Returns the
    number of folded pairs. Removes one elementwise pass per conv on the GPU."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    count = 0
    for mod in list(module.modules()):
        for i in (1, 2, 3):
            conv, bn = getattr(mod, f"conv{i}", None), getattr(mod, f"bn{i}", None)
            if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
                setattr(mod, f"conv{i}", fuse_conv_bn_eval(conv, bn))
                setattr(mod, f"bn{i}", nn.Identity())
                count += 1
        if isinstance(mod, nn.Sequential) and len(mod) == 2 and \
                isinstance(mod[0], nn.Conv2d) and isinstance(mod[1], nn.BatchNorm2d):
            mod[0] = fuse_conv_bn_eval(mod[0], mod[1])
            mod[1] = nn.Identity()
            count += 1
    return count


def _as_head_sets(heads: Iterable | None, built: frozenset[str]) -> list[frozenset[str]]:
    """None -> [built]; a set of names -> [that]; a list of sets -> those (validated)."""
    if heads is None:
        return [built]
    items = list(heads)
    sets = [frozenset(items)] if all(isinstance(h, str) for h in items) else \
        [frozenset(h) for h in items]
    for s in sets:
        if not s or not s <= built:
            raise ValueError(f"parameter 'heads' = {sorted(s)}: must be a non-empty subset of "
                             f"the model's heads {sorted(built)} (known: {HEAD_NAMES})")
    return list(dict.fromkeys(sets))


class PerceptionRuntime:
    """A configured, warmed-up perception forward for fixed shapes.

    model: the (fp32, eval) reference model; the runtime works on its own copy.
    image_hw: (H, W) px; cameras x batch images per call: images [batch*cameras, 3, H, W]
    uint8 (grouped per sample). lidar_points: N > 0 adds LiDAR inputs points [batch, N, 3] m
    (bucketed, NaN-padded) plus T_cam_from_base [cameras, 4, 4] and K [cameras, 3, 3]; the
    projection (and the BEV block when the model has one) is then part of the forward.
    heads: head sets to prepare (one graph each for *_graph variants); default all built heads.
    cudnn_autotune: on CUDA, set torch.backends.cudnn.benchmark (process-wide) before the
    warm-up (`enable_cudnn_autotune`); static shapes, so cuDNN tunes each conv once.
    engine_dir: the folder of prebuilt TensorRT engines ("" = the default cache).
    option_prefix: prepended to the option names in errors (the node's 'runtime.').
    Outputs of `run` are the model's dict plus, with LiDAR, "lidar_uv" [batch, cameras, N, 2]
    px, "lidar_depth" [batch, cameras, N] m, "lidar_valid" [batch, cameras, N] bool. For
    *_graph variants the tensors are static buffers, valid until the next `run`.
    """

    def __init__(self, model: MultiTaskPerceptionModel, variant: str | VariantSpec = "eager_fp32",
                 image_hw: tuple[int, int] = (640, 640), cameras: int = 1, batch: int = 1,
                 heads: Iterable | None = None, device: str | torch.device = "cpu",
                 lidar_points: int = 0, warmup: int = 2, cudnn_autotune: bool = True,
                 engine_dir: str = "", option_prefix: str = "") -> None:
        if isinstance(variant, str):
            if variant not in VARIANTS:
                raise ValueError(f"parameter 'variant' = {variant!r}: must be one of "
                                 f"{sorted(VARIANTS)}")
            self.name, self.spec = variant, VARIANTS[variant]
        else:
            self.name, self.spec = "custom", variant
        self.device = torch.device(device)
        if self.spec.cuda_graph and self.device.type != "cuda":
            raise ValueError(f"parameter '{option_prefix}cuda_graph' = True: CUDA graphs need "
                             f"a CUDA device, got {self.device}")
        for name, v in (("cameras", cameras), ("batch", batch)):
            if not 1 <= v <= 64:
                raise ValueError(f"parameter '{name}' = {v!r}: must be in [1, 64]")
        if len(image_hw) != 2 or min(image_hw) < 32:
            raise ValueError(f"parameter 'image_hw' = {image_hw!r}: must be (H, W) >= 32 px")
        if lidar_points < 0:
            raise ValueError(f"parameter 'lidar_points' = {lidar_points}: must be >= 0")
        self.image_hw = (int(image_hw[0]), int(image_hw[1]))
        self.cameras, self.batch, self.lidar_points = cameras, batch, int(lidar_points)
        self.cudnn_autotune = cudnn_autotune and enable_cudnn_autotune(self.device)
        self.head_sets = _as_head_sets(heads, model.enabled_heads)
        self._new_step = "reduce-overhead" in (self.spec.trunk_compile, self.spec.heads_compile,
                                               self.spec.whole_compile)
        self.compile_s = 0.0  # s spent in the first (compiling) calls
        self.prepare_s = 0.0  # s for the whole configure step
        t0 = time.perf_counter()
        n = cameras * batch
        if self.spec.engine:  # the engine is the whole forward: no copy, no transforms
            self.optimized: dict[str, int] = {}
            self.model = TensorRTPerceptionModel(  # type: ignore[assignment]
                model, frozenset().union(*self.head_sets), n, self.image_hw, self.spec.engine,
                self.device, engine_dir,
                what=f"parameter '{option_prefix}engine' = 'tensorrt'")
        elif self.spec.onnxruntime:
            self.optimized = {}
            self.model = OnnxRuntimePerceptionModel(  # type: ignore[assignment]
                model, frozenset().union(*self.head_sets), n, self.image_hw, self.device,
                what=f"parameter '{option_prefix}engine' = 'onnxruntime'")
        else:
            self.model = self._prepare_model(model)
        self._images = torch.zeros((n, 3, *self.image_hw), dtype=torch.uint8, device=self.device)
        self._points = self._T = self._K = None
        if self.lidar_points:
            self._points = torch.zeros((batch, self.lidar_points, 3), device=self.device)
            self._T = torch.eye(4, device=self.device).repeat(cameras, 1, 1)
            self._K = torch.eye(3, device=self.device).repeat(cameras, 1, 1)
        self._graphs: dict[frozenset[str], tuple[torch.cuda.CUDAGraph, Outputs]] = {}
        # whole_* variants: one compiled callable (images, points) -> Outputs per head set
        self._parts: BranchParts | None = None
        self._regions = {hs: self._compile_region(hs) for hs in self.head_sets} \
            if self.spec.whole_compile is not None or self.spec.branches is not None else {}
        self._warmup(max(1, warmup))
        self.prepare_s = time.perf_counter() - t0

    # ---- configure ------------------------------------------------------------------------
    def _prepare_model(self, ref: MultiTaskPerceptionModel) -> MultiTaskPerceptionModel:
        spec = self.spec
        m = copy.deepcopy(ref).eval().to(self.device)
        for p in m.parameters():
            p.requires_grad_(False)
        if spec.fold_bn:
            fold_batchnorm(m)
        self.optimized = optimize_model(m, spec.optimize) if spec.optimize.active else {}
        if spec.cast_weights and spec.precision != "fp32":
            scale, shift = m.in_scale.clone(), m.in_shift.clone()
            m.to(spec.dtype)
            m.in_scale, m.in_shift = scale, shift  # normalisation constants stay fp32
        if spec.channels_last:
            m.to(memory_format=torch.channels_last)
        trunk: list[nn.Module] = [m.backbone, m.fpn]
        heads = [h for h in (m.det_head, m.dense_neck, m.seg_head, m.depth_head, m.bev)
                 if h is not None]
        for mods, mode in ((trunk, spec.trunk_compile), (heads, spec.heads_compile)):
            if mode is not None:
                for mod in mods:
                    mod.compile(mode=mode, dynamic=False, fullgraph=False)
        return m

    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.spec.precision == "fp32" or self.spec.cast_weights:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.spec.dtype)

    def _region(self, images: torch.Tensor, points: torch.Tensor | None,
                T: torch.Tensor | None, K: torch.Tensor | None, heads: frozenset[str]
                ) -> Outputs:
        """Model + LiDAR projection: images [B*C,3,H,W] uint8, points [B,N,3] m or None,
        T [C,4,4] camera-from-base, K [C,3,3] px (inputs, never frozen into a compile)."""
        cams = (T, K) if points is not None and T is not None and K is not None else None
        with self._autocast():  # (the BEV block's geometric lift takes the cameras)
            out = self.model(images, heads, points=points, cameras=cams)
        if points is not None:  # geometry stays fp32 (outside autocast)
            out.update(self._project(points, T, K))
        return out

    def _project(self, points: torch.Tensor, T: torch.Tensor | None, K: torch.Tensor | None
                 ) -> Outputs:
        """LiDAR outputs: lidar_uv [batch, cameras, N, 2] px, lidar_depth, lidar_valid."""
        uv, z, valid = [], [], []
        for b in range(self.batch):  # static loop: batch is fixed at configure
            u, d, v = project_points(points[b], T, K, self.image_hw)
            uv.append(u)
            z.append(d)
            valid.append(v)
        return {"lidar_uv": torch.stack(uv), "lidar_depth": torch.stack(z),
                "lidar_valid": torch.stack(valid)}

    def _compile(self, fn):  # noqa: ANN001, ANN202 (a callable in, a compiled callable out)
        """torch.compile of `fn` with the variant's whole_compile mode (static shapes, one
        graph); `fn` itself for a branched variant without whole_compile."""
        spec = self.spec
        if spec.whole_compile is None:
            return fn
        if spec.backend != "inductor":
            return torch.compile(fn, backend=spec.backend, dynamic=False, fullgraph=True)
        import torch._inductor as inductor

        options = dict(inductor.list_mode_options(spec.whole_compile))
        if spec.freeze:
            options["freezing"] = True
        return torch.compile(fn, dynamic=False, fullgraph=True, options=options)

    def _compile_region(self, hs: frozenset[str]):  # noqa: ANN202 (a compiled callable)
        """The forward of head set `hs` as one torch.compile region over `_region`, or, for a
        branched variant, as a `BranchedForward` of compiled parts (static shapes)."""
        if self.spec.branches is not None:
            if self._parts is None:  # one set of compiled parts for every head set
                self._parts = BranchParts(self.model, self._compile, self._autocast,
                                          self._project)
            return BranchedForward(self._parts, hs, self.spec.branches, self.device)

        def region(images: torch.Tensor, points: torch.Tensor | None,
                   T: torch.Tensor | None, K: torch.Tensor | None) -> Outputs:
            return self._region(images, points, T, K, hs)

        return self._compile(own_code(region))  # its own Dynamo entries (branches.own_code)

    def _forward(self, heads: frozenset[str]) -> Outputs:
        """The whole forward on the static buffers (what a CUDA graph captures)."""
        if self._new_step:
            # "reduce-overhead": inductor's CUDA-graph trees own the outputs. Without a
            # training step to mark the start of an iteration, the next forward counts as
            # the same iteration and reading the previous one's outputs (which that forward
            # overwrites) raises; mark each forward as a new step. The outputs then live
            # until the next `run`, as those of the `*_graph` variants do.
            torch.compiler.cudagraph_mark_step_begin()
        with torch.inference_mode():
            if self._regions:
                return self._regions[heads](self._images, self._points, self._T, self._K)
            return self._region(self._images, self._points, self._T, self._K, heads)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _warmup(self, iters: int) -> None:
        t0 = time.perf_counter()
        if not self.spec.cuda_graph:
            for hs in self.head_sets:
                for _ in range(iters):
                    self._forward(hs)
            self._sync()
            self.compile_s = time.perf_counter() - t0
            return
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up (and compilation) off the capture stream
            for hs in self.head_sets:
                for _ in range(max(iters, 3)):
                    self._forward(hs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        self._sync()
        self.compile_s = time.perf_counter() - t0
        pool = None
        for hs in self.head_sets:  # one graph per head set, sharing one memory pool
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._forward(hs)
            pool = g.pool()
            self._graphs[hs] = (g, out)
        self._sync()

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of the images `run` takes: (batch*cameras, 3, H, W)."""
        return tuple(self._images.shape)

    # ---- hot path -------------------------------------------------------------------------
    def set_geometry(self, T_cam_from_base: torch.Tensor, K: torch.Tensor) -> None:
        """Copy camera extrinsics [cameras,4,4] and intrinsics [cameras,3,3] into the buffers."""
        if self._T is None or self._K is None:
            raise RuntimeInputError("set_geometry: the runtime was configured without LiDAR")
        if tuple(T_cam_from_base.shape) != tuple(self._T.shape) or \
                tuple(K.shape) != tuple(self._K.shape):
            raise RuntimeInputError(f"set_geometry: expected T {tuple(self._T.shape)} and K "
                                    f"{tuple(self._K.shape)}, got {tuple(T_cam_from_base.shape)}"
                                    f" and {tuple(K.shape)}")
        self._T.copy_(T_cam_from_base)
        self._K.copy_(K)

    def run(self, images: torch.Tensor, points: torch.Tensor | None = None,
            heads: Iterable[str] | None = None) -> Outputs:
        """images [batch*cameras, 3, H, W] uint8 (any device); points [batch, N, 3] m.

        Raises RuntimeInputError on a shape/dtype mismatch or an unprepared head set.
        """
        hs = self.head_sets[0] if heads is None else frozenset(heads)
        if hs not in self.head_sets:
            raise RuntimeInputError(f"heads {sorted(hs)}: not prepared (prepared: "
                                    f"{[sorted(s) for s in self.head_sets]})")
        if images.dtype != torch.uint8 or tuple(images.shape) != tuple(self._images.shape):
            raise RuntimeInputError(f"images: expected uint8 {tuple(self._images.shape)}, got "
                                    f"{images.dtype} {tuple(images.shape)}")
        self._images.copy_(images, non_blocking=True)
        if self._points is not None:
            if points is None or tuple(points.shape) != tuple(self._points.shape):
                got = None if points is None else tuple(points.shape)
                raise RuntimeInputError(f"points: expected {tuple(self._points.shape)}, "
                                        f"got {got}")
            self._points.copy_(points, non_blocking=True)
        elif points is not None:
            raise RuntimeInputError("points: the runtime was configured without LiDAR")
        if self.spec.cuda_graph:
            graph, out = self._graphs[hs]
            graph.replay()
            return out
        return self._forward(hs)
