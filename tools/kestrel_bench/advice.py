"""What to change when a stage is bound by X: suggestions in Kestrel's own parameters.

One table, so the texts follow the nodes' parameter names (kestrel_perception/core/params.py,
kestrel_control/control_params.py with the backend registry kestrel_models/control/registry.py,
kestrel_planner/params.py). Rows are tried in order; the first whose target, class and device
("gpu": the trace has kernels, "cpu": it has none, "*": either) match gives the advice. Texts
may use {stage}, {kernels}, {mean_kernel_us}, {busy_share}, {dtype}.
"""

from __future__ import annotations

from kestrel_bench.bottleneck import StageStats

# (target or "*", class, device, suggestion)
SUGGESTIONS: tuple[tuple[str, str, str, str], ...] = (
    # perception node (`runtime.*`, `receive.*`, `model.*`)
    ("perception", "launch", "gpu", "launch-bound in {stage} ({kernels} kernels, mean "
     "{mean_kernel_us:.1f} us, device busy {busy_share:.0%}): set runtime.cuda_graph: true and "
     "runtime.compile: branched (one graph replay instead of a launch per kernel)"),
    ("perception", "memory", "gpu", "memory-bound in {stage} ({dtype}): set runtime.precision: "
     "bf16 (half the bytes) and runtime.optimize: true (channels_last, folded batch norms)"),
    ("perception", "compute", "gpu", "compute-bound in {stage} ({dtype}): set runtime.precision: "
     "bf16 or fp16 (tensor cores), or runtime.engine: tensorrt with an engine built offline"),
    ("perception", "launch", "cpu", "overhead-bound in {stage} ({kernels} ops, busy "
     "{busy_share:.0%}): runtime.compile: whole (fewer, fused ops) and runtime.optimize: true"),
    ("perception", "memory", "cpu", "memory-bound in {stage}: runtime.optimize: true "
     "(channels_last, folded batch norms), or runtime.engine: onnxruntime"),
    ("perception", "compute", "cpu", "compute-bound in {stage} on the CPU: runtime.engine: "
     "onnxruntime, a smaller model (model.base_width, model.backbone_depth), or a GPU "
     "(runtime.device: cuda)"),
    ("perception", "transport", "*", "transport-bound in {stage}: set receive.mode: processes "
     "(images off DDS in parallel, into shared memory) and give the receivers CPUs of their own "
     "(receive.cpus)"),
    # control node (`policy.backend` from the registry, `loop.*`)
    ("control", "launch", "gpu", "launch-bound in {stage} ({kernels} launches, mean "
     "{mean_kernel_us:.1f} us): set policy.backend: cuda_graph (one replay per tick), "
     "cuda_graph_triton (fused kernels) or cuda_persistent (no launch at all)"),
    ("control", "launch", "cpu", "overhead-bound in {stage} ({kernels} ops, mean "
     "{mean_kernel_us:.1f} us): set policy.backend: onnxruntime and loop.native_tick: true"),
    ("control", "memory", "gpu", "memory-bound in {stage}: the policy's weights stream every "
     "tick, so set policy.backend: cuda_graph_triton or cuda_persistent (weights kept close to the "
     "SMs), or a smaller policy (policy.hidden_dims)"),
    ("control", "memory", "cpu", "memory-bound in {stage}: the policy's weights stream every "
     "tick, so set policy.backend: onnxruntime, or a smaller policy (policy.hidden_dims, "
     "policy.lstm_hidden)"),
    ("control", "compute", "*", "compute-bound in {stage}: a smaller policy "
     "(policy.hidden_dims, policy.lstm_hidden), or policy.backend: tensorrt (FP16 engine) for a "
     "user's ONNX policy on a GPU"),
    ("control", "transport", "*", "transport-bound in {stage}: set loop.mode: process (the "
     "loop reads observations from shared memory, never from the executor)"),
    # planner node (`backend`, `engine_compile`, `max_batch`, `hf.dtype`)
    ("planner", "launch", "gpu", "launch-bound in {stage} ({kernels} kernels per call): set "
     "backend: engine (CUDA-graph decode) and engine_compile: true"),
    ("planner", "memory", "*", "memory-bound in {stage} (decode streams the weights per "
     "token): raise max_batch (more goals per weight read) and use bf16 weights "
     "(hf.dtype: bfloat16)"),
    ("planner", "compute", "*", "compute-bound in {stage}: bf16 weights (hf.dtype: bfloat16), "
     "or serve the model remotely (backend: remote) on a larger GPU"),
    ("planner", "transport", "*", "transport-bound in {stage}: with backend: remote set "
     "remote.send_image: false when the plan does not need the frame"),
    # any target
    ("*", "launch", "*", "launch-bound in {stage} ({kernels} kernels, mean {mean_kernel_us:.1f} "
     "us, device busy {busy_share:.0%}): capture it in a CUDA graph or compile it "
     "(fewer, fused kernels)"),
    ("*", "memory", "*", "memory-bound in {stage}: fewer bytes per item: bf16/fp16, "
     "channels_last, fused element-wise steps"),
    ("*", "compute", "*", "compute-bound in {stage}: lower precision on tensor cores (bf16, "
     "fp16, fp8) or less work"),
    ("*", "transport", "*", "transport-bound in {stage}: move fewer bytes (keep tensors on the "
     "device, pinned host buffers, shared memory instead of serialisation)"),
    ("*", "unknown", "*", "{stage}: no FLOP or byte counts: profile with record_shapes=True and "
     "with_flops=True"),
)


def suggest(target: str, stage: StageStats, device: str = "gpu") -> str:
    """The first matching row's text for `stage` (class stage.klass) of `target` profiled on
    `device` ("gpu" | "cpu")."""
    for tgt, klass, dev, text in SUGGESTIONS:
        if tgt not in ("*", target) or klass != stage.klass or dev not in ("*", device):
            continue
        return text.format(stage=stage.name, kernels=stage.kernels,
                           mean_kernel_us=stage.mean_kernel_us, busy_share=stage.busy_share,
                           dtype=stage.dtype)
    return ""
