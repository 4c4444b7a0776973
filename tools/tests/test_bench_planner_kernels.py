"""`kestrel_bench planner --quick` (HF eager vs the engine on the CPU) and `kestrel_bench
kernels` on a machine without CUDA (every group recorded as skipped, no crash)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchmark_run import row, run_bench


@pytest.mark.slow
def test_planner_quick(tmp_path: Path) -> None:
    rec = run_bench(tmp_path / "planner_cpu", "planner", "--quick")
    base, opt = row(rec, "hf_eager"), row(rec, "engine_eager")
    assert base["role"] == "baseline" and opt["role"] == "optimized"
    for r in (base, opt):
        assert r["throughput"]["unit"] == "tok/s" and r["throughput"]["value"] > 0
        assert r["metrics"]["ttft_ms"] > 0
    assert rec["ratios"]["optimized_vs_baseline_tok_s"] == pytest.approx(
        opt["throughput"]["value"] / base["throughput"]["value"])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the kernel benchmarks")
def test_kernels_without_cuda_are_skipped_rows(tmp_path: Path) -> None:
    rec = run_bench(tmp_path / "kernels", "kernels")
    assert [(r["name"], r.get("skipped")) for r in rec["results"]] == [
        (g, "needs a CUDA GPU") for g in ("box_median", "nms", "decode")]
