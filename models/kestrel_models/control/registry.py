"""The control policy backends a user picks (`backend` parameter): name -> factory.

Importing this module imports neither torch nor any backend's packages (CUDA, Triton,
ONNX Runtime, TensorRT): each factory is imported on first use, by `create_backend`.

When each one wins (figures: docs/benchmarks/control_*.md):
  cpu_eager          any torch policy on the CPU, including a recurrent rsl_rl policy.pt that
                     keeps its state in its own buffers (which onnxruntime cannot run)
  onnxruntime        the fastest CPU step: an ONNX file, or a torch policy exported at configure
  cuda_eager         a torch policy on the GPU that a CUDA graph cannot capture
  cuda_graph         any torch policy on the GPU (a user's TorchScript file too): one graph replay
                     per tick, launched from the loop process's C tick
  cuda_graph_triton  the reference policy on a GPU shared with other work: fused Triton kernels
                     in one CUDA graph, the command computed on the GPU
  cuda_persistent    the reference policy on a GPU (or MIG/MPS slice) the loop has to itself:
                     one resident kernel, no launch per tick; the lowest step latency
  tensorrt           a user's ONNX file on the GPU, where TensorRT is installed (FP16 engine)
`auto` (the node's default) builds the first of `auto_candidates` that runs here for the policy:
on a GPU cuda_graph_triton (the reference policy), cuda_graph or tensorrt (an ONNX file), then
onnxruntime, then cpu_eager. cuda_persistent is never chosen for you: it holds SMs while ticks
come, which only a GPU the loop has to itself affords.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


class BackendUnavailable(ValueError):
    """The backend cannot run here (no CUDA, package missing, model format unsupported)."""


@dataclass(frozen=True)
class BackendInfo:
    """One registry entry.

    factory: "module:function" building the backend, `f(policy, batch, **options)`.
    check: "module:function" raising BackendUnavailable when it cannot run here ("" = none).
    device: where the step runs ("cpu" | "cuda").
    torch_module: needs the policy as a torch module (not only an ONNX file).
    in_graph_command: computes the command on the device from a `PostSpec`.
    when: one line, when a user picks it.
    """

    name: str
    factory: str
    device: str
    when: str
    check: str = ""
    torch_module: bool = True
    in_graph_command: bool = False


_RT = "kestrel_models.control.runtimes"
REGISTRY: dict[str, BackendInfo] = {b.name: b for b in (
    BackendInfo("cpu_eager", f"{_RT}:make_cpu_eager", "cpu",
                "any torch policy on the CPU (a recurrent rsl_rl policy.pt too)"),
    BackendInfo("onnxruntime", f"{_RT}:make_onnxruntime", "cpu",
                "the fastest CPU step: an ONNX file, or a torch policy exported at configure",
                check=f"{_RT}:check_onnxruntime", torch_module=False),
    BackendInfo("cuda_eager", f"{_RT}:make_cuda_eager", "cuda",
                "a torch policy on the GPU that a CUDA graph cannot capture"),
    BackendInfo("cuda_graph", f"{_RT}:make_cuda_graph", "cuda",
                "any torch policy on the GPU (a user's TorchScript file too): one graph replay"),
    BackendInfo("cuda_graph_triton", "kestrel_models.control.triton_step:create_triton_backend",
                "cuda", "the reference policy on a GPU shared with other work: fused kernels "
                "in one graph", check="kestrel_models.control.triton_step:check_triton",
                in_graph_command=True),
    BackendInfo("cuda_persistent",
                "kestrel_models.control.persistent_step:create_persistent_backend", "cuda",
                "the reference policy on a GPU the loop has to itself: one resident kernel, "
                "the lowest step latency",
                check="kestrel_models.control.persistent_step:check_persistent",
                in_graph_command=True),
    BackendInfo("tensorrt", "kestrel_models.control.trt_backend:create_tensorrt_backend", "cuda",
                "a user's ONNX file on the GPU where TensorRT is installed (FP16 engine)",
                check="kestrel_models.control.trt_backend:check_tensorrt", torch_module=False),
)}
BACKENDS: tuple[str, ...] = tuple(REGISTRY)
AUTO = "auto"  # the measured best that runs here for the policy (auto_candidates)
CUDA_BACKENDS: tuple[str, ...] = tuple(n for n, b in REGISTRY.items() if b.device == "cuda")
POST_BACKENDS: tuple[str, ...] = tuple(n for n, b in REGISTRY.items() if b.in_graph_command)


def backend_info(name: str) -> BackendInfo:
    """The registry entry of `name`; ValueError naming the parameter and the choices."""
    info = REGISTRY.get(name)
    if info is None:
        raise ValueError(f"parameter 'backend' = {name!r}: must be one of "
                         f"{', '.join((AUTO, *BACKENDS))}")
    return info


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def auto_candidates(policy: Any, cuda: bool | None = None) -> tuple[str, ...]:
    """What `auto` tries, in order, for `policy` (a runtimes.StepPolicy): on a GPU the graph
    paths (cuda_graph_triton lowers only the reference policy; an ONNX file: tensorrt); then
    on the CPU onnxruntime, unless the file keeps its state in its own buffers (an ONNX export
    would freeze them), then cpu_eager (docs/benchmarks/control_*.md)."""
    torch_module = policy.module is not None
    out: list[str] = []
    if cuda_available() if cuda is None else cuda:
        if torch_module:
            if policy.extra.get("model") is not None:  # the reference ActorCritic
                out.append("cuda_graph_triton")
            out.append("cuda_graph")
        else:
            out.append("tensorrt")
    if "reset" not in policy.extra:
        out.append("onnxruntime")
    if torch_module:
        out.append("cpu_eager")
    return tuple(out)


def _resolve(target: str) -> Callable[..., Any]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_backend(name: str) -> None:
    """Configure-time check: ValueError for an unknown name, BackendUnavailable (naming the
    parameter and the reason) when it cannot run here (`auto`: checked as it is built)."""
    if name == AUTO:
        return
    info = backend_info(name)
    if info.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailable(f"parameter 'backend' = {name!r}: CUDA is not available")
    if info.check:
        _resolve(info.check)()


def create_backend(name: str, policy: Any, batch: int = 1, *, cache_dir: str = "",
                   warmup_steps: int = 10, post: Any = None, programs: int = 64) -> Any:
    """Build, warm up and return backend `name` (a runtimes.PolicyBackend) for `policy` (a
    runtimes.StepPolicy) at a fixed `batch`.

    cache_dir: exported ONNX files and TensorRT engines ("" = a temporary directory / the
    default cache). post: the in-graph command (a PostSpec; used where `in_graph_command`,
    `backend.post_np` is None elsewhere). programs: cuda_persistent's resident programs.
    `auto`: the first of auto_candidates that builds (`backend.name` says which)."""
    if name == AUTO:
        errors = []
        for candidate in auto_candidates(policy):
            try:
                return create_backend(candidate, policy, batch, cache_dir=cache_dir,
                                      warmup_steps=warmup_steps, post=post, programs=programs)
            except BackendUnavailable as exc:
                errors.append(str(exc))
        raise BackendUnavailable(f"parameter 'backend' = 'auto': no backend runs "
                                 f"{policy.source} here ({'; '.join(errors) or 'none fits'})")
    info = backend_info(name)
    check_backend(name)
    if info.torch_module and policy.module is None:
        raise BackendUnavailable(f"parameter 'backend' = {name!r}: {policy.source} has no torch "
                                 "module; an ONNX file runs on 'onnxruntime' (or 'tensorrt')")
    backend = _resolve(info.factory)(policy, batch, cache_dir=cache_dir, post=post,
                                     programs=programs)
    backend.warmup(warmup_steps)
    return backend
