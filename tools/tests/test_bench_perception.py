"""`kestrel_bench perception` on the CPU (tiny config): eager fp32 first and the baseline, a
failing variant recorded as a row, drift against fp32 measured on the loaded weights, the
quick run's same-run ratios."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchmark_run import row, run_bench

TINY = ("perception", "--config", "tiny", "--device", "cpu", "--image-hw", "64", "96",
        "--cams", "2", "--batches", "--points", "0", "--iters", "2", "--warmup", "1",
        "--threads", "1")


@pytest.mark.slow
def test_rows_errors_and_weights(tmp_path: Path) -> None:
    from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig

    torch.manual_seed(5)  # other weights than the benchmark's seeded init
    weights = tmp_path / "w.pt"
    torch.save(MultiTaskPerceptionModel(PerceptionConfig.tiny()).state_dict(), weights)
    variants = ("--variants", "eager_fp32", "eager_bf16_cl", "tensorrt_fp16")
    seeded = run_bench(tmp_path / "a", *TINY, *variants)
    trained = run_bench(tmp_path / "b", *TINY, *variants, "--weights", str(weights))
    for rec in (seeded, trained):
        assert [r["name"] for r in rec["results"]] == [
            "eager_fp32@cams2_b1", "eager_bf16_cl@cams2_b1", "tensorrt_fp16@cams2_b1"]
        assert row(rec, "eager_fp32@cams2_b1")["role"] == "baseline"
        assert row(rec, "eager_fp32@cams2_b1")["latency_ms"]["p50"] > 0
        assert row(rec, "eager_bf16_cl@cams2_b1")["drift"]["seg_max_abs"] >= 0
        assert "tensorrt" in row(rec, "tensorrt_fp16@cams2_b1")["error"].lower()
    assert seeded["config"]["weights"] is None and trained["config"]["weights"] == str(weights)
    a = row(seeded, "eager_bf16_cl@cams2_b1")["drift"]
    b = row(trained, "eager_bf16_cl@cams2_b1")["drift"]
    assert a != b  # the drift was measured on the loaded weights


@pytest.mark.slow
def test_quick_run_has_the_ratios_the_gate_reads(tmp_path: Path) -> None:
    rec = run_bench(tmp_path / "perception_cpu", "perception", "--quick")
    opt = row(rec, "auto@cams2_b1")
    assert opt["role"] == "optimized" and opt["config"]["resolved"]
    assert opt["throughput"]["unit"] == "img/s" and opt["peak_memory_mb"] > 0
    assert {"optimized_vs_baseline_p50", "optimized_vs_baseline_p99"} <= set(rec["ratios"])
    assert "skipped" in opt["power"]
