"""Closed-loop evaluation bookkeeping: failure stages from what an episode showed, the Wilson
interval, the summary table (no ROS)."""

from __future__ import annotations

import pytest

from kestrel_bringup.evaluation import (STAGES, EpisodeTrace, markdown, summarize,
                                        wilson_interval, write_record)


def trace(**kw) -> EpisodeTrace:
    t = EpisodeTrace(seed=kw.pop("seed", 1), goal="red_cube",
                     instruction="put the red cube in the bin")
    for k, v in kw.items():
        setattr(t, k, v)
    return t


def test_each_failure_is_attributed_to_its_stage() -> None:
    ok = trace(plan_status="accepted")
    ok.observe(1.0, held=True, success=False)
    ok.observe(3.0, held=False, success=False, over_bin=True)
    ok.observe(4.0, held=False, success=True)
    assert ok.stage == "success" and ok.success_s == 4.0

    assert trace(plan_status="rejected", plan_reasons=["x"]).stage == "plan_rejected"
    assert trace(plan_status="none", goal_detected=False).stage == "perception_miss"
    assert trace(plan_status="accepted").stage == "reach_timeout"  # never held

    slip = trace(plan_status="accepted")
    slip.observe(1.0, held=True, success=False)
    slip.observe(2.0, held=False, success=False, over_bin=False)  # dropped on the way
    assert slip.stage == "grasp_slip"

    miss = trace(plan_status="accepted")
    miss.observe(1.0, held=True, success=False)
    miss.observe(2.0, held=False, success=False, over_bin=True)
    assert miss.stage == "place_miss"

    still = trace(plan_status="accepted")
    still.observe(1.0, held=True, success=False)
    assert still.stage == "timeout"  # held until the time ran out


def test_wilson_interval() -> None:
    assert wilson_interval(0, 0) == (0.0, 1.0)
    lo, hi = wilson_interval(45, 50)
    assert lo == pytest.approx(0.7864, abs=1e-3) and hi == pytest.approx(0.9565, abs=1e-3)
    lo, hi = wilson_interval(50, 50)
    assert hi == pytest.approx(1.0) and lo == pytest.approx(0.9287, abs=1e-3)


def test_summary_counts_the_failure_it_is_shown() -> None:
    traces = [trace(seed=i, plan_status="accepted", success_s=5.0 + i, deadline_misses=i)
              for i in range(3)]
    slip = trace(seed=9, plan_status="accepted")
    slip.observe(1.0, held=True, success=False)
    slip.observe(2.0, held=False, success=False, over_bin=False)
    traces.append(slip)
    s = summarize(traces, {"episodes": 4})
    assert s["episodes"] == 4 and s["successes"] == 3 and s["success_rate"] == 0.75
    assert s["failures_by_stage"]["grasp_slip"] == 1
    assert sum(s["failures_by_stage"].values()) == 1
    # a bin run's stages: every one but push's
    assert set(s["failures_by_stage"]) == set(STAGES) - {"success", "push_miss"}
    assert s["time_to_success_s"]["p50"] == 6.0
    assert s["per_episode"][3]["stage"] == "grasp_slip"
    md = markdown(s, "python -m kestrel_bringup.evaluate --episodes 4")
    assert "| 4 | 3 | 75.0% |" in md and "| grasp_slip | 1 |" in md


def test_video_and_plot(tmp_path) -> None:
    import imageio.v2 as imageio
    import numpy as np

    from kestrel_bringup.episode_media import plot_summary, write_video

    frames = []
    for i in range(6):
        rgb = np.zeros((64, 80, 3), dtype=np.uint8)
        rgb[:, : 10 * (i + 1)] = (200, 30, 30)
        frames.append((rgb, f"step {i // 2 + 1}/3 pick red_cube"))
    for name in ("ep.mp4", "ep.gif"):
        path = write_video(frames, tmp_path / name, fps=5.0)
        back = imageio.mimread(path)
        assert len(back) == 6 and back[0].shape[:2] == (64, 80)
        # the caption band is drawn over the frame's top left
        assert not np.array_equal(np.asarray(back[0])[:8, :40, :3], frames[0][0][:8, :40])
    with pytest.raises(ValueError, match=".mp4 or .gif"):
        write_video(frames, tmp_path / "ep.avi")
    s = summarize([trace(plan_status="accepted", success_s=3.0), trace()])
    png = plot_summary(s, tmp_path / "outcomes.png")
    assert png.stat().st_size > 1000 and imageio.imread(png).ndim == 3


