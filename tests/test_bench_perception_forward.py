"""scripts/bench_perception.py on the CPU (the tiny config, two iterations): eager fp32 first,
the JSON and table written, a failing variant recorded as a row, and --weights loaded into
the model every variant runs (the accuracy columns then compare trained weights)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "models"))


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_perception.py"), "--config", "tiny",
           "--device", "cpu", "--image-hw", "64", "96", "--cams", "2", "--batches",
           "--points", "0", "--iters", "2", "--warmup", "1", "--threads", "1",
           "--variants", "eager_fp32", "eager_bf16_cl", "tensorrt_fp16", "--out", str(out),
           *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert (out.with_suffix(".md")).is_file()
    return json.loads(out.with_suffix(".json").read_text())


def test_forward_bench_rows_errors_and_weights(tmp_path: Path) -> None:
    from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig

    torch.manual_seed(5)  # other weights than the bench's seeded init
    weights = tmp_path / "w.pt"
    torch.save(MultiTaskPerceptionModel(PerceptionConfig.tiny()).state_dict(), weights)
    seeded, trained = _run(tmp_path), _run(tmp_path, "--weights", str(weights))
    for res in (seeded, trained):
        rows = res["cases"][0]["variants"]
        assert [r["variant"] for r in rows] == ["eager_fp32", "eager_bf16_cl", "tensorrt_fp16"]
        assert rows[0]["p50_ms"] > 0 and rows[1]["accuracy"]["seg_max_abs"] >= 0
        assert "tensorrt_fp16" in rows[2]["error"]  # CPU / no TensorRT: a row, not a crash
    assert seeded["weights"] is None and trained["weights"] == str(weights)
    a = seeded["cases"][0]["variants"][1]["accuracy"]
    b = trained["cases"][0]["variants"][1]["accuracy"]
    assert a != b  # the drift was measured on the loaded weights
