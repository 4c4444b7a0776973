"""The subcommands that run over DDS, on tiny configs: `transport` (result build, delivery,
command publish) and `perception-node` (the node end to end)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchmark_run import row, run_bench


@pytest.mark.dds
def test_transport_build_results_commands(tmp_path: Path, env: dict[str, str]) -> None:
    rec = run_bench(tmp_path / "transport", "transport", "--parts", "build", "results",
                    "commands", "--sets", "5", "--count", "300", env=env)
    assert row(rec, "build:message")["role"] == "baseline"
    assert row(rec, "build:cdr")["role"] == "optimized"
    cdr = row(rec, "results:cdr")
    assert cdr["metrics"]["received"] == cdr["metrics"]["published"] == 5
    assert cdr["metrics"]["bytes"] > 100_000
    assert row(rec, "commands:publish")["latency_ms"]["n"] == 300
    assert {"build_optimized_vs_baseline_p50", "results_optimized_vs_baseline_p50"} <= set(
        rec["ratios"])


@pytest.mark.dds
@pytest.mark.slow
def test_perception_node_end_to_end(tmp_path: Path, env: dict[str, str]) -> None:
    rec = run_bench(tmp_path / "perception_node", "perception-node", "--config", "tiny",
                    "--device", "cpu", "--cams", "1", "--image-hw", "64", "96", "--points",
                    "2000", "--rate", "5", "--frames", "8", "--publisher-warmup-s", "0.5",
                    "--ready-timeout", "120", env=env, timeout=280)
    e2e = row(rec, "e2e")
    assert e2e["metrics"]["results"] > 0 and e2e["latency_ms"]["p50"] > 0
    assert e2e["metrics"]["frames"] == 8
    assert any(r["name"] == "stage:model" for r in rec["results"])
    assert rec["config"]["node_params"]["model.backbone_depth"] == 18
