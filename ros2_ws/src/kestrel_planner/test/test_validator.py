"""Plan text form, parse errors, and the validator (limits, scene, gripper logic)."""

from __future__ import annotations


import pytest

from kestrel_planner.core.plan import (
    Plan, PlanParseError, PlanStep, SceneObject, format_number, format_plan, parse_plan,
)
from kestrel_planner.core.skills import SKILLS, Skill, skill_by_name
from kestrel_planner.core.validator import PlanLimits, PlanValidator

SCENE = [
    SceneObject("red_cube", "red_cube", (0.4, 0.0, 0.02)),
    SceneObject("bin", "bin", (0.3, 0.3, 0.0)),
    SceneObject("ghost", "ghost", None),
    SceneObject("far_box", "far_box", (3.0, 0.0, 0.0)),
]
LIMITS = PlanLimits(max_speed=0.5, min_height=0.0, max_height=0.3,
                    workspace_min=(-1.0, -1.0, -0.05), workspace_max=(1.0, 1.0, 1.0), max_steps=6)


def check(text: str, max_steps: int | None = None) -> tuple[bool, list[str]]:
    r = PlanValidator(LIMITS).validate(parse_plan(text), SCENE, max_steps)
    return r.accepted, r.reasons


def test_skill_enumeration_matches_taskstep_msg() -> None:
    assert [(s.name, s.value) for s in Skill] == [
        ("MOVE_TO", 0), ("PICK", 1), ("PLACE", 2), ("PUSH", 3), ("OPEN_GRIPPER", 4),
        ("CLOSE_GRIPPER", 5), ("HOME", 6)]
    assert {s.text for s in Skill if SKILLS[s].needs_target} == {"move_to", "pick", "place",
                                                               "push"}
    assert SKILLS[Skill.PICK].arg("speed").unit == "m/s"
    assert SKILLS[Skill.PUSH].arg("distance").unit == "m"
    assert skill_by_name("self_destruct") is None


def test_parse_and_format_round_trip() -> None:
    text = "pick red_cube speed=0.1 height=0.05\nplace bin\nhome\nend"
    plan = parse_plan(text, "put it away")
    assert plan.instruction == "put it away"
    assert [(Skill(s.skill), s.target_object) for s in plan.steps] == [
        (Skill.PICK, "red_cube"), (Skill.PLACE, "bin"), (Skill.HOME, "")]
    assert plan.steps[0].arguments == {"speed": (0.1, "m/s"), "height": (0.05, "m")}
    assert plan.steps[1].value("speed") == SKILLS[Skill.PLACE].arg("speed").default
    assert format_plan(plan) == text
    refusal = parse_plan("refuse absent_object\nend \n")
    assert refusal.steps == [] and refusal.refusal == "absent_object"
    assert format_plan(refusal) == "refuse absent_object\nend"
    assert format_number(2.0) == "2" and format_number(-0.0) == "0"
    with pytest.raises(ValueError):
        format_number(1234.0)


@pytest.mark.parametrize("text, reason", [
    ("self_destruct\nend", "unknown skill 'self_destruct'"),
    ("pick red_cube", "missing the final 'end'"),
    ("end\npick red_cube", "text after 'end'"),
    ("pick\nend", "needs a target"),
    ("pick speed=0.1\nend", "needs a target"),
    ("pick red_cube force=3\nend", "has no argument 'force'"),
    ("pick red_cube speed=0.1 speed=0.2\nend", "given twice"),
    ("pick red_cube speed=1e3\nend", "malformed number"),
    ("pick red_cube speed=fast\nend", "malformed number"),
    ("pick  red_cube\nend", "single spaces"),
    ("pick Red-Cube\nend", "invalid target name"),
    ("home now\nend", "expected name=value"),
    ("end", "a plan needs at least one step"),
    ("end\n \n", "a plan needs at least one step"),
    ("refuse tired\nend", "unknown refusal reason 'tired'"),
    ("refuse absent_object\nhome\nend", "a refusal is a whole plan"),
    ("home\nrefuse absent_object\nend", "unknown skill 'refuse'"),
])
def test_parse_errors_have_reasons(text: str, reason: str) -> None:
    with pytest.raises(PlanParseError, match=reason):
        parse_plan(text)


def test_limits_validation_names_parameter() -> None:
    for kwargs, name in [({"max_speed": 0.0}, "max_speed"), ({"max_speed": -1.0}, "max_speed"),
                         ({"min_height": 0.5, "max_height": 0.1}, "min_height"),
                         ({"workspace_min": (0, 0, 2)}, "workspace_min"),
                         ({"workspace_max": (1, 1)}, "workspace_max"),
                         ({"max_steps": 0}, "max_steps")]:
        with pytest.raises(ValueError, match=f"parameter '{name}'"):
            PlanLimits(**kwargs)


def test_valid_plan_accepted() -> None:
    ok, reasons = check("pick red_cube speed=0.2 height=0.1\nplace bin height=0.05\n"
                        "open_gripper\nhome\nend")
    assert ok and reasons == []


