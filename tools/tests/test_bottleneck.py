"""Bottleneck identifier on synthetic torch.profiler traces whose class is known by
construction: the peaks are 1 TFLOP/s and 100 GB/s (ridge point 10 FLOP/byte)."""

from __future__ import annotations

import json

import pytest
from kestrel_bench import advice, bottleneck
from kestrel_bench.__main__ import main
from kestrel_bench.bottleneck import Peaks

PEAKS = Peaks("test", {"default": 1e12}, 1e11)


class Trace:
    """Builds chrome-trace events: host ranges/ops on tid 1, kernels on stream 7, each
    kernel launched by a cudaLaunchKernel inside the current range."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.corr = 0

    def range(self, name: str, ts: float, dur: float, cat: str = "user_annotation") -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                            "pid": 1, "tid": 1, "args": {}})

    def op(self, name: str, ts: float, dur: float, **args: float) -> None:
        self.events.append({"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur,
                            "pid": 1, "tid": 1, "args": dict(args)})

    def kernel(self, launch_ts: float, ts: float, dur: float, cat: str = "kernel",
               **args: float) -> None:
        self.corr += 1
        self.events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel",
                            "ts": launch_ts, "dur": 1.0, "pid": 1, "tid": 1,
                            "args": {"correlation": self.corr}})
        self.events.append({"ph": "X", "cat": cat, "name": f"k{self.corr}", "ts": ts,
                            "dur": dur, "pid": 0, "tid": 7,
                            "args": {"correlation": self.corr, **args}})

    def dense_kernels(self, t0: float, n: int, dur: float, **args: float) -> None:
        """n back-to-back kernels of `dur` us launched from t0 on (busy ~100 %)."""
        for i in range(n):
            self.kernel(t0 + i, t0 + 5 + i * dur, dur, **args)


def analyze(trace: Trace) -> bottleneck.Analysis:
    return bottleneck.analyze(bottleneck.load_trace({"traceEvents": trace.events}), PEAKS)


def stage(analysis: bottleneck.Analysis, name: str) -> bottleneck.StageStats:
    return next(s for s in analysis.stages if s.name == name)


def test_compute_bound_gpu_stage() -> None:
    t = Trace()
    t.range("backbone", 0, 1000)
    # 10 kernels x 95 us at 90 % of peak FLOP/s, a few bytes each
    t.dense_kernels(0, 10, 95, flops=0.9e12 * 95e-6, bytes=1e5)
    s = stage(analyze(t), "backbone")
    assert s.klass == "compute", s.reason
    assert s.kernels == 10 and s.flop_util == pytest.approx(0.9)


def test_python_stack_events_do_not_hide_stages() -> None:
    t = Trace()
    t.range("forward (model.py:10)", -10, 1100, cat="python_function")  # with_stack=True
    t.range("backbone", 0, 1000)
    t.dense_kernels(0, 10, 95, flops=0.9e12 * 95e-6, bytes=1e5)
    assert [s.name for s in analyze(t).stages] == ["backbone"]


def test_kernels_found_by_external_id_without_runtime_events() -> None:
    t = Trace()
    t.range("backbone", 0, 100)
    t.op("aten::mm", 10, 20, **{"External id": 5})
    # the kernel runs after the range ended: only its External id ties it to the stage
    t.events.append({"ph": "X", "cat": "kernel", "name": "gemm", "ts": 500, "dur": 50,
                     "pid": 0, "tid": 7, "args": {"External id": 5}})
    assert stage(analyze(t), "backbone").kernels == 1


def test_memory_bound_gpu_stage() -> None:
    t = Trace()
    t.range("layer1", 0, 1000)
    # 80 % of peak bandwidth, intensity 1 FLOP/byte (below the ridge)
    t.dense_kernels(0, 10, 95, flops=8e10 * 95e-6, bytes=8e10 * 95e-6)
    s = stage(analyze(t), "layer1")
    assert s.klass == "memory", s.reason
    assert s.bw_util == pytest.approx(0.8)


def test_launch_bound_gpu_stage() -> None:
    t = Trace()
    t.range("heads", 0, 1000)
    # 100 kernels of 2 us, one every 10 us: the GPU is busy 20 % of the time
    for i in range(100):
        t.kernel(i * 10, i * 10 + 3, 2, flops=1e3, bytes=1e3)
    s = stage(analyze(t), "heads")
    assert s.klass == "launch", s.reason
    assert s.kernels == 100 and s.gaps_us > 700


def test_host_only_stage_of_a_gpu_trace_is_overhead_bound() -> None:
    t = Trace()
    t.range("policy", 0, 500)
    t.dense_kernels(0, 5, 95, flops=0.9e12 * 95e-6, bytes=1e5)
    t.range("command", 600, 300)
    t.op("aten::clamp", 600, 250, flops=10.0, bytes=100.0)
    s = stage(analyze(t), "command")
    assert s.klass == "launch" and "no device work" in s.reason


def test_tiny_kernels_back_to_back_are_launch_bound() -> None:
    t = Trace()
    t.range("post", 0, 300)
    t.dense_kernels(0, 100, 2.5, flops=10.0, bytes=10.0)  # busy, but far from any peak
    assert stage(analyze(t), "post").klass == "launch"


def test_transport_bound_by_copies() -> None:
    t = Trace()
    t.range("inputs", 0, 1000)
    t.kernel(0, 10, 600, cat="gpu_memcpy", bytes=6e6)      # 60 % of the stage
    t.kernel(2, 620, 300, flops=0.9e12 * 300e-6, bytes=1e5)
    s = stage(analyze(t), "inputs")
    assert s.klass == "transport", s.reason
    assert s.copy_us == pytest.approx(600)


def test_transport_bound_by_name_on_cpu() -> None:
    t = Trace()
    t.range("receive_images", 0, 1000)
    t.op("aten::copy_", 0, 900, bytes=1e6)
    assert stage(analyze(t), "receive_images").klass == "transport"


def test_cpu_trace_compute_memory_and_overhead() -> None:
    t = Trace()
    t.range("mlp", 0, 1000)
    t.op("aten::addmm", 0, 950, flops=0.7e12 * 950e-6, **{"Input Dims": [[64, 64]],
                                                             "Input type": ["float"]})
    t.range("norm", 1000, 1000)
    t.op("aten::native_layer_norm", 1000, 950, flops=1e4, bytes=0.5e11 * 950e-6)
    t.range("python_glue", 2000, 1000)
    for i in range(20):  # 20 ops of 10 us in 1 ms: the interpreter between them dominates
        t.op("aten::add", 2000 + i * 50, 10, flops=100.0, bytes=1e3)
    a = analyze(t)
    assert a.device == "cpu"
    assert stage(a, "mlp").klass == "compute"
    assert stage(a, "mlp").dtype == "fp32"
    assert stage(a, "norm").klass == "memory"
    assert stage(a, "python_glue").klass == "launch"


def test_bytes_estimated_from_input_shapes() -> None:
    args = {"Input Dims": [[2, 3], [3]], "Input type": ["c10::BFloat16", "c10::BFloat16"]}
    assert bottleneck._op_bytes("aten::add", args) == (6 + 3 + 6) * 2
    assert bottleneck._op_bytes("aten::as_strided", args) == 0.0
    mm = {"Input Dims": [[256], [64, 128], [128, 256]], "Input type": ["float"] * 3}
    assert bottleneck._op_bytes("aten::addmm", mm) == 4 * (256 + 64 * 128 + 128 * 256
                                                           + 64 * 256)
    assert bottleneck._op_dtype(args) == "bf16"


def test_flops_estimated_for_matmul_and_conv() -> None:
    mm = {"Input Dims": [[256], [64, 128], [128, 256]], "Input type": ["float"] * 3}
    assert bottleneck._op_flops("aten::addmm", mm) == 2 * 64 * 128 * 256
    conv = {"Input Dims": [[1, 8, 32, 32], [16, 8, 3, 3], [16]],
            "Concrete Inputs": ["", "", "", "[2, 2]", "[1, 1]"]}
    assert bottleneck._op_flops("aten::mkldnn_convolution", conv) == 2 * 16 * 16 * 16 * 8 * 9
    assert bottleneck._op_flops("aten::addmm", {"flops": 7.0}) == 7.0
    assert bottleneck._op_flops("aten::relu", mm) == 0.0


def test_unknown_without_counts() -> None:
    t = Trace()
    t.range("opaque", 0, 100)
    t.dense_kernels(0, 2, 45)
    s = stage(analyze(t), "opaque")
    assert s.klass == "unknown" and "with_flops" in s.reason


def test_whole_step_verdict_launch_bound() -> None:
    """A compute-bound stage of 200 us inside a step of 2 ms whose other stage idles the GPU:
    the step is launch-bound, and the compute stage keeps its own class."""
    t = Trace()
    t.range("ProfilerStep#0", 0, 2000, cat="cpu_op")
    t.range("backbone", 0, 220)
    t.dense_kernels(0, 2, 100, flops=0.9e12 * 100e-6, bytes=1e4)
    t.range("postprocess", 300, 1700)
    for i in range(150):
        t.kernel(300 + i * 11, 305 + i * 11, 2, flops=10.0, bytes=100.0)
    a = analyze(t)
    assert stage(a, "backbone").klass == "compute"
    assert stage(a, "postprocess").klass == "launch"
    assert a.step.klass == "launch" and a.step.kernels == 152
    share = bottleneck.verdict_by_time(a.stages)
    assert list(share)[0] == "launch"


def test_whole_step_compute_bound_without_profiler_step() -> None:
    t = Trace()
    t.range("backbone", 0, 1000)
    t.dense_kernels(0, 10, 95, flops=0.9e12 * 95e-6, bytes=1e5)
    assert analyze(t).step.klass == "compute"


def test_suggestions_name_the_nodes_parameters() -> None:
    t = Trace()
    t.range("heads", 0, 1000)
    for i in range(100):
        t.kernel(i * 10, i * 10 + 3, 2, flops=1e3, bytes=1e3)
    t.range("layer1", 1000, 1000)
    t.dense_kernels(1000, 10, 95, flops=8e10 * 95e-6, bytes=8e10 * 95e-6)
    a = analyze(t)
    launch, memory = stage(a, "heads"), stage(a, "layer1")
    assert "cuda_graph: true" in advice.suggest("perception", launch)
    assert "launch-bound in heads" in advice.suggest("perception", launch)
    assert "precision: bf16" in advice.suggest("perception", memory)
    assert "memory-bound in layer1" in advice.suggest("perception", memory)
    assert "backend: cuda_graph" in advice.suggest("control", launch)
    assert "policy.backend: onnxruntime" in advice.suggest("control", launch, "cpu")
    assert "backend: engine" in advice.suggest("planner", launch)
    assert "CUDA graph" in advice.suggest("other", launch)
    # every class has a suggestion for every target on either device
    for target in ("perception", "control", "planner", "other"):
        for klass in bottleneck.CLASSES:
            for device in ("gpu", "cpu"):
                s = bottleneck.StageStats("x", klass=klass)
                assert advice.suggest(target, s, device), (target, klass, device)


def test_cli_prints_table_verdict_and_advice(tmp_path, capsys) -> None:
    t = Trace()
    t.range("heads", 0, 1000)
    for i in range(100):
        t.kernel(i * 10, i * 10 + 3, 2, flops=1e3, bytes=1e3)
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": t.events}))
    out_json = tmp_path / "analysis.json"
    rc = main(["profile", "perception", "--trace", str(path), "--peaks", "flops=1e12,bw=1e11",
               "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "| heads |" in text and "Step: launch-bound" in text
    assert "cuda_graph: true" in text
    saved = json.loads(out_json.read_text())
    assert saved["step"]["klass"] == "launch" and saved["stages"][0]["name"] == "heads"


def test_profile_control_target_end_to_end(tmp_path, capsys) -> None:
    """profile <target>: the control tick profiled here (CPU), its three stages classified."""
    out_json = tmp_path / "analysis.json"
    rc = main(["profile", "control", "--device", "cpu", "--steps", "3", "--peaks",
               "flops=1e11,bw=1e10", "--json", str(out_json)])
    assert rc == 0
    saved = json.loads(out_json.read_text())
    stages = {s["name"]: s for s in saved["stages"]}
    assert set(stages) == {"observation", "policy", "command"}
    assert stages["policy"]["flops"] > 0 and stages["policy"]["occurrences"] == 3
    assert all(s["klass"] in bottleneck.CLASSES for s in stages.values())
    assert "Suggestions:" in capsys.readouterr().out


def test_advice_names_parameters_that_exist() -> None:
    """Every 'name: value' the suggestions give for a node is one of its parameters."""
    import importlib
    import re

    modules = {"perception": "kestrel_perception.core.params",
               "control": "kestrel_control.control_params", "planner": "kestrel_planner.params"}
    for target, module in modules.items():
        names = {s.name for s in importlib.import_module(module).SPECS}
        for tgt, _klass, _dev, text in advice.SUGGESTIONS:
            if tgt != target:
                continue
            for name in re.findall(r"([a-z_][a-z_.]*[a-z_]): ", text):
                assert name in names, f"{target}: advice names {name!r}, not a parameter"
            for name in re.findall(r"\(([a-z_]+\.[a-z_]+)", text):
                assert name in names, f"{target}: advice names {name!r}, not a parameter"
