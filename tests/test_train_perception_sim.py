"""scripts/train_perception_sim.py runs end to end for a few steps (what CI runs of the
trainer), and the held-out metrics of scripts/perception_sim_eval.py."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("MUJOCO_GL", "osmesa")
os.environ.setdefault("PYOPENGL_PLATFORM", os.environ["MUJOCO_GL"])

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_average_precision() -> None:
    ap = _load("perception_sim_eval").average_precision
    assert ap([0.9, 0.8], [True, True], 2) == pytest.approx(1.0)
    assert ap([0.9, 0.8], [False, True], 2) == pytest.approx(0.25)  # recall 0.5 at prec 0.5
    assert ap([0.9], [True], 2) == pytest.approx(0.5)  # one of two objects found
    assert ap([], [], 3) == 0.0
    assert ap([0.5], [False], 0) is None  # no object of the class: no AP


@pytest.mark.slow
def test_few_steps_write_weights_and_metrics(tmp_path: Path) -> None:
    pytest.importorskip("mujoco")
    pytest.importorskip("yaml")
    out = tmp_path / "w.pt"
    try:
        rc = _load("train_perception_sim").main(
            ["--frames", "4", "--eval-frames", "2", "--node-eval-frames", "2", "--steps", "2",
             "--batch-size", "2", "--time-budget", "0", "--threads", "1", "--cache-dir", "",
             "--out", str(out)])
    except RuntimeError as exc:  # no OSMesa / EGL
        if "GL" not in str(exc):
            raise
        pytest.skip(f"offscreen rendering unavailable: {exc}")
    assert rc == 0 and out.is_file()
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["steps_done"] == 2 and meta["episodes"]["max_distractors"] >= 0
    node = meta["eval_node_heldout"]
    assert node["frames"] == 2 and 0.0 <= node["mask_miou"] <= 1.0
    assert set(node["per_class"]) == {"table", "red_cube", "green_cube", "blue_cylinder", "bin",
                                      "robot"}
    assert set(node["position_error"]) == {"lidar", "predicted_depth"}
