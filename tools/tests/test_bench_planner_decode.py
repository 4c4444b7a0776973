"""`kestrel_bench planner`'s decode-option rows: TTFT with and without prefix reuse (in
--quick), and speculative decoding of trained target + draft weights against the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from benchmark_run import row, run_bench


def test_prefix_rows_same_tokens_and_reuse() -> None:
    from kestrel_bench.planner_decode import bench_prefix
    from kestrel_models.planner import VisionLanguageModel, get_config

    torch.manual_seed(0)
    model = VisionLanguageModel(get_config("tiny")).eval()
    prompt = torch.randint(0, 256, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    image = torch.randint(0, 256, (3, 64, 64), dtype=torch.uint8)
    rows = bench_prefix(model, prompt, image, reps=2, max_len=256)
    assert set(rows) == {f"prefix_{n}_{s}" for n in ("system", "scene") for s in ("off", "on")}
    for name in ("system", "scene"):
        assert rows[f"prefix_{name}_on"]["same_tokens"] is True
        assert rows[f"prefix_{name}_off"]["reused"] == 0
    assert rows["prefix_scene_on"]["reused"] == 9  # the 2nd warm-up request and all 8 timed
    # (what the reuse saves in TTFT is the benchmark's figure, not asserted here: a test that
    # shares the CPU with other work cannot time it)
    assert all(rows[n]["ttft_ms"]["p50"] > 0 for n in rows)


@pytest.mark.slow
def test_spec_trained_rows(tmp_path: Path) -> None:
    """Target and draft trained a few steps on the planner task: the speculative rows decode
    the engine's plans and report the acceptance rate and the plan-time ratio."""
    from kestrel_planner.training.train import TrainConfig, train

    paths = {}
    for preset in ("small", "draft"):
        model, _ = train(TrainConfig(preset=preset, steps=2, batch=4, warmup=1))
        paths[preset] = tmp_path / f"{preset}.pt"
        torch.save(model.state_dict(), paths[preset])
    rec = run_bench(tmp_path / "planner_spec", "planner", "--only", "spec_trained",
                    "--device", "cpu", "--target-weights", str(paths["small"]),
                    "--draft-weights", str(paths["draft"]), "--k", "3", "--draft-layers", "1",
                    "--goals", "3")
    eng, spec = row(rec, "spec_engine"), row(rec, "spec_draft_k3")
    assert eng["throughput"]["unit"] == "tok/s" and eng["metrics"]["goals"] == 3
    assert spec["metrics"]["agree_engine"] == 1.0
    assert 0.0 <= spec["metrics"]["acceptance_rate"] <= 1.0 and spec["metrics"]["k"] == 3
    assert row(rec, "spec_layers1_k3")["metrics"]["agree_engine"] == 1.0
    assert rec["ratios"]["spec_draft_k3_vs_engine_plan_time"] > 0
    # the generate backend's loop decodes the same plans; the drafts are also timed against it
    assert row(rec, "spec_generate")["metrics"]["agree_engine"] == 1.0
    assert rec["ratios"]["spec_draft_k3_vs_generate_plan_time"] > 0