def test_sim_speed_and_plan_source_are_reported() -> None:
    from kestrel_bringup.evaluation import sim_speed

    assert sim_speed(None, (5.0, 1.0)) is None
    assert sim_speed((1.0, 10.0), (1.0, 10.0)) is None  # no wall time between them
    speed = sim_speed((2.0, 100.0), (32.0, 160.0))
    assert speed == {"sim_s": 30.0, "wall_s": 60.0, "real_time_factor": 0.5}
    s = summarize([trace(plan_status="accepted", success_s=3.0)])
    s["sim_speed"] = speed
    s["plan_source"] = "oracle plan: the planner's model is NOT measured"
    md = markdown(s)
    assert "Sim-time speed: 0.50 sim s per wall s (30 sim s in 60 wall s)." in md
    # the plan source comes before the results, so a reader cannot miss it
    assert md.index("NOT measured") < md.index("| episodes |")


def test_the_oracle_plan_is_a_valid_pick_and_place() -> None:
    from kestrel_bringup.episode_tasks import oracle_plan
    from kestrel_planner.core import PlanValidator, SceneObject, Skill, parse_plan
    from kestrel_planner.core.backend_text import plan_text_of
    from kestrel_planner.core.validator import PlanLimits

    text = plan_text_of(oracle_plan("bin", "blue_cylinder", 0.3))
    plan = parse_plan(text)
    assert [(s.skill, s.target_object) for s in plan.steps] == [
        (Skill.PICK, "blue_cylinder"), (Skill.PLACE, "bin")]
    scene = [SceneObject("blue_cylinder", "blue_cylinder", (0.5, 0.1, 0.44)),
             SceneObject("bin", "bin", (0.42, 0.3, 0.44))]
    assert PlanValidator(PlanLimits()).validate(plan, scene).accepted


def test_failed_episodes_are_listed_with_their_steps() -> None:
    slip = trace(seed=7, plan_status="accepted")
    slip.steps = ["step 1/2 pick red_cube (failed): timeout after 10.0 s"]
    slip.position_error_m = {"red_cube": 0.052, "bin": None}
    md = markdown(summarize([trace(plan_status="accepted", success_s=3.0), slip]))
    assert ("| seed 7 | red_cube | reach_timeout | step 1/2 pick red_cube (failed): timeout "
            "after 10.0 s | red_cube 0.052, bin - |") in md
    assert "| seed 1 |" not in md  # successes are not listed


def test_flow_before_the_first_plan_does_not_ask_for_the_plans_links() -> None:
    from kestrel_bringup.stack_report import FLOW_CHAIN, StackReport

    r = StackReport()
    for _, topic in FLOW_CHAIN:
        if topic != "/control/target":
            r.on_message(topic, 1.0)
    r.sim_applied_commands = 5
    assert r.flow_failures(plans=False) == []  # the demo's start-up: no goal sent yet
    full = r.flow_failures()
    assert any("/control/target" in f for f in full) and any("no accepted plan" in f
                                                             for f in full)
    r.on_message("/control/target", 2.0)
    r.on_plan("accepted")
    assert r.flow_failures() == []


def test_the_result_file_names_machine_commit_and_date() -> None:
    from kestrel_bringup.evaluate import run_record

    rec = run_record()
    assert rec["machine"]["cpus"] >= 1 and rec["machine"]["class"] == "cpu"
    assert rec["commit"] and len(rec["date"]) == 20 and rec["date"].endswith("Z")
    s = summarize([trace(plan_status="accepted", success_s=3.0)])
    s.update(rec)
    md = markdown(s, "python -m kestrel_bringup.evaluate --episodes 1")
    assert f"- commit: `{rec['commit']}`, date: {rec['date']}" in md


def test_the_record_takes_the_commit_it_is_given(monkeypatch) -> None:
    """A copy on a remote machine may carry a .git that is not its own: KESTREL_COMMIT wins."""
    from kestrel_bringup.evaluation import run_record

    monkeypatch.setenv("KESTREL_COMMIT", "abc1234")
    assert run_record()["commit"] == "abc1234"


