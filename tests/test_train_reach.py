"""scripts/train_reach.py runs end to end for a few steps (what CI runs of the trainer)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("rsl_rl")
pytest.importorskip("onnxscript")  # torch.onnx.export's exporter, used by rsl_rl's

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("train_reach", ROOT / "scripts/train_reach.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_reach"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_two_iterations_export_policy_files_and_metrics(tmp_path: Path) -> None:
    rc = _script().main(["--iterations", "2", "--num-envs", "8", "--threads", "1",
                         "--steps-per-env", "4", "--seed", "1", "--out", str(tmp_path),
                         "--no-progress"])
    assert rc == 0
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["iterations_done"] == 2 and metrics["seed"] == 1
    assert len(metrics["curve"]) >= 2
    params = metrics["node_parameters"]
    assert params["policy.obs_layout"] == ["joint_pos_rel", "joint_vel", "ee_target_rel"]
    assert params["policy.action_mode"] == "position_delta" and params["policy.obs_dim"] == 15
    # rsl_rl's own exports: TorchScript (obs [B, 15] -> actions [B, 6]) and ONNX
    policy = torch.jit.load(str(tmp_path / "policy.pt"))
    assert policy(torch.zeros(2, 15)).shape == (2, 6)
    import onnx

    model = onnx.load(str(tmp_path / "policy.onnx"))
    assert [i.name for i in model.graph.input] == ["obs"]
    assert [o.name for o in model.graph.output] == ["actions"]
