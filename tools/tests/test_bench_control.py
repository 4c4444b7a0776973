"""`kestrel_bench control`: the default loops per machine, the loop specs, and the quick CPU
run the CI gate reads (baseline and optimized rows, same-run ratios)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_run import row, run_bench
from kestrel_bench.control import default_loops, parse_loops


def test_gpu_default_is_100k_graph_cycles_then_eager_gpu_and_cpu() -> None:
    for triton, graph in ((True, "cuda_graph_triton"), (False, "cuda_graph")):
        entries = parse_loops(default_loops(cuda=True, triton=triton), "thread")
        assert entries[0] == (graph, 1000.0, 100_000, "process")
        assert [e[0] for e in entries[1:]] == ["cuda_eager", "cpu_eager"]
        assert all(rate == 1000 for _, rate, _, _ in entries)
    assert parse_loops(default_loops(cuda=False, triton=True), "process") == [
        ("cpu_eager", 1000.0, 10_000, "process")]


def test_loop_specs_are_checked() -> None:
    assert parse_loops("cuda_graph@500:20:thread,cpu_eager@1000:5", "process") == [
        ("cuda_graph", 500.0, 20, "thread"), ("cpu_eager", 1000.0, 5, "process")]
    with pytest.raises(SystemExit, match="mode 'fast'"):
        parse_loops("cpu_eager@1000:5:fast", "thread")
    with pytest.raises(SystemExit, match="expected backend@rate_hz:cycles"):
        parse_loops("cpu_eager:1000", "thread")


@pytest.mark.slow
def test_quick_run_has_both_paths_and_same_run_ratios(tmp_path: Path) -> None:
    rec = run_bench(tmp_path / "control_cpu", "control", "--quick")
    assert rec["benchmark"] == "control" and rec["config"]["quick"] is True
    base, opt = row(rec, "cpu_eager"), row(rec, "onnxruntime")
    assert base["role"] == "baseline" and opt["role"] == "optimized"
    for r in (base, opt):
        assert r["latency_ms"]["n"] == 2000 and 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["max"]
        assert r["metrics"]["backend_step_p50_us"] > 0
    assert rec["ratios"]["optimized_vs_baseline_tick_p50"] == pytest.approx(
        base["latency_ms"]["p50"] / opt["latency_ms"]["p50"])
    assert {"optimized_vs_baseline_tick_p99", "optimized_vs_baseline_step_p50"} <= set(
        rec["ratios"])
