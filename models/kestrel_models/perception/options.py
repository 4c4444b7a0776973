"""The perception runtime as orthogonal options -> one `VariantSpec` (pure, no torch calls).

A user picks what runs the forward with five options, each with an `auto` that resolves per
device to the fastest measured setting (docs/benchmarks/perception_*.md):

  engine      torch | onnxruntime | tensorrt   what executes the forward
  precision   fp32 | bf16 | fp16 | int8        arithmetic of the forward (int8: TensorRT only)
  compile     off | whole | branched           torch.compile: none, one region over the whole
                                               forward, or the parts after the trunk as
                                               regions on CUDA streams of their own
  cuda_graph  true | false                     capture the forward in one CUDA graph per head
                                               set (CUDA only)
  optimize    true | false                     exact rewrites of the model at configure:
                                               BatchNorm folded into the convs, the stem over
                                               a space-to-depth(4) input, conv outputs padded
                                               to multiples of 8, the FCOS towers as grouped
                                               convs, conv epilogues (bias, add, ReLU) in cuDNN

`auto`, for the reference model:
  CUDA: torch, bf16 (weights cast), compile branched, cuda_graph true, optimize true;
  CPU:  torch, fp32, compile off, cuda_graph false, optimize false (the plain model in
        channels_last; bf16 is faster on some CPUs but changes the detections, so it is asked
        for, not picked). tensorrt: fp16. onnxruntime: fp32.
A user's own model (`user_format` given) runs as exported: its engine follows its format
(ONNX: onnxruntime, else torch) and the other options resolve to fp32 / off / false.
Anything else that cannot run together fails naming the option and its value, e.g. a CUDA
graph on the CPU, TensorRT with torch.compile, int8 outside TensorRT.

The experiments' variants (runtime.VARIANTS) stay available to the benchmark by name.
"""

from __future__ import annotations

from dataclasses import dataclass

from .branches import BranchPlan
from .optimize import OptimizeSpec
from .runtime import VariantSpec

ENGINES = ("auto", "torch", "onnxruntime", "tensorrt")
PRECISIONS = ("auto", "fp32", "bf16", "fp16", "int8")
COMPILES = ("auto", "off", "whole", "branched")
SWITCH = ("auto", True, False)  # cuda_graph, optimize

# the exact rewrites `optimize: true` applies (with BatchNorm folding)
OPTIMIZE = OptimizeSpec("s2d4", 8, "grouped", conv_act="cudnn", fuse_stem=True)


@dataclass(frozen=True)
class RuntimeOptions:
    """The resolved options (no `auto` left) and the spec they map to.

    spec None: the core's plain model runs the forward as it is (reference model in fp32 and
    channels_last, or a user's torch model as exported).
    """

    engine: str
    precision: str
    compile: str
    cuda_graph: bool
    optimize: bool
    spec: VariantSpec | None

    def describe(self) -> str:
        """One line for the log: 'torch bf16, compile branched, cuda_graph on, optimize on'."""
        return (f"{self.engine} {self.precision}, compile {self.compile}, cuda_graph "
                f"{'on' if self.cuda_graph else 'off'}, optimize "
                f"{'on' if self.optimize else 'off'}")


class OptionError(ValueError):
    """An option's value is invalid or cannot run with the others; names both."""

    def __init__(self, name: str, value: object, reason: str) -> None:
        super().__init__(f"parameter '{name}' = {value!r}: {reason}")
        self.name, self.value, self.reason = name, value, reason