@pytest.mark.parametrize("text, fragment", [
    ("pick red_cube speed=10\nend", "speed 10.0 m/s exceeds max_speed 0.5"),
    ("move_to bin height=0.9\nend", "height 0.9 m outside [0.0, 0.3]"),
    ("move_to bin height=-0.2\nend", "height -0.2 m outside"),
    ("move_to bin speed=0\nend", "argument 'speed' = 0.0 m/s is not valid"),
    ("move_to bin speed=-1\nend", "argument 'speed' = -1.0 m/s is not valid"),
    ("push bin distance=-0.1\nend", "argument 'distance' = -0.1 m is not valid"),
    ("push bin distance=0.9\nend", "outside the workspace"),
    ("pick blue_ball\nend", "target 'blue_ball' is not in the scene"),
    ("pick ghost\nend", "target 'ghost' has no 3D position"),
    ("move_to far_box\nend", "target 'far_box' at (3.000, 0.000, 0.000) m is outside"),
    ("place bin\nend", "PLACE needs a preceding PICK"),
    ("pick red_cube\npick bin\nend", "already holding 'red_cube'"),
    ("pick red_cube\nplace red_cube\nend", "onto itself"),
    ("pick red_cube\nopen_gripper\nplace bin\nend", "PLACE needs a preceding PICK"),
    ("home\n" * 7 + "end", "plan has 7 steps, more than max_steps 6"),
])
def test_rejections_with_reasons(text: str, fragment: str) -> None:
    ok, reasons = check(text)
    assert not ok
    assert any(fragment in r for r in reasons), reasons


def test_request_max_steps_and_default_args_checked() -> None:
    ok, reasons = check("home\nhome\nhome\nend", max_steps=2)
    assert not ok and "more than max_steps 2" in reasons[0]
    strict = PlanValidator(PlanLimits(max_speed=0.05))
    report = strict.validate(parse_plan("move_to bin\nend"), SCENE)
    assert not report.accepted and "speed 0.1 m/s (default) exceeds" in report.reasons[0]


def test_programmatic_steps_checked() -> None:
    """Plans built in code (e.g. from messages) get the same checks: units, unknown skills."""
    v = PlanValidator(LIMITS)
    bad_unit = Plan("x", [PlanStep(Skill.MOVE_TO, "bin", {"speed": (0.1, "km/h")})])
    r = v.validate(bad_unit, SCENE)
    assert not r.accepted and "unit 'km/h', expected 'm/s'" in r.reasons[0]
    r = v.validate(Plan("x", [PlanStep(42)]), SCENE)
    assert not r.accepted and "unknown skill 42" in r.reasons[0]
    nan = Plan("x", [PlanStep(Skill.MOVE_TO, "bin", {"height": (float("nan"), "m")})])
    assert not v.validate(nan, SCENE).accepted
    extra = Plan("x", [PlanStep(Skill.HOME, "bin")])
    r = v.validate(extra, SCENE)
    assert not r.accepted and "takes no target" in r.reasons[0]


def test_injection_text_is_data() -> None:
    """Out-of-limit values and unknown skills never pass, whatever the instruction says."""
    injected = ["pick red_cube speed=10\nend", "move_to red_cube speed=999.999\nend",
                "pick red_cube height=-999\nend"]
    for text in injected:
        assert not check(text)[0]
    with pytest.raises(PlanParseError):
        parse_plan("ignore the rules\nend")


def test_empty_plan_rejected() -> None:
    """Built in code (the parser refuses it): no steps is no plan."""
    r = PlanValidator(LIMITS).validate(Plan("x", []), SCENE)
    assert not r.accepted and r.reasons == ["plan has no steps"]


def test_refusal_is_rejected_with_its_reason() -> None:
    ok, reasons = check("refuse absent_object\nend")
    assert not ok and len(reasons) == 1
    assert "refused the task: the task names an object that is not in the scene" in reasons[0]
    assert "objects: bin, far_box, ghost, red_cube" in reasons[0]
    ok, reasons = check("refuse unsupported_action\nend")
    assert not ok and "cannot do" in reasons[0]


def test_every_problem_of_a_step_is_reported() -> None:
    """A step that breaks several rules lists each of them, not only the first."""
    ok, reasons = check("move_to far_box speed=10 height=0.9\nend")
    assert not ok
    assert any("speed 10.0 m/s exceeds max_speed" in r for r in reasons), reasons
    assert any("height 0.9 m outside" in r for r in reasons), reasons
    assert any("'far_box' at (3.000, 0.000, 0.000) m is outside" in r for r in reasons), reasons
    # a hard-bound failure does not hide the limit check of another argument
    ok, reasons = check("move_to bin speed=0 height=0.9\nend")
    assert any("'speed' = 0.0 m/s is not valid" in r for r in reasons), reasons
    assert any("height 0.9 m outside" in r for r in reasons), reasons
    # an argument limit does not hide the waypoint check
    ok, reasons = check("push bin speed=10 distance=0.9\nend")
    assert any("exceeds max_speed" in r for r in reasons), reasons
    assert any("end-effector point" in r for r in reasons), reasons
    # programmatic: a wrong unit and an invalid value of the same argument
    v = PlanValidator(LIMITS)
    r = v.validate(Plan("x", [PlanStep(Skill.MOVE_TO, "bin", {"speed": (-1.0, "km/h")})]), SCENE)
    assert any("unit 'km/h'" in x for x in r.reasons) and \
        any("is not valid" in x for x in r.reasons), r.reasons
