"""Pick and place, stacking and pushing through the whole stack as configured (nodes as
processes over DDS, sim time; the trained planner turns each instruction into the plan): the
closed-loop evaluation's command for 2 seeded episodes of each task must have at least one
success, and it reports failures by stage and the sim-time speed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.dds, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_pick_and_place_episodes_through_the_stack(env, run_dir, dds_guard) -> None:
    out = run_dir / "closed_loop"
    cmd = [sys.executable, "-m", "kestrel_bringup.evaluate", "--episodes", "2", "--seed", "0",
           "--log-dir", str(run_dir / "logs"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=str(run_dir), capture_output=True, text=True,
                          timeout=840)
    logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                     for p in sorted((run_dir / "logs").glob("*.log")))
    report = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}\n{logs}"
    assert out.with_suffix(".json").is_file(), report
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["episodes"] == 2, report
    assert summary["successes"] >= 1, report
    assert proc.returncode == 0, report
    assert "NOT measured" not in out.with_suffix(".md").read_text()  # the planner's own plans
    speed = summary["sim_speed"]
    assert speed is not None and 0.05 < speed["real_time_factor"] < 20.0, speed
    assert out.with_suffix(".png").stat().st_size > 1000


# (task, its episodes' seeds, how its instructions begin, its report's title)
OTHER_TASKS = [("stack", ["--seed", "0"], ("stack", "put", "place"), ": stacking"),
               ("push", ["--seeds", "1,3"], ("push", "nudge", "shove"), ": pushing")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("task, seeds, verbs, title", OTHER_TASKS, ids=[t[0] for t in OTHER_TASKS])
def test_stacking_and_pushing_episodes_through_the_stack(env, run_dir, dds_guard, task, seeds,
                                                         verbs, title) -> None:
    """--task stack: the instruction asks to stack one task object on another; the trained
    planner's plan, the executor's release on contact, the ground truth's check that the goal
    rests on the base. --task push: 'push the red cube'; the push's stroke, the ground truth's
    check that the object moved the push's distance."""
    out = run_dir / f"closed_loop_{task}"
    cmd = [sys.executable, "-m", "kestrel_bringup.evaluate", "--task", task, "--episodes", "2",
           *seeds, "--video", "none", "--log-dir", str(run_dir / "logs"), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=str(run_dir), capture_output=True, text=True,
                          timeout=840)
    report = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert out.with_suffix(".json").is_file(), report
    summary = json.loads(out.with_suffix(".json").read_text())
    assert summary["episodes"] == 2, report
    assert summary["successes"] >= 1, report
    assert all(e["task"] == task and e["instruction"].startswith(verbs)
               and bool(e["base"]) == (task == "stack") for e in summary["per_episode"]), report
    assert out.with_suffix(".md").read_text().startswith(f"# Closed-loop evaluation{title}")
