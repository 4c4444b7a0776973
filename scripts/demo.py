#!/usr/bin/env python3
"""Run the whole Kestrel stack on the embedded simulator and one pick-and-place episode
through it: the sim is reset to a seeded layout, the planner gets the instruction, and the
episode succeeds when the simulator's ground truth has the object in the bin and settled.
Then a table (topic rates, per-node latency percentiles, control-loop deadline misses).

    make demo                         # = scripts/run.sh python scripts/demo.py
    make demo TASK=stack              # or push: the closed-loop evaluation's other tasks
    python scripts/demo.py --duration 60 --json out/demo.json --video out/episode.mp4

Plans: the planner as configured (config/planner.yaml: the trained VLM) turns the instruction
into the plan; with --oracle-plan it runs backend plan_text instead and is sent the correct
plan for the goal (the demo says so).
Exit status 0 only if every node came up and stayed up, data flowed end to end and the
episode succeeded. Runs on its own ROS_DOMAIN_ID (default: a free one in 1..100) with
localhost discovery.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from kestrel_bringup.episode_tasks import PUSH_DISTANCE, TASKS
from kestrel_common.domain_lease import DomainLease


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float,
                        default=float(os.environ.get("KESTREL_DEMO_DURATION", "30")),
                        help="seconds of measured run after start-up, at least the episode "
                        "(default 30)")
    parser.add_argument("--startup-timeout", type=float, default=60.0,
                        help="max seconds for every node to come up and data to flow")
    parser.add_argument("--seed", type=int, default=0,
                        help="episode layout (0 = the default layout: every task object)")
    parser.add_argument("--task", default="bin", choices=TASKS,
                        help="bin: put the goal in the bin; stack: stack it on another task "
                        "object; push: push it (kestrel_bringup.episode_tasks)")
    parser.add_argument("--goal", default="red_cube", help="the object the task is about")
    parser.add_argument("--instruction", default=None,
                        help="default: 'put the red cube in the bin' for the task bin, else "
                        "one of the task's instructions for the goal")
    parser.add_argument("--oracle-plan", action="store_true",
                        help="send the planner (backend plan_text) the correct plan instead "
                        "of the instruction: the planner's model is not used")
    parser.add_argument("--episode-timeout", type=float, default=60.0,
                        help="sim s the episode may take after its plan")
    parser.add_argument("--video", type=Path, default=None,
                        help="record the episode (.mp4 or .gif; default <log dir>/episode.mp4)")
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="node logs (default: a temp dir, printed at the end)")
    parser.add_argument("--quiet", action="store_true", help="do not echo node output")
    args = parser.parse_args()
    if args.instruction is None:  # "": episode() draws one of the task's for the goal
        args.instruction = "put the red cube in the bin" if args.task == "bin" else ""

    lease = DomainLease()
    os.environ["ROS_DOMAIN_ID"] = str(lease.domain_id)
    os.environ.setdefault("ROS_AUTOMATIC_DISCOVERY_RANGE", "LOCALHOST")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kestrel_demo_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("ROS_LOG_DIR", str(log_dir / "ros_log"))
    video = args.video or log_dir / "episode.mp4"

    import rclpy
    from kestrel_common.spin_thread import SpinThread
    from rclpy.executors import SingleThreadedExecutor

    from kestrel_bringup.evaluate import ORACLE_NOTE, Evaluator
    from kestrel_bringup.evaluation import phases, phases_text
    from kestrel_bringup.monitor_node import StackMonitor
    from kestrel_bringup.run_stack import StackRunner
    from kestrel_bringup.stack_report import StackReport

    print(f"[demo] ROS_DOMAIN_ID={lease.domain_id}, logs in {log_dir}", flush=True)
    if args.oracle_plan:
        print(f"[demo] {ORACLE_NOTE}", flush=True)
    extra = {"planner": {"backend": "plan_text"}} if args.oracle_plan else {}
    runner = StackRunner(log_dir=log_dir, echo=not args.quiet, extra_params=extra)
    report = StackReport()
    rclpy.init()
    monitor = StackMonitor(report, "")  # counts and latencies; the episode sends the goal
    executor = SingleThreadedExecutor()
    executor.add_node(monitor)
    spin = SpinThread(executor, name="monitor_spin")  # stopped before the monitor goes
    failures: list[str] = []
    trace = None
    ev = None
    t_start = time.monotonic()
    runner.start()
    try:
        # Start-up: wait (bounded) until every link that needs no plan has carried a message.
        deadline = time.monotonic() + args.startup_timeout
        while time.monotonic() < deadline and not runner.exited():
            if not report.flow_failures(plans=False):
                break
            time.sleep(0.25)
        startup = time.monotonic() - t_start
        print(f"[demo] start-up took {startup:.1f} s; episode: seed {args.seed}, "
              f"'{args.instruction}'", flush=True)
        ev = Evaluator(plan_timeout_s=120.0, echo=True)
        if not ev.wait_ready(max(1.0, deadline - time.monotonic())):
            failures.append("/sim/reset or /planner/plan_task not available")
        elif not runner.exited():
            ev.recording = True
            trace = ev.episode(args.seed, random.Random(args.seed), args.episode_timeout,
                               0.3 if args.oracle_plan else 0.0, goal=args.goal,
                               instruction=args.instruction, task=args.task)
            ev.recording = False
            _episode_verdict(trace, report, failures)
        end = t_start + startup + args.duration
        while time.monotonic() < end and not runner.exited():
            time.sleep(0.25)
        early = runner.exited()
        failures += [f"node '{n}' exited early with code {c}" for n, c in early]
    finally:
        frames = []
        if ev is not None:
            with ev.lock:
                frames, ev.frames = ev.frames, []
            ev.close()
        codes = runner.stop()
        if spin.stop(timeout_s=10.0):
            monitor.close()
        else:
            print("[demo] the monitor's executor did not stop within 10 s: its node is left "
                  "to the process exit", file=sys.stderr)
        rclpy.try_shutdown()
        lease.release()
    if frames:
        from kestrel_bringup.episode_media import write_video
        print(f"[demo] episode video: {write_video(frames, video)} ({len(frames)} frames)")
    failures += report.flow_failures()
    failures += [f"node '{n}' exit code {c} at shutdown" for n, c in codes.items()
                 if c not in (0, -2) and not any(n in f for f in failures)]
    measured = time.monotonic() - t_start
    print()
    print(report.table(measured))
    print()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        out = _report_json(report, measured, failures)
        out["episode"] = None if trace is None else {
            "seed": trace.seed, "task": trace.task, "goal": trace.goal, "base": trace.base,
            "instruction": trace.instruction,
            "oracle_plan": args.oracle_plan, "stage": trace.stage,
            "success_s": trace.success_s, "phases_s": phases(trace), "plan": trace.plan,
            "steps": trace.steps}
        args.json.write_text(json.dumps(out, indent=2))
    if trace is not None:
        print(f"EPISODE: '{trace.instruction}' (seed {trace.seed}): "
              + (f"SUCCESS, {_done(trace)} {trace.success_s:.1f} s "
                 f"(sim) after the reset ({phases_text(trace)})" if trace.stage == "success"
                 else f"FAILED at {trace.stage}")
              + (" [oracle plan]" if args.oracle_plan else ""))
        if trace.plan:
            print(f"PLAN: {trace.plan}")
    if failures:
        print("DEMO FAILED:\n  " + "\n  ".join(failures))
        print(f"node logs: {log_dir}")
        return 1
    print("DEMO OK: every node came up, data flowed sim -> perception -> planner -> "
          "control -> sim, and the episode succeeded")
    return 0


def _episode_verdict(trace, report, failures: list[str]) -> None:  # noqa: ANN001
    """The episode's plan into the report (the planner's link); its failure into failures."""
    if trace is None:
        failures.append("the episode could not start (reset or first status missing)")
        return
    report.on_plan(trace.plan_status)
    if trace.stage != "success":
        why = "; ".join(trace.steps or trace.plan_reasons) or "no step ended"
        failures.append(f"episode: not done ({_done(trace)}): {trace.stage} ({why})")


def _done(trace) -> str:  # noqa: ANN001
    """What the episode's task asks, as done: 'red_cube in the bin and settled'."""
    if trace.task == "stack":
        return f"{trace.goal} rests on {trace.base}"
    if trace.task == "push":
        return f"{trace.goal} pushed {PUSH_DISTANCE:g} m along +x"
    return f"{trace.goal} in the bin and settled"


def _report_json(report, duration: float, failures: list[str]) -> dict:
    import numpy as np
    out = {"duration_s": duration, "failures": failures, "plans": report.plans,
           "sim_applied_commands": report.sim_applied_commands,
           "topics": {t: {"count": s.count, "rate_hz": s.rate()} for t, s in report.topics.items()},
           "latency_ms": {}}
    for name, samples in report.latencies.items():
        arr = np.asarray(samples) * 1e3
        out["latency_ms"][name] = {"n": int(arr.size), "p50": float(np.percentile(arr, 50)),
                                   "p99": float(np.percentile(arr, 99)), "max": float(arr.max())}
    ls = report.loop_stats
    if ls is not None:
        out["control_loop"] = {"period_target_s": ls.period_target, "cycles": ls.cycles_total,
                               "deadline_misses": ls.deadline_misses,
                               "miss_causes": {k: getattr(ls, k, 0) for k in (
                                   "misses_preempted", "misses_blocked", "misses_late_wake",
                                   "misses_slow_step")},
                               "step_latency_p99_s": ls.step_latency_p99,
                               "step_latency_p999_s": ls.step_latency_p999,
                               "stale_inputs": ls.stale_inputs}
    return out


if __name__ == "__main__":
    sys.exit(main())
