"""`kestrel_bench planner-hf --quick`: HF VLM checkpoints (tiny shapes of Qwen2.5-VL and
SmolVLM, random weights) on our engine vs transformers on the CPU; the same code path the GPU
run takes with the published shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_run import row, run_bench

pytest.importorskip("transformers", reason="transformers is not installed")


@pytest.mark.slow
def test_planner_hf_quick(tmp_path: Path) -> None:
    rec = run_bench(tmp_path / "planner_hf_cpu", "planner-hf", "--quick", timeout=600)
    assert rec["config"]["copy_bandwidth_gb_s"] > 0 and rec["config"]["concurrent"] == 4
    for shape in ("qwen2.5-vl-tiny", "smolvlm-tiny"):
        for kind in ("hf", "hf_c4", "engine", "engine_c4"):
            r = row(rec, f"{shape}_{kind}")
            assert "error" not in r, r
            assert r["throughput"]["unit"] == "tok/s" and r["throughput"]["value"] > 0
            m = r["metrics"]
            assert m["ttft_ms"] > 0 and m["ttft_p99_ms"] >= m["ttft_ms"] * 0.99
            assert m["floor_ms"] > 0 and 0 < m["floor_fraction"]
        for kind in ("hf_c4", "engine_c4"):
            assert row(rec, f"{shape}_{kind}")["metrics"]["agg_tok_s"] > 0
        assert row(rec, f"{shape}_hf")["config"]["cache"] in ("static", "dynamic")
        assert row(rec, f"{shape}_engine")["metrics"]["image_tokens"] > 1
        tag = shape.replace(".", "_").replace("-", "_")
        assert {f"engine_vs_hf_tok_s_{tag}", f"engine_vs_hf_ttft_{tag}",
                f"engine_vs_hf_tok_s_{tag}_c4"} <= set(rec["ratios"])
    assert row(rec, "qwen2.5-vl-tiny_hf")["role"] == "baseline"
    assert row(rec, "qwen2.5-vl-tiny_engine")["role"] == "optimized"


@pytest.mark.slow
def test_planner_hf_budget_still_writes_the_record(tmp_path: Path) -> None:
    """A run past --budget-s records the sections it did not start as skipped and writes its
    record (a GPU run cut at a time limit left none)."""
    rec = run_bench(tmp_path / "planner_hf_cpu", "planner-hf", "--quick", "--shapes",
                    "qwen2.5-vl-tiny", "smolvlm-tiny", "--budget-s", "0.001", timeout=600)
    for shape in ("qwen2.5-vl-tiny", "smolvlm-tiny"):
        for kind in ("hf", "hf_c4", "engine", "engine_c4"):
            assert "budget" in row(rec, f"{shape}_{kind}").get("skipped", ""), shape


@pytest.mark.slow
def test_planner_hf_merge_keeps_the_other_shapes_rows(tmp_path: Path) -> None:
    """Shapes measured in separate runs (a per-command time limit) end in one record: --merge
    keeps the rows and ratios of the shapes it does not measure, each naming its run."""
    stem = tmp_path / "planner_hf_cpu"
    first = run_bench(stem, "planner-hf", "--quick", "--shapes", "qwen2.5-vl-tiny",
                      "--only", "hf", "engine", timeout=600)
    rec = run_bench(stem, "planner-hf", "--quick", "--shapes", "smolvlm-tiny", "--only", "hf",
                    "engine", "engine_x", "--multi", "4", "--merge", timeout=600)
    multi = row(rec, "smolvlm-tiny_engine_x4")
    assert multi["config"]["steps_per_replay"] == 4 and multi["throughput"]["value"] > 0
    assert row(rec, "smolvlm-tiny_engine")["config"]["steps_per_replay"] == 1
    assert rec["ratios"]["engine_x4_vs_hf_tok_s_smolvlm_tiny"] > 0
    assert rec["config"]["shapes"] == ["qwen2.5-vl-tiny", "smolvlm-tiny"]
    for kind in ("hf", "engine"):
        kept = row(rec, f"qwen2.5-vl-tiny_{kind}")
        assert kept["run"]["date"] == first["date"] and "throughput" in kept
        assert "run" not in row(rec, f"smolvlm-tiny_{kind}")
    assert row(rec, "qwen2.5-vl-tiny_hf")["role"] == "baseline"
    assert row(rec, "qwen2.5-vl-tiny_engine")["role"] == "optimized"
    # a second merge keeps the rows' own run, not the record they passed through
    again = run_bench(stem, "planner-hf", "--quick", "--shapes", "smolvlm-tiny", "--only", "hf",
                      "--merge", timeout=600)
    assert row(again, "qwen2.5-vl-tiny_hf")["run"]["date"] == first["date"]
    assert f"on {first['date']}" in " ".join(again["notes"])
    assert {"engine_vs_hf_tok_s_qwen2_5_vl_tiny", "engine_vs_hf_tok_s_smolvlm_tiny"} <= set(
        rec["ratios"])