def test_time_to_success_is_split_into_phases() -> None:
    """scene (until the plan is asked), planning, reach and grasp, carry and place: from the
    trace's times, over the successful episodes only; the planner's wall time beside them."""
    ok = trace(plan_status="accepted", plan_asked_s=1.0, plan_answered_s=3.5, plan_wall_s=2.4)
    ok.observe(5.0, held=False, success=False)
    ok.observe(6.0, held=True, success=False)
    ok.observe(7.0, held=True, success=False)  # held still: the first time counts
    ok.observe(9.0, held=False, success=True, over_bin=True)
    assert ok.grasped_s == 6.0
    failed = trace(plan_status="accepted", plan_asked_s=1.0, plan_answered_s=30.0)
    failed.observe(31.0, held=True, success=False)
    s = summarize([ok, failed])
    phases = s["time_by_phase_s"]
    assert phases["scene"]["p50"] == 1.0 and phases["planning"]["p50"] == 2.5
    assert phases["reach_and_grasp"]["p50"] == 2.5 and phases["carry_and_place"]["p50"] == 3.0
    assert phases["planner_wall"]["p50"] == 2.4
    assert all(q["n"] == 1 for q in phases.values())  # the failed episode is not in them
    assert sum(phases[p]["p50"] for p in ("scene", "planning", "reach_and_grasp",
                                          "carry_and_place")) == ok.success_s
    md = markdown(s)
    assert ("By phase (sim s, p50 over the successes): scene 1.0, planning 2.5, reach and "
            "grasp 2.5, carry and place 3.0; the planner's own time 2.4 wall s.") in md


def test_a_record_without_phase_times_has_no_phase_line() -> None:
    """Records written before the phase times (and episodes that never planned) still read."""
    s = summarize([trace(plan_status="accepted", success_s=3.0)])
    assert all(q is None for q in s["time_by_phase_s"].values())
    assert "By phase" not in markdown(s)
    s.pop("time_by_phase_s")
    assert "By phase" not in markdown(s)


def test_the_plan_is_kept_as_text_with_its_arguments() -> None:
    from kestrel_bringup.evaluation import plan_text

    assert plan_text([("pick", "red_cube", [("speed", 0.3)]), ("place", "bin", []),
                      ("home", "", [("speed", 0.25), ("height", 0.1)])]) == (
        "pick red_cube speed=0.3; place bin; home speed=0.25 height=0.1")


def test_one_episode_s_phases_for_the_demo_line() -> None:
    from kestrel_bringup.evaluation import phases, phases_text

    t = trace(plan_status="accepted", plan_asked_s=0.5, plan_answered_s=0.7)
    t.observe(6.3, held=True, success=False)
    assert phases_text(t) == "scene 0.5 s, planning 0.2 s, reach and grasp 5.6 s"  # not placed
    t.observe(13.7, held=False, success=True, over_bin=True)
    assert phases(t)["carry_and_place"] == pytest.approx(7.4)
    assert sum(phases(t).values()) == pytest.approx(t.success_s)
    assert phases_text(trace()) == ""


def test_grasp_retries_are_counted_and_named() -> None:
    """An episode whose pick was retried: the record counts the retries and the episodes, and
    the report names the seeds; a record without retries says none."""
    retried = trace(seed=28, plan_status="accepted", success_s=26.5)
    retried.retries = ["step 1/2 pick red_cube (active): retry 1/2: timeout: waypoint 3/5 not "
                       "reached 10.6 s after it was set; the object's position moved -1.5 cm "
                       "along x"]
    summary = summarize([trace(plan_status="accepted", success_s=13.0), retried])
    assert summary["grasp_retries"] == {"episodes": 1, "successes": 1, "retries": 1}
    assert summary["per_episode"][1]["retries"] == retried.retries
    assert ("Grasp retries: 1 in 1 episodes (seed 28: 1); 1 of these episodes succeeded."
            in markdown(summary))
    none = markdown(summarize([trace(plan_status="accepted", success_s=13.0)]))
    assert "Grasp retries: 0 in 0 episodes." in none


def test_write_record_writes_the_summary_and_its_report(tmp_path) -> None:
    import json

    write_record(tmp_path / "new" / "x_cpu", {"episodes": 2}, "# report\n")
    assert json.loads((tmp_path / "new" / "x_cpu.json").read_text()) == {"episodes": 2}
    assert (tmp_path / "new" / "x_cpu.md").read_text() == "# report\n"


