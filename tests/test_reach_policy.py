"""The committed reaching policy (rsl_rl's policy.pt export) loads through the control node's
user-model path (PolicyRunner, TorchScript ModelSpec, the obs_layout / action mapping of its
metrics.json) and reaches targets in the simulator's world at 1 kHz and 500 Hz."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("pinocchio")

ROOT = Path(__file__).resolve().parents[1]
WEIGHTS = ROOT / "ros2_ws/src/kestrel_control/weights/reach"


def _eval():
    spec = importlib.util.spec_from_file_location("eval_reach", ROOT / "scripts/eval_reach.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["eval_reach"] = module
    spec.loader.exec_module(module)
    return module


def test_weights_are_rsl_rl_exports_with_their_node_parameters() -> None:
    metrics = json.loads((WEIGHTS / "metrics.json").read_text())
    params = metrics["node_parameters"]
    assert params["policy.obs_layout"] == ["joint_pos_rel", "joint_vel", "ee_target_rel"]
    assert metrics["versions"]["rsl-rl-lib"].startswith("5.5")
    for name in ("policy.pt", "policy.onnx", "policy.onnx.data"):
        assert (WEIGHTS / name).stat().st_size < 2_000_000  # small, committed


@pytest.mark.slow
@pytest.mark.parametrize("rate_hz", [1000.0, 500.0])
def test_policy_reaches_held_out_targets_within_1cm_in_2s(rate_hz: float) -> None:
    ev = _eval()
    scene = ev.Scene(seed=7, count=3)  # targets the training never drew (its seed is 0)
    out = ev.evaluate(scene, "learned", rate_hz, episode_s=2.0, latency_steps=1)
    assert out["success_rate"] == 1.0, out
    assert out["final_distance_mm_max"] < 10.0


def test_onnx_export_runs_through_the_onnxruntime_backend_like_the_torchscript_one() -> None:
    """policy.onnx (with the exporter's external data file) through the node's ONNX path gives
    the same commands as policy.pt."""
    pytest.importorskip("onnxruntime")
    import numpy as np

    ev = _eval()
    runners = []
    for backend, name in (("cpu_eager", "policy.pt"), ("onnxruntime", "policy.onnx")):
        runner = ev.policy_runner(WEIGHTS, model_file=name, backend=backend)
        robot = runner.robots[0]
        robot.joint_states.write(np.array([[0.2, -0.1, 1.3, 1.1, 0.1, -0.2],
                                           [0.1, 0.0, -0.2, 0.3, 0.0, 0.1]]), 1_000)
        robot.ee_target.write(np.array([0.45, 0.1, 0.55]))
        runners.append(runner.step(1_000)[0].copy())
    np.testing.assert_allclose(runners[0], runners[1], atol=1e-5)
