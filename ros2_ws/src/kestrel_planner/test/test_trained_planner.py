"""The packaged planner weights (planner.yaml's defaults) plan the embedded sim's tasks.

The evaluator's instructions (kestrel_bringup.evaluate) on the sim's objects give the
pick-and-place plan, accepted by the validator; an unsupported action and an absent object
are refused with their reasons; the held-out metrics are recorded next to the weights.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import yaml

from kestrel_planner.core.plan import SceneObject, format_plan
from kestrel_planner.core.planner_core import PlannerConfig, PlannerCore
from kestrel_planner.core.validator import PlanLimits

SRC = Path(__file__).resolve().parents[2]
WEIGHTS = SRC / "kestrel_planner" / "weights" / "planner_small.pt"
SIM_SCENE = {"red_cube": (0.55, 0.1, 0.425), "green_cube": (0.5, -0.15, 0.425),
             "blue_cylinder": (0.62, 0.0, 0.425), "bin": (0.45, 0.3, 0.44),
             "table": (0.55, 0.0, 0.4), "robot": (0.0, 0.0, 0.42)}


@pytest.fixture(scope="module")
def core() -> PlannerCore:
    params = yaml.safe_load((SRC / "kestrel_bringup" / "config" / "planner.yaml").read_text())
    p = params["planner"]["ros__parameters"]
    assert p["weights_path"].endswith("kestrel_planner/weights/planner_small.pt")
    assert p["demo_plan"] == "" and p["backend"] == "generate"
    return PlannerCore(PlannerConfig(model=p["model_config"], weights_path=str(WEIGHTS),
                                     limits=PlanLimits(max_speed=0.5, max_height=0.4,
                                                       max_steps=8),
                                     max_new_tokens=64, max_batch=8))


def _scene(names: list[str]) -> list[SceneObject]:
    return [SceneObject(n, n, SIM_SCENE[n]) for n in names]


@pytest.mark.parametrize("task", ["bin", "stack", "push"])
def test_the_evaluators_instructions_become_their_plans(core: PlannerCore, task: str) -> None:
    """Each closed-loop task's instructions (kestrel_bringup.episode_tasks), in random scenes:
    the trained planner's plan is the task's oracle plan, step for step."""
    from kestrel_bringup.episode_tasks import TEMPLATES, instruction_for

    rng = random.Random(0)
    image = np.zeros((32, 32, 3), np.uint8)
    templates = set()
    for _ in range(12):
        present = [n for n in ("red_cube", "green_cube", "blue_cylinder")
                   if rng.random() < 0.7] or ["green_cube"]
        if task == "stack" and len(present) < 2:
            present = ["red_cube", "blue_cylinder"]
        names = present + ["bin", "table", "robot"]
        rng.shuffle(names)
        goal = rng.choice(present)
        base = rng.choice([n for n in present if n != goal]) if task == "stack" else ""
        instruction = instruction_for(task, goal, rng, base)
        templates.add(instruction.split()[0])
        res = core.plan(instruction, image, _scene(names))
        assert res.plan is not None and res.report.accepted, (instruction, res.text)
        want = {"bin": [f"pick {goal}", "place bin"], "stack": [f"pick {goal}", f"place {base}"],
                "push": [f"push {goal}"]}[task]
        assert format_plan(res.plan).split("\n")[:len(want) + 1] == [*want, "end"], \
            (instruction, names, res.text)
    assert len(templates) > 1  # more than one of the task's templates was asked
    assert len(TEMPLATES[task]) >= 3


@pytest.mark.parametrize("instruction, names, reason", [
    ("throw the red cube", ["red_cube", "bin", "table"], "unsupported_action"),
    ("pick up the blue cylinder", ["red_cube", "blue_cube", "bin"], "absent_object"),
])
def test_refusals(core: PlannerCore, instruction: str, names: list[str], reason: str) -> None:
    scene = [SceneObject(n, n, SIM_SCENE.get(n, (0.5, 0.0, 0.425))) for n in names]
    res = core.plan(instruction, np.zeros((32, 32, 3), np.uint8), scene)
    assert res.plan is not None and res.plan.refusal == reason, res.text
    assert not res.report.accepted


def test_the_weights_carry_their_heldout_metrics() -> None:
    record = json.loads(WEIGHTS.with_suffix(".json").read_text())
    assert record["config"]["preset"] == "small" and record["command"]
    for mode in ("grammar_on", "grammar_off"):
        m = record["heldout"][mode]
        assert m["samples"] >= 1000
        assert {"exact", "refusals", "false_refusals", "accepted", "exact_by_kind"} <= set(m)
    assert record["heldout"]["grammar_on"]["grammatical"] == 1.0