def test_stack_instructions_and_oracle_plans_name_both_objects() -> None:
    """--task stack: the instruction names the goal and the base in words, the oracle plan
    places the goal on the base and is valid; without a base, the bin task as before."""
    import random

    from kestrel_bringup.episode_tasks import TEMPLATES, instruction_for, oracle_plan
    from kestrel_planner.core import PlanValidator, SceneObject, Skill, parse_plan
    from kestrel_planner.core.backend_text import plan_text_of
    from kestrel_planner.core.validator import PlanLimits

    rng = random.Random(3)
    texts = {instruction_for("stack", "red_cube", rng, "blue_cylinder") for _ in range(30)}
    assert texts == {t.format(c="red", s="cube", c2="blue", s2="cylinder")
                     for t in TEMPLATES["stack"]}
    assert "bin" in instruction_for("bin", "red_cube", rng)
    plan = parse_plan(plan_text_of(oracle_plan("stack", "red_cube", 0.3, "blue_cylinder")))
    assert [(s.skill, s.target_object) for s in plan.steps] == [
        (Skill.PICK, "red_cube"), (Skill.PLACE, "blue_cylinder")]
    scene = [SceneObject("red_cube", "red_cube", (0.5, 0.1, 0.425)),
             SceneObject("blue_cylinder", "blue_cylinder", (0.45, -0.1, 0.44))]
    assert PlanValidator(PlanLimits()).validate(plan, scene).accepted


def test_a_stack_stands_when_the_goal_rests_on_the_base() -> None:
    """stacked: the goal's bottom on the base's top (1 cm), its centre over the base's top
    face (a base that moved still carries it); over_target: over the bin's footprint or the
    base's."""
    from kestrel_bringup.episode_tasks import over_target, stack_offsets, stacked

    base0 = (0.5, 0.0, 0.44)
    cube, can = (0.05, 0.05, 0.05), (0.05, 0.05, 0.08)
    truth = {"red_cube": ((0.503, 0.0, 0.5055), cube), "blue_cylinder": (base0, can),
             "bin": ((0.4, 0.3, 0.43), (0.2, 0.2, 0.1))}
    side, gap, moved = stack_offsets(truth, "red_cube", "blue_cylinder", base0)
    assert side == pytest.approx(0.003) and gap == pytest.approx(0.0005) and moved == 0.0
    assert stacked(truth, "red_cube", "blue_cylinder")
    assert stacked({**truth, "red_cube": ((0.52, 0.0, 0.5055), cube)}, "red_cube",
                   "blue_cylinder")  # 2 cm off the centre: still over the 5 cm top
    assert over_target(truth, "red_cube", "blue_cylinder") is True
    assert over_target(truth, "red_cube", "bin") is False
    beside = {**truth, "red_cube": ((0.53, 0.0, 0.5055), cube)}  # 3 cm off: on its edge
    assert not stacked(beside, "red_cube", "blue_cylinder")
    held_up = {**truth, "red_cube": ((0.5, 0.0, 0.53), cube)}  # 2.5 cm above the top
    assert not stacked(held_up, "red_cube", "blue_cylinder")
    pushed = {**truth, "blue_cylinder": ((0.52, 0.0, 0.44), can),
              "red_cube": ((0.52, 0.0, 0.5055), cube)}  # the base moved 2 cm, carries it
    assert stacked(pushed, "red_cube", "blue_cylinder")
    assert stack_offsets(pushed, "red_cube", "blue_cylinder", base0)[2] == pytest.approx(0.02)
    assert not stacked(truth, "green_cube", "blue_cylinder")  # not in the truth
    assert over_target(truth, "green_cube", "bin") is None


def test_a_stack_report_says_its_task_and_names_the_base() -> None:
    miss = trace(seed=4, plan_status="accepted", held_ever=True, released_over_bin=True,
                 base="blue_cylinder")
    md = markdown(summarize([trace(success_s=7.0, base="blue_cylinder"), miss],
                            {"task": "stack"}))
    assert md.startswith("# Closed-loop evaluation: stacking")
    assert "Task: stack one task object on another" in md
    assert "| seed 4 | red_cube on blue_cylinder | place_miss |" in md
    assert markdown(summarize([trace(success_s=7.0)])).startswith("# Closed-loop evaluation\n")


