"""`kestrel_bench planner-steps --quick`: the decode step per kernel option at a tiny SmolVLM
shape on the CPU (eager; the same rows, roles and ratios as the GPU run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_run import row, run_bench

pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.mark.slow
def test_planner_steps_quick(tmp_path: Path) -> None:
    rec = run_bench(tmp_path / "planner_steps_cpu", "planner-steps", "--quick", "--shapes",
                    "smolvlm-tiny", "--options", "fused", "default", "cdt_whole_rows",
                    "--kernels", timeout=600)
    assert rec["config"]["copy_bandwidth_gb_s"] > 0
    for shape in ("smolvlm-tiny",):
        for opt in ("fused", "default", "cdt_whole_rows"):
            r = row(rec, f"{shape}_{opt}")
            assert "error" not in r, r
            assert r["throughput"]["unit"] == "steps/s" and r["latency_ms"]["p50"] > 0
            assert r["metrics"]["agreement"] == 1.0  # the same greedy tokens as the first row
            assert 0 < r["metrics"]["floor_fraction"]
        assert row(rec, f"{shape}_default")["config"]["decode_attention"] == "grouped"  # CPU
        tag = shape.replace(".", "_").replace("-", "_")
        assert f"default_vs_fused_{tag}" in rec["ratios"]
    assert row(rec, "smolvlm-tiny_fused")["role"] == "baseline"
    assert row(rec, "smolvlm-tiny_default")["role"] == "optimized"
    assert row(rec, "smolvlm-tiny_cdt_whole_rows")["role"] == "variant"
    # the kernel tables need the GPU's step graph: on the CPU the record says so
    assert "tables" not in rec
    assert any(n.startswith("--kernels: no kernel tables") for n in rec["notes"])
