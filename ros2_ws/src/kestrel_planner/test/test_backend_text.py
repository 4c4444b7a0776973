"""Backend plan_text: the instruction is the plan text; it gets the same parser and validator
as a model's output (targets in the scene, limits), and nothing else is decoded."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_planner.core import (PlanLimits, PlannerConfig, PlannerCore, SceneObject, Skill,
                                  make_backend)
from kestrel_planner.core.backend_text import PlanTextBackend, plan_text_of

SCENE = [SceneObject("red_cube", "red_cube", (0.4, 0.0, 0.02)),
         SceneObject("bin", "bin", (0.3, 0.3, 0.0))]
IMAGE = np.zeros((8, 8, 3), np.uint8)


def core() -> PlannerCore:
    return PlannerCore(PlannerConfig(backend="plan_text", limits=PlanLimits(max_speed=0.5)))


def test_the_instruction_is_the_plan() -> None:
    assert isinstance(make_backend(PlannerConfig(backend="plan_text")), PlanTextBackend)
    assert plan_text_of("pick red_cube speed=0.3;  place bin ;end") == \
        "pick red_cube speed=0.3\nplace bin\nend"
    r = core().plan("pick red_cube speed=0.3; place bin speed=0.3; end", IMAGE, SCENE)
    assert r.report.accepted, r.report.reasons
    assert [s.skill for s in r.plan.steps] == [Skill.PICK, Skill.PLACE]
    assert [s.target_object for s in r.plan.steps] == ["red_cube", "bin"]


def test_the_plan_text_is_validated_like_a_model_reply() -> None:
    c = core()
    absent = c.plan("pick blue_cylinder; place bin; end", IMAGE, SCENE)
    assert not absent.report.accepted
    assert any("'blue_cylinder' is not in the scene" in r for r in absent.report.reasons)
    fast = c.plan("pick red_cube speed=2; place bin; end", IMAGE, SCENE)
    assert not fast.report.accepted and "exceeds max_speed" in " ".join(fast.report.reasons)
    prose = c.plan("put the red cube in the bin", IMAGE, SCENE)
    assert prose.plan is None and prose.report.reasons[0].startswith("parse error")
    cancelled = c.plan("pick red_cube; place bin; end", IMAGE, SCENE,
                       should_cancel=lambda: True)
    assert cancelled.cancelled and cancelled.plan is None


def test_a_step_without_a_speed_gets_the_default_speed() -> None:
    """default_speed fills in the speed a step does not name, before validation, for every
    backend's plan alike; a named speed stays; 0 leaves the skills' default (0.1 m/s)."""
    c = PlannerCore(PlannerConfig(backend="plan_text", limits=PlanLimits(max_speed=0.5),
                                  default_speed=0.3))
    r = c.plan("pick red_cube; place bin speed=0.2; home; end", IMAGE, SCENE)
    assert r.report.accepted, r.report.reasons
    assert [s.arguments for s in r.plan.steps] == [{"speed": (0.3, "m/s")},
                                                   {"speed": (0.2, "m/s")}, {}]
    assert r.plan.steps[0].value("speed") == 0.3
    r = core().plan("pick red_cube; place bin; end", IMAGE, SCENE)
    assert [s.arguments for s in r.plan.steps] == [{}, {}]
    assert r.plan.steps[0].value("speed") == 0.1


@pytest.mark.parametrize("speed", [-0.1, 0.6, float("nan")])
def test_a_default_speed_over_max_speed_fails_naming_it(speed: float) -> None:
    with pytest.raises(ValueError, match="default_speed"):
        PlannerConfig(backend="plan_text", limits=PlanLimits(max_speed=0.5),
                      default_speed=speed)
