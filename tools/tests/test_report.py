"""The report renders tiny synthetic records into one page with its plots."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kestrel_bench import report_plots
from kestrel_bench.__main__ import main


def lat(p50: float) -> dict:
    return {"n": 1000, "mean": p50 * 1.1, "p50": p50, "p90": p50 * 1.3, "p99": p50 * 2,
            "p999": p50 * 3, "max": p50 * 4}


def write_records(d: Path) -> None:
    counts, edges = np.histogram(np.random.default_rng(0).lognormal(4, 0.3, 5000),
                                 bins=np.geomspace(10, 2000, 31))
    control = {
        "schema": "kestrel_bench/1", "benchmark": "control",
        "machine": {"class": "cpu", "cpus": 2}, "commit": "abc1234",
        "command": "python -m kestrel_bench control --quick", "date": "2026-12-02T18:00:00Z",
        "config": {}, "notes": [],
        "results": [
            {"name": "cpu_eager", "role": "baseline", "latency_ms": lat(0.3),
             "throughput": {"value": 3000.0, "unit": "Hz"}},
            {"name": "onnxruntime", "role": "optimized", "latency_ms": lat(0.1),
             "throughput": {"value": 9000.0, "unit": "Hz"}, "peak_memory_mb": 90.0},
            {"name": "loop:cpu_eager@1000Hz:process", "role": "variant",
             "latency_ms": lat(0.06), "config": {"rate_hz": 1000.0},
             "metrics": {"cycles": 5000, "deadline_misses": 2},
             "histogram_us": {"edges": edges.tolist(), "counts": counts.tolist()}},
        ],
        "ratios": {"optimized_vs_baseline_tick_p50": 3.0},
    }
    perception = {
        "schema": "kestrel_bench/1", "benchmark": "perception",
        "machine": {"class": "h200", "gpu": "NVIDIA H200"}, "commit": "abc1234",
        "command": "python -m kestrel_bench perception", "date": "2026-12-02T18:00:00Z",
        "config": {}, "notes": [], "ratios": {},
        "results": [
            {"name": "eager_fp32", "role": "baseline", "latency_ms": lat(10.0),
             "peak_memory_mb": 2000.0, "power": {"energy_j_per_item": 3.0}},
            {"name": "auto", "role": "optimized", "latency_ms": lat(3.4),
             "peak_memory_mb": 1500.0, "power": {"energy_j_per_item": 1.0},
             "drift": {"max_abs": 0.004, "reference": "fp32"}},
            {"name": "tensorrt_fp16", "role": "variant", "skipped": "TensorRT not installed"},
        ],
    }
    gate_input = {**control, "benchmark": "paired", "ratios": {"control_tick_p10": 2.6}}
    (d / "gate_cpu.json").write_text(json.dumps(gate_input))
    (d / "control_cpu.json").write_text(json.dumps(control))
    (d / "perception_h200.json").write_text(json.dumps(perception))
    (d / "old_format.json").write_text(json.dumps({"label": "an older result"}))


@pytest.mark.slow
def test_report_renders_page_and_plots(tmp_path) -> None:
    write_records(tmp_path)
    assert main(["report", "--dir", str(tmp_path)]) == 0
    page = (tmp_path / "REPORT.md").read_text()
    plots = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert plots == ["baseline_vs_optimized.png", "control_histogram.png", "latency_cdf.png",
                     "radar.png"]
    for name in plots:
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < 300_000
        assert f"(plots/{name})" in page
    assert "| control (cpu) | cpu_eager | onnxruntime |" in page
    assert "3.00x" in page and "2.94x" in page          # p50 speed-ups
    assert "| cpu | loop:cpu_eager@1000Hz:process | 5000 | 2 |" in page
    assert "old_format.json" in page                   # listed, not read
    assert "optimized_vs_baseline_tick_p50" in page
    # the gate's input record: listed with its ratios, not plotted or paired
    assert "| paired (cpu) | control_tick_p10 | 2.6 |" in page
    assert "| paired (cpu) | cpu_eager |" not in page


def test_radar_values_and_missing_data(tmp_path) -> None:
    b = {"latency_ms": lat(10.0), "power": {"energy_j_per_item": 3.0}}
    o = {"latency_ms": lat(5.0), "power": {"energy_j_per_item": 1.0},
         "drift": {"max_abs": 0.01}}
    v = report_plots.radar_values(b, o)
    assert v["latency"] == 2.0 and v["energy"] == 3.0 and v["throughput"] is None
    assert abs(v["accuracy"] - 0.99) < 1e-9
    task = report_plots.radar_values({"latency_ms": lat(1.0), "metrics": {"success_rate": 0.5}},
                                     {"latency_ms": lat(1.0), "metrics": {"success_rate": 1.0}})
    assert task["accuracy"] == 2.0
    # no pair of roles: the plots that need one are not written, and say so
    solo = {"schema": "kestrel_bench/1", "benchmark": "planner", "machine": {"class": "cpu"},
            "results": [{"name": "x", "role": "variant", "latency_ms": lat(1.0)}]}
    (tmp_path / "planner_cpu.json").write_text(json.dumps(solo))
    stale = tmp_path / "plots" / "radar.png"
    stale.parent.mkdir()
    stale.write_bytes(b"old")
    assert main(["report", "--dir", str(tmp_path)]) == 0
    assert not stale.exists()
    page = (tmp_path / "REPORT.md").read_text()
    assert "(plots/latency_cdf.png)" in page and "no data for this plot" in page


def test_no_records_is_an_error(tmp_path) -> None:
    assert main(["report", "--dir", str(tmp_path)]) == 1
