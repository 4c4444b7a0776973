"""The planner's training pairs and trainer: every target is a plan of the plan language that
the validator accepts in its scene (or a refusal), the held-out split shares no template with
training, and the trainer script runs end to end for a few steps."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from kestrel_planner.core import PlanLimits, PlanValidator, SceneObject, parse_plan
from kestrel_planner.core.plan import REFUSALS
from kestrel_planner.training.data import (FRAMES, OBJECT_NAMES, TEMPLATES, SampleGenerator,
                                           render_scene)
from kestrel_planner.training.train import TrainConfig, evaluate, train

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[4]


def _train_planner_script():
    """scripts/train_planner.py as a module (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("train_planner",
                                                  ROOT / "scripts" / "train_planner.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_targets_are_valid_plans_or_refusals() -> None:
    validator = PlanValidator(PlanLimits(max_steps=8))
    kinds: set[str] = set()
    for split, seed in (("train", 0), ("heldout", 1)):
        gen = SampleGenerator(seed, split)
        for _ in range(400):
            s = gen.sample()
            kinds.add(s.kind)
            plan = parse_plan(s.plan, s.instruction)
            scene = [SceneObject(n, n, s.positions[n]) for n in s.objects]
            report = validator.validate(plan, scene)
            if plan.refusal:
                assert plan.refusal in REFUSALS and not report.accepted
                if plan.refusal == "absent_object":  # the named object is really missing
                    assert s.kind == "absent"
            else:
                assert report.accepted, (s, report.reasons)
                assert all(st.target_object in s.objects for st in plan.steps
                           if st.target_object)
    assert {"place", "pick", "push", "move_to", "home", "absent", "unsupported"} <= kinds


def test_heldout_templates_and_frames_are_not_trained() -> None:
    for kind, (train_t, held_t) in TEMPLATES.items():
        assert held_t and not set(train_t) & set(held_t), kind
    assert not set(FRAMES[0]) & set(FRAMES[1])
    seen = {SampleGenerator(0, "train").sample().template for _ in range(2000)}
    held = {t for _, h in TEMPLATES.values() for t in h}
    assert not seen & held
    img = render_scene(["red_cube", "bin", "table"], {"red_cube": (0.5, 0.0, 0.42),
                                                      "bin": (0.6, 0.3, 0.44),
                                                      "table": (0.55, 0.0, 0.4)},
                       __import__("numpy").random.default_rng(0))
    assert img.shape == (32, 32, 3) and img.dtype.name == "uint8"
    assert len(OBJECT_NAMES) == 8


def test_trainer_steps_and_evaluation() -> None:
    model, hist = train(TrainConfig(steps=3, batch=4, warmup=1))
    assert len(hist.loss) == 3 and all(math.isfinite(x) for x in hist.loss)
    on = evaluate(model, 8, grammar=True, batch=8)
    off = evaluate(model, 8, grammar=False, batch=8)
    assert on["samples"] == off["samples"] == 8
    assert on["grammatical"] == 1.0  # the plan grammar: every text is a plan
    assert set(on) == set(off) >= {"exact", "refusals", "false_refusals", "accepted"}


def test_train_planner_script(tmp_path: Path) -> None:
    mod = _train_planner_script()
    out = tmp_path / "w.pt"
    assert mod.main(["--out", str(out), "--steps", "2", "--batch", "4",
                     "--eval-samples", "4"]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["config"]["steps"] == 2 and record["config"]["seed"] == 0
    assert set(record["heldout"]) == {"grammar_on", "grammar_off"}
    state = torch.load(out, weights_only=True)
    assert any(k.startswith("layers.") for k in state)


def test_heldout_unsupported_verbs_are_never_trained() -> None:
    train_t, held_t = TEMPLATES["unsupported"]
    trained = {t.split(" ")[0] for t in train_t}
    assert len(trained) >= 40  # refusal is learned from many verbs, not a short list
    assert {"kick", "dance"} <= {t.split(" ")[0] for t in held_t}
    assert not {"kick", "dance"} & trained


def test_evaluate_only_fills_the_metrics_of_weights_trained_elsewhere(tmp_path: Path) -> None:
    mod = _train_planner_script()
    out = tmp_path / "w.pt"
    assert mod.main(["--out", str(out), "--steps", "2", "--batch", "4",
                     "--eval-samples", "0"]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["heldout"] == {}
    assert mod.main(["--out", str(out), "--evaluate-only", "--eval-samples", "4"]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert set(record["heldout"]) == {"grammar_on", "grammar_off"}
    assert record["heldout"]["grammar_on"]["samples"] == 4
    assert "--evaluate-only" in record["evaluation"]["command"]


def test_fine_tuning_starts_from_the_given_weights(tmp_path: Path) -> None:
    """--init: training continues from a state dict (lr 0 leaves it as loaded); the record
    names where it started; weights of another preset are refused."""
    mod = _train_planner_script()
    first = tmp_path / "first.pt"
    assert mod.main(["--out", str(first), "--steps", "2", "--batch", "4",
                     "--eval-samples", "0"]) == 0
    tuned = tmp_path / "tuned.pt"
    assert mod.main(["--out", str(tuned), "--init", str(first), "--steps", "1", "--batch", "4",
                     "--lr", "0", "--eval-samples", "0"]) == 0
    a, b = torch.load(first, weights_only=True), torch.load(tuned, weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    record = json.loads(tuned.with_suffix(".json").read_text())
    assert record["init"]["path"] == str(first)
    assert record["init"]["record"]["command"].endswith("--eval-samples 0")
    with pytest.raises(RuntimeError):  # a draft's weights are not a small model's
        train(TrainConfig(preset="draft", steps=1, batch=4, warmup=1, init=str(first)))
