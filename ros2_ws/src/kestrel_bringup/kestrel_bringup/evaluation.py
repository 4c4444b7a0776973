"""Closed-loop evaluation bookkeeping (no rclpy): one trace per episode, the failure stage it
ends in, and the table over episodes (success rate with a Wilson 95 % interval, failures by
stage, time to success and where it goes, control deadline misses), the run's record.
kestrel_bringup.evaluate feeds it from the simulator contract's topics (sim_contract.yaml);
tests feed it directly.

Failure attribution, first that applies:
  plan_rejected    the planner refused the instruction or its plan failed validation, or no
                   plan came (the reasons are kept); when the goal object was never detected
                   by perception, perception_miss instead;
  reach_timeout    the goal object was never held between both fingers;
  grasp_slip       it was held, then let go away from the bin;
  place_miss       it was let go over the bin, but it is not in the bin and settled;
  push_miss        (task push, instead of the three above) the plan ended, but the goal did
                   not end where the push should have left it (episode_tasks.pushed);
  timeout          anything else that did not succeed within the episode's time.
The tasks, their instructions and when each is done: kestrel_bringup.episode_tasks; for a
stack, "the bin" above reads "the base".
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kestrel_bringup.episode_tasks import PUSH_DISTANCE, PUSH_TOLERANCE, SETTLE_S, STACK_TOLERANCE

STAGES = ("success", "perception_miss", "plan_rejected", "reach_timeout", "grasp_slip",
          "place_miss", "push_miss", "timeout")
# the failure stages each task can end in (a push never holds its object)
_PICK_STAGES = ("perception_miss", "plan_rejected", "reach_timeout", "grasp_slip", "place_miss",
                "timeout")
TASK_STAGES = {"bin": _PICK_STAGES, "stack": _PICK_STAGES,
               "push": ("perception_miss", "plan_rejected", "push_miss", "timeout")}
ORACLE_NOTE = ("oracle plan: the planner node ran backend plan_text and was sent the correct "
               "plan for the goal, not the instruction; the planner's model is NOT measured")


@dataclass
class EpisodeTrace:
    """What the evaluator saw of one episode (sim time in s from the episode's start)."""

    seed: int
    goal: str  # goal object name, e.g. red_cube
    instruction: str
    base: str = ""  # task stack: the object the goal goes on
    task: str = "bin"  # episode_tasks.TASKS
    # task stack, at the last observation: the goal's centre sideways of the base's, the gap
    # between the goal's bottom and the base's top, the base's move from where it stood, m
    stack_offsets_m: list[float] = field(default_factory=list)
    # task push, at the last observation: how far the goal moved along +x, sideways, up, m
    push_offsets_m: list[float] = field(default_factory=list)
    plan_status: str = "none"  # "accepted" | "rejected" | "error" | "none"
    plan_reasons: list[str] = field(default_factory=list)
    goal_detected: bool | None = None  # perception reported the goal's class (None: unknown)
    held_since_s: float | None = None  # goal held between both fingers since this time
    held_ever: bool = False
    # at the last release: above the bin's footprint (task stack: the base's)
    released_over_bin: bool | None = None
    success_s: float | None = None  # first time the goal was in the bin and settled
    deadline_misses: int = 0  # control loop misses during the episode
    # m, perception's position of the goal and of the bin when the plan was asked for vs the
    # ground truth's centre (None: not detected with a position)
    position_error_m: dict[str, float | None] = field(default_factory=dict)
    steps: list[str] = field(default_factory=list)  # plan steps' ends, with their messages
    duration_s: float = 0.0
    # where the time to success goes (sim s from the episode's start, None: did not happen):
    # the goal sent to the planner (once perception showed the new layout), its result back,
    # the goal object first held; plan_wall_s is the planner's own time for the goal (wall s,
    # PlanTask.Result.total_time)
    plan_asked_s: float | None = None
    plan_answered_s: float | None = None
    grasped_s: float | None = None
    plan_wall_s: float | None = None
    plan_ended_s: float | None = None  # the plan's last step ended, or one failed
    plan: str = ""  # the planned steps with their arguments, e.g. "pick red_cube speed=0.3; ..."
    # the plan's grasp retries, each with its reason ("step 1/2 pick red_cube: retry 1/2: ...")
    retries: list[str] = field(default_factory=list)
    # what went wrong around the robot rather than in it: the control node not activated again
    # after the reset, no perception result of the new layout before the plan
    evaluator_notes: list[str] = field(default_factory=list)

    def observe(self, t_s: float, held: bool, success: bool,
                over_bin: bool | None = None) -> None:
        """One EpisodeStatus: is the goal held, is the task done; over_bin: whether the goal
        object is above the bin's footprint (task stack: the base's) now (ground truth)."""
        self.duration_s = max(self.duration_s, t_s)
        if success and self.success_s is None:
            self.success_s = t_s
        if held:
            self.held_ever = True
            if self.grasped_s is None:
                self.grasped_s = t_s
            if self.held_since_s is None:
                self.held_since_s = t_s
        elif self.held_since_s is not None:  # released (or slipped) now
            self.held_since_s = None
            self.released_over_bin = over_bin

    @property
    def stage(self) -> str:
        if self.success_s is not None:
            return "success"
        if self.plan_status != "accepted":
            return "perception_miss" if self.goal_detected is False else "plan_rejected"
        if self.task == "push":
            return "push_miss" if self.plan_ended_s is not None else "timeout"
        if not self.held_ever:
            return "reach_timeout"
        if self.released_over_bin is False:
            return "grasp_slip"
        if self.released_over_bin is True:
            return "place_miss"
        return "timeout"


def plan_text(steps: list[tuple[str, str, list[tuple[str, float]]]]) -> str:
    """(skill, target, [(argument, value)]) per step -> "pick red_cube speed=0.3; place bin"."""
    return "; ".join(" ".join(w for w in (skill, target, *(f"{k}={v:g}" for k, v in args)) if w)
                     for skill, target, args in steps)


def wilson_interval(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (95 % for the default z)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def sim_speed(first: tuple[float, float] | None,
              last: tuple[float, float] | None) -> dict[str, float] | None:
    """Sim-time speed between two (sim s, wall s) samples: sim seconds per wall second (the
    achieved real-time factor). None without two samples apart in wall time."""
    if first is None or last is None or last[1] - first[1] <= 0.0:
        return None
    sim_s, wall_s = last[0] - first[0], last[1] - first[1]
    return {"sim_s": round(sim_s, 1), "wall_s": round(wall_s, 1),
            "real_time_factor": round(sim_s / wall_s, 3)}


def _quantiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    v = sorted(values)

    def q(f: float) -> float:
        return v[min(len(v) - 1, int(round(f * (len(v) - 1))))]

    return {"n": len(v), "mean": sum(v) / len(v), "p50": q(0.5), "p90": q(0.9), "max": v[-1]}


PHASES = {  # time_by_phase_s: name -> (from, to) EpisodeTrace fields (None: the start)
    "scene": (None, "plan_asked_s"),  # reset until perception showed the new layout
    "planning": ("plan_asked_s", "plan_answered_s"),
    "reach_and_grasp": ("plan_answered_s", "grasped_s"),
    "carry_and_place": ("grasped_s", "success_s"),
    "push": ("plan_answered_s", "success_s"),  # task push only: it holds nothing
}


def phase_names(task: str) -> tuple[str, ...]:
    """The PHASES of a task's episodes."""
    return tuple(n for n in PHASES if (n == "push") == (task == "push")
                 or n in ("scene", "planning"))


def phases(t: EpisodeTrace) -> dict[str, float]:
    """Sim s of each of the episode's phases (phase_names of its task) that saw both of its
    ends."""
    out = {}
    for name in phase_names(t.task):
        a, b = PHASES[name]
        end, start = getattr(t, b), (getattr(t, a) if a else 0.0)
        if end is not None and start is not None:
            out[name] = end - start
    return out


def phases_text(t: EpisodeTrace) -> str:
    """'scene 0.5 s, planning 0.2 s, ...' of phases(t) ('' when none)."""
    return ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in phases(t).items())


def time_by_phase(traces: list[EpisodeTrace]) -> dict[str, dict[str, float] | None]:
    """Quantiles of each phase's sim s (PHASES) over the successful episodes that saw both of
    its ends, and of the planner's own wall s (plan_wall_s) over the same episodes."""
    done = [t for t in traces if t.success_s is not None]
    each = [phases(t) for t in done]
    names = [n for n in PHASES if any(n in phase_names(t.task) for t in traces)]
    out: dict[str, dict[str, float] | None] = {
        name: _quantiles([p[name] for p in each if name in p]) for name in names}
    out["planner_wall"] = _quantiles([t.plan_wall_s for t in done if t.plan_wall_s is not None])
    return out


def summarize(traces: list[EpisodeTrace], config: dict[str, Any] | None = None) -> dict:
    """The evaluation's result record (JSON-able)."""
    n = len(traces)
    k = sum(t.stage == "success" for t in traces)
    # the stages of the tasks run (all of them when there are none)
    stages = {s for t in ({t.task for t in traces} or TASK_STAGES) for s in TASK_STAGES[t]}
    lo, hi = wilson_interval(k, n)
    return {
        "config": config or {},
        "episodes": n,
        "successes": k,
        "success_rate": k / n if n else 0.0,
        "success_ci95": [lo, hi],
        "failures_by_stage": {s: sum(t.stage == s for t in traces) for s in STAGES
                              if s in stages},
        "time_to_success_s": _quantiles([t.success_s for t in traces
                                         if t.success_s is not None]),
        "time_by_phase_s": time_by_phase(traces),
        "deadline_misses_per_episode": _quantiles([float(t.deadline_misses) for t in traces]),
        "grasp_retries": {"episodes": sum(bool(t.retries) for t in traces),
                          "successes": sum(bool(t.retries) and t.stage == "success"
                                           for t in traces),
                          "retries": sum(len(t.retries) for t in traces)},
        "per_episode": [{**asdict(t), "stage": t.stage} for t in traces],
    }


def record_lines(summary: dict) -> list[str]:
    """The report's machine and commit lines (run_record's fields), then a blank line; none
    when the summary has no machine."""
    m = summary.get("machine")
    if not m:
        return []
    gpu = f"{m['gpu']}, " if m.get("gpu") else ""
    return [f"- machine: {m.get('class', '?')}, {gpu}{m.get('cpu_model', '?')}, "
            f"{m.get('cpus', '?')} CPUs, load {m.get('loadavg_1m', '?')} at the start",
            f"- commit: `{summary.get('commit', '?')}`, date: {summary.get('date', '?')}", ""]


def markdown(summary: dict, command: str = "") -> str:
    """The summary as a short markdown report."""
    lo, hi = summary["success_ci95"]
    task = summary.get("config", {}).get("task", "bin")
    lines = ["# Closed-loop evaluation" + {"stack": ": stacking", "push": ": pushing"}.get(
        task, ""), ""]
    if command:
        lines += [f"Command: `{command}`", ""]
    lines += record_lines(summary)
    planned = summary.get("episodes_planned", summary["episodes"])
    if planned > summary["episodes"]:
        lines += [f"**Interrupted: {summary['episodes']} of {planned} episodes ran.**", ""]
    if summary.get("plan_source"):
        lines += [f"**Plans: {summary['plan_source']}.**", ""]
    if task == "stack":
        lines += ["Task: stack one task object on another ('stack the red cube on the blue "
                  "cylinder'). Success: the goal rests on the base, released, for "
                  f"{SETTLE_S} s of sim time (its bottom within {STACK_TOLERANCE} m of "
                  "the base's top, its centre over the base's top face); place_miss: released "
                  "over the base but not resting on it. Each episode's offsets at its end are "
                  "in the JSON record (stack_offsets_m).", ""]
    if task == "push":
        lines += ["Task: push a task object ('push the red cube'; the instruction names no "
                  f"distance: the push skill's {PUSH_DISTANCE} m along +x). Success: after the "
                  f"plan ended, for {SETTLE_S} s of sim time, the object lies {PUSH_DISTANCE} "
                  f"+- {PUSH_TOLERANCE} m along +x of where it stood, at most {PUSH_TOLERANCE} m "
                  "sideways, upright; push_miss: the plan ended, the object elsewhere. Each "
                  "episode's offsets at its end (along x, sideways, up) are in the JSON record "
                  "(push_offsets_m) and in the table of failed episodes.", ""]
    lines += [
        "| episodes | successes | success rate | 95 % CI (Wilson) |",
        "|---|---|---|---|",
        f"| {summary['episodes']} | {summary['successes']} | "
        f"{summary['success_rate']:.1%} | [{lo:.1%}, {hi:.1%}] |",
        "", "| failure stage | episodes |", "|---|---|",
    ]
    lines += [f"| {s} | {c} |" for s, c in summary["failures_by_stage"].items()]
    tts = summary["time_to_success_s"]
    if tts:
        lines += ["", f"Time to success (sim s): p50 {tts['p50']:.1f}, p90 {tts['p90']:.1f}, "
                  f"max {tts['max']:.1f} (n = {tts['n']})."]
    by_phase = summary.get("time_by_phase_s") or {}
    spans = [f"{name.replace('_', ' ')} {q['p50']:.1f}" for name, q in by_phase.items()
             if q and name in PHASES]
    if spans:
        wall = by_phase.get("planner_wall")
        lines += ["By phase (sim s, p50 over the successes): " + ", ".join(spans)
                  + (f"; the planner's own time {wall['p50']:.1f} wall s." if wall else ".")]
    gr = summary.get("grasp_retries")
    if gr and task != "push":
        seeds = ", ".join(f"seed {e['seed']}: {len(e['retries'])}"
                          for e in summary.get("per_episode", []) if e.get("retries"))
        lines += [f"Grasp retries: {gr['retries']} in {gr['episodes']} episodes"
                  + (f" ({seeds}); {gr['successes']} of these episodes succeeded." if seeds
                     else ".")]
    dm = summary["deadline_misses_per_episode"]
    if dm:
        lines += [f"Control deadline misses per episode: mean {dm['mean']:.1f}, "
                  f"max {dm['max']:.0f}."]
    speed = summary.get("sim_speed")
    if speed:
        per = f" per stack, {speed['stacks']} stacks at once" if speed.get("stacks", 1) > 1 else ""
        lines += [f"Sim-time speed: {speed['real_time_factor']:.2f} sim s per wall s{per} "
                  f"({speed['sim_s']:.0f} sim s in {speed['wall_s']:.0f} wall s)."]
    failed = [e for e in summary.get("per_episode", []) if e["stage"] != "success"]
    if failed:
        lines += ["", "| failed episode | goal | stage | plan steps | position error (m) |",
                  "|---|---|---|---|---|"]
        for e in failed:
            steps = "; ".join(e.get("steps") or e.get("plan_reasons") or []) or "-"
            if e.get("evaluator_notes"):
                steps += " (evaluator: " + "; ".join(e["evaluator_notes"]) + ")"
            err = ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -"
                            for k, v in (e.get("position_error_m") or {}).items()) or "-"
            goal = f"{e['goal']} on {e['base']}" if e.get("base") else e["goal"]
            if e.get("push_offsets_m"):
                goal += " (moved " + ", ".join(f"{v:+.3f}" for v in e["push_offsets_m"]) + ")"
            lines.append(f"| seed {e['seed']} | {goal} | {e['stage']} | {steps} | {err} |")
    return "\n".join(lines) + "\n"