def test_a_push_is_done_when_the_object_lies_where_the_push_leaves_it() -> None:
    """TaskJudge, task push: after the plan ended, the goal 5 +- 1 cm along +x of where it
    stood, at most 1 cm sideways, upright, for SETTLE_S; not while the plan still runs (the
    stroke passes through the goal's end point), not short, not sideways, not tipped."""
    from kestrel_bringup.episode_tasks import (PUSH_DISTANCE, SETTLE_S, TaskJudge, oracle_plan,
                                               pushed)
    from kestrel_planner.core.skills import SKILLS, Skill

    assert PUSH_DISTANCE == SKILLS[Skill.PUSH].arg("distance").default
    cube = (0.05, 0.05, 0.05)
    start = {"red_cube": ((0.5, 0.1, 0.45), cube), "bin": ((0.4, 0.3, 0.43), (0.2, 0.2, 0.1))}
    moved = {**start, "red_cube": ((0.548, 0.103, 0.45), cube)}
    judge = TaskJudge("push", "red_cube", start=start)
    assert not judge.observe(1.0, False, False, moved, plan_ended=False)  # still pushing
    assert not judge.observe(2.0, False, False, moved, plan_ended=True)  # not yet settled
    assert judge.offsets == [0.048, 0.003, 0.0]
    assert judge.observe(2.0 + SETTLE_S, False, False, moved, plan_ended=True)
    for centre in ((0.535, 0.1, 0.45), (0.565, 0.1, 0.45), (0.55, 0.115, 0.45),
                   (0.55, 0.1, 0.43)):  # short, too far, sideways, tipped over
        assert not pushed({**start, "red_cube": (centre, cube)}, "red_cube", start["red_cube"][0])
    assert not pushed(start, "green_cube", (0.5, 0.0, 0.45))  # not in the truth
    assert oracle_plan("push", "red_cube", 0.3) == "push red_cube speed=0.3 distance=0.05; end"
    with pytest.raises(ValueError, match="task 'throw'"):
        TaskJudge("throw", "red_cube")


def test_a_push_that_ended_short_is_a_push_miss_and_reported_as_one() -> None:
    """task push: the plan ended with the object elsewhere -> push_miss (never reach_timeout:
    a push holds nothing); still running at the timeout -> timeout. The report names the task,
    the stages of a push only, its phases and each failed episode's offsets."""
    ok = trace(plan_status="accepted", task="push", plan_asked_s=0.5, plan_answered_s=0.8,
               plan_ended_s=9.0, success_s=9.6, instruction="push the red cube")
    short = trace(seed=3, plan_status="accepted", task="push", plan_ended_s=9.0,
                  push_offsets_m=[0.021, -0.002, 0.0])
    running = trace(seed=4, plan_status="accepted", task="push")
    assert (ok.stage, short.stage, running.stage) == ("success", "push_miss", "timeout")
    s = summarize([ok, short, running], {"task": "push"})
    assert list(s["failures_by_stage"]) == ["perception_miss", "plan_rejected", "push_miss",
                                            "timeout"]
    assert set(s["time_by_phase_s"]) == {"scene", "planning", "push", "planner_wall"}
    assert s["time_by_phase_s"]["push"]["p50"] == pytest.approx(8.8)
    md = markdown(s)
    assert md.startswith("# Closed-loop evaluation: pushing")
    assert "Task: push a task object" in md and "Grasp retries" not in md
    assert "| seed 3 | red_cube (moved +0.021, -0.002, +0.000) | push_miss |" in md


def test_what_went_wrong_around_the_robot_is_named_in_the_report() -> None:
    """An episode whose control node did not come back after the reset: its failed row says
    so beside the steps, so the failure reads as the evaluation's, not the robot's."""
    t = trace(seed=50, plan_status="accepted", task="push", plan_ended_s=2.0,
              steps=["step 1/1 push red_cube (failed): stalled"],
              evaluator_notes=["the control node did not activate again after the reset"])
    md = markdown(summarize([t], {"task": "push"}))
    assert ("| step 1/1 push red_cube (failed): stalled (evaluator: the control node did not "
            "activate again after the reset) |") in md
    assert summarize([t])["per_episode"][0]["evaluator_notes"] == t.evaluator_notes