def resolve_options(device: str, engine: str = "auto", precision: str = "auto",
                    compile: str = "auto", cuda_graph: str | bool = "auto",
                    optimize: str | bool = "auto", *, user_format: str | None = None,
                    prefix: str = "") -> RuntimeOptions:
    """The options of a runtime on `device` ('cpu', 'cuda', 'cuda:N') -> RuntimeOptions.

    user_format: None for the reference model, else the format of a user's model file
    ('torchscript', 'exported_program', 'onnx'). prefix: prepended to the option names in
    errors (the node's parameter group, 'runtime.'). Raises OptionError.
    """
    def fail(name: str, value: object, reason: str) -> OptionError:
        return OptionError(prefix + name, value, reason)

    for name, value, allowed in (("engine", engine, ENGINES), ("precision", precision,
                                                                 PRECISIONS),
                                 ("compile", compile, COMPILES),
                                 ("cuda_graph", cuda_graph, SWITCH),
                                 ("optimize", optimize, SWITCH)):
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise fail(name, value, f"must be one of {list(allowed)}")
    cuda = str(device).startswith("cuda")
    if not cuda and str(device) != "cpu":
        raise fail("device", device, "must be 'cpu' or 'cuda'")
    # ---- engine ---------------------------------------------------------------------------
    own = {"onnx": "onnxruntime"}.get(user_format or "", "torch")
    if engine == "auto":
        engine = own
    elif user_format is not None and engine != own:
        raise fail("engine", engine, f"a user model runs as exported: its format "
                   f"{user_format!r} runs in {own}")
    if engine == "tensorrt" and not cuda:
        raise fail("engine", engine, f"TensorRT runs on CUDA: needs device 'cuda', got "
                   f"{device!r}")
    plain = user_format is not None or engine != "torch"  # nothing of torch's to tune
    why_plain = "a user model runs as exported" if user_format is not None else \
        f"the {engine} engine runs the whole forward"
    # ---- precision ------------------------------------------------------------------------
    if precision == "auto":
        precision = "fp16" if engine == "tensorrt" else \
            "bf16" if cuda and not plain else "fp32"
    elif precision == "int8" and engine != "tensorrt":
        raise fail("precision", precision, "int8 runs in the tensorrt engine only")
    elif precision != "fp32" and (user_format is not None or engine == "onnxruntime"):
        raise fail("precision", precision, f"{why_plain} in fp32")
    elif precision == "fp16" and not cuda:
        raise fail("precision", precision, "fp16 runs on CUDA; use bf16 on the CPU")
    # ---- compile, cuda_graph, optimize ----------------------------------------------------
    if compile == "auto":
        compile = "branched" if cuda and not plain else "off"
    elif compile != "off" and plain:
        raise fail("compile", compile, f"{why_plain}: use 'off'")
    if cuda_graph == "auto":
        cuda_graph = cuda and not plain
    elif cuda_graph and plain:
        raise fail("cuda_graph", cuda_graph, f"{why_plain}: use false")
    elif cuda_graph and not cuda:
        raise fail("cuda_graph", cuda_graph, f"CUDA graphs need device 'cuda', got {device!r}")
    if optimize == "auto":
        optimize = cuda and not plain
    elif optimize and plain:
        raise fail("optimize", optimize, f"{why_plain}: use false")
    spec = _spec(engine, precision, compile, bool(cuda_graph), bool(optimize), cuda,
                 user_format is not None)
    return RuntimeOptions(engine, precision, compile, bool(cuda_graph), bool(optimize), spec)


def _spec(engine: str, precision: str, compile: str, cuda_graph: bool, optimize: bool,
          cuda: bool, user: bool) -> VariantSpec | None:
    """The VariantSpec of resolved, compatible options (None: the plain model)."""
    if user:
        return None
    if engine == "tensorrt":
        return VariantSpec(engine=precision)
    if engine == "onnxruntime":
        return VariantSpec(onnxruntime=True)
    if precision == "fp32" and compile == "off" and not cuda_graph and not optimize:
        return None  # the core's own model (fp32, channels_last) is this forward
    return VariantSpec(
        precision,
        # weights cast to the precision on CUDA (no casts per call); autocast on the CPU
        cast_weights=precision != "fp32" and cuda,
        channels_last=True, cuda_graph=cuda_graph, fold_bn=optimize,
        whole_compile=None if compile == "off" else "default",
        optimize=OPTIMIZE if optimize else OptimizeSpec(),
        branches=BranchPlan() if compile == "branched" else None)