def gpu_params(device: str, controller: str) -> dict[str, dict[str, str]]:
    """Node parameters of the GPU variants (--device cuda): perception's model on the GPU (its
    runtime's `auto` options then pick the GPU's measured best), the planner on our decode
    engine on the GPU (CUDA-graph decode) without speculative decoding and without the
    frame + scene prefix cache (both measured slower than the plain engine on the GPU:
    docs/benchmarks/planner_h100.md, spec_trained and prefix_cache), and the learned
    controller's policy in a CUDA graph. The IK controller has no model: it runs as on the
    CPU."""
    if device == "cpu":
        return {}
    params = {"perception": {"runtime.device": device},
              "planner": {"backend": "engine", "device": device, "speculative.k": "0",
                          "prefix_cache_entries": "0"}}
    if controller == "policy":
        params["control"] = {"policy.backend": "cuda_graph"}
    return params


def run_record(device: str = "cpu") -> dict[str, Any]:
    """machine (cpu model, cpus, load; with device cuda the GPU and its class), commit
    (kestrel_common.run_info.git_commit of the working directory: KESTREL_COMMIT when set)
    and date (UTC) of a run."""
    import datetime
    import os
    import platform

    from kestrel_common.run_info import cpu_model, git_commit, gpu_class

    machine: dict[str, Any] = {"class": "cpu", "cpus": os.cpu_count(),
                               "python": platform.python_version(),
                               "loadavg_1m": round(os.getloadavg()[0], 2)}
    if cpu_model():
        machine["cpu_model"] = cpu_model()
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            machine["gpu"] = torch.cuda.get_device_name(0)
            machine["class"] = gpu_class(machine["gpu"])
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"machine": machine, "commit": git_commit(os.getcwd()), "date": date}


def write_record(out: str | Path, summary: dict, text: str) -> None:
    """<out>.json (the summary) and <out>.md (its report), the folder made when missing."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".json").write_text(json.dumps(summary, indent=1) + "\n")
    path.with_suffix(".md").write_text(text)
