"""The subcommands that run over DDS, on tiny configs: `transport` (result build, delivery,
command publish) and `perception-node` (the node end to end)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_run import ROOT, row, run_bench


@pytest.mark.dds
def test_transport_build_results_commands(tmp_path: Path, env: dict[str, str]) -> None:
    rec = run_bench(tmp_path / "transport", "transport", "--parts", "build", "results",
                    "commands", "--sets", "5", "--count", "300", "--cams", "2", "--image-hw",
                    "320", "320", env=env)
    assert row(rec, "build:message")["role"] == "baseline"
    assert row(rec, "build:cdr")["role"] == "optimized"
    cdr = row(rec, "results:cdr")
    assert cdr["metrics"]["received"] == cdr["metrics"]["published"] == 5
    assert cdr["metrics"]["bytes"] > 20_000  # masks and depths of 2 cameras
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


@pytest.mark.dds
def test_perception_sink_is_ready_only_once_matched(tmp_path: Path, env: dict[str, str],
                                                    probe) -> None:  # noqa: ANN001
    """The benchmark's result sink says "sink ready" (and the frames start) only once its
    subscription has matched the node's result publisher: a best-effort result published
    before that is lost. With no publisher it says so and exits 1; with one, it is ready."""
    from kestrel_bench.perception_node import result_qos
    from kestrel_interfaces.msg import PerceptionResult

    def sink(timeout: float) -> list[str]:
        return [sys.executable, "-m", "kestrel_bench", "perception-node", "--role", "sink",
                "--stamps-out", str(tmp_path / "rows.json"), "--match-timeout", str(timeout)]

    res = subprocess.run(sink(2.0), input="", capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env=env)
    assert res.returncode == 1 and "sink not matched" in res.stdout, res.stdout + res.stderr
    probe.node.create_publisher(PerceptionResult, "/perception/output/result",
                                result_qos("best_effort"))
    proc = subprocess.Popen(sink(60.0), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env=env)
    try:  # bounded: the sink answers within its match timeout
        assert proc.stdout.readline().strip() == "sink ready"
    finally:
        proc.stdin.close()
        assert proc.wait(30) == 0
