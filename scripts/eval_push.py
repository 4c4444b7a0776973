#!/usr/bin/env python3
"""Push success of the robot side of the loop, without ROS, perception or a learned planner:
seeded layouts of the simulator, every task object pushed by the plan "push <object>
distance=D" (the planner's executor, the reference controller at 500 Hz, MuJoCo physics;
kestrel_bringup.core_loop), object positions from the simulator's ground truth.

    python scripts/eval_push.py --seeds 20 --out docs/benchmarks/push_cores_cpu

An episode counts as moved when the object moved D +- `--tolerance` along +x, at most
`--tolerance` sideways and stands (its centre's height within `--tolerance`): the check of the
closed-loop evaluation's `--task push` (kestrel_bringup.episode_tasks.pushed). The step's own
outcome (SUCCEEDED or FAILED, and why) is reported beside it. Writes <out>.json and <out>.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import source_paths  # noqa: E402, F401  (the checkout's packages first on sys.path)

from kestrel_bringup.core_loop import (  # noqa: E402
    EVAL_WORLD,
    PUSH_SPEED,
    eval_command,
    eval_config,
    layouts,
    run_plan,
    truth,
)
from kestrel_bringup.episode_tasks import push_offsets, pushed  # noqa: E402
from kestrel_bringup.evaluation import record_lines, run_record, write_record  # noqa: E402
from kestrel_control.core.kinematics import ArmKinematics  # noqa: E402
from kestrel_planner.core.executor import StepState  # noqa: E402
from kestrel_sim.core import SimWorld  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="layouts 1..N (seed = index)")
    parser.add_argument("--distance", type=float, default=0.05, help="push distance, m")
    parser.add_argument("--speed", type=float, default=0.3, help="plan speed, m/s")
    parser.add_argument("--push-speed", type=float, default=None,
                        help="m/s, top speed of the stroke (default: the planner node's)")
    parser.add_argument("--tolerance", type=float, default=0.01, help="m, see the docstring")
    parser.add_argument("--timeout", type=float, default=15.0, help="sim s per episode")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    world = SimWorld(EVAL_WORLD)
    kin = ArmKinematics.from_default()
    record = run_record()  # machine, commit, date: at the start
    if args.push_speed is None:
        args.push_speed = PUSH_SPEED
    episodes, t0 = [], time.monotonic()
    for seed, name in layouts(world, args.seeds):
        before = truth(world)[name][0]
        events: list = []
        ex = run_plan(world, f"push {name} speed={args.speed} distance={args.distance}"
                      "\nend", args.timeout, kin, events=events,
                      push_speed=args.push_speed)
        after = truth(world)
        dx, dy, dz = push_offsets(after, name, before)
        failed = [e.message for e in events if e.status == StepState.FAILED]
        episodes.append({
            "seed": seed, "object": name, "moved_m": [round(dx, 4), round(dy, 4), round(dz, 4)],
            "moved": pushed(after, name, before, args.distance, args.tolerance),
            "step": ex.statuses[0].name.lower(), "failure": failed[0] if failed else ""})
        print(f"seed {seed} {name}: moved ({dx:.3f}, {dy:.3f}, {dz:.3f}) m, "
              f"step {episodes[-1]['step']}", flush=True)
    summary = {"schema": "kestrel_push_eval/1", "config": eval_config(args, t0),
               "command": eval_command("scripts/eval_push.py", argv), **record,
               "episodes": episodes}
    text = markdown(summary)
    print(text)
    if args.out:
        write_record(args.out, summary, text)
    return 0


def markdown(summary: dict) -> str:
    """Per object: episodes, moved as asked, steps succeeded; then each episode not both."""
    cfg, eps = summary["config"], summary["episodes"]
    lines = ["# Push through the cores (ground-truth object positions)", "",
             f"Command: `{summary['command']}`", "", *record_lines(summary),
             f"Moved: the object moved {cfg['distance']} m +- {cfg['tolerance']} m along +x, "
             f"at most {cfg['tolerance']} m sideways, and stands (its centre's height within "
             f"{cfg['tolerance']} m).", "",
             "| object | episodes | moved | step succeeded |", "|---|---|---|---|"]
    names = sorted(Counter(e["object"] for e in eps))
    for name in [*names, "all"]:
        sel = [e for e in eps if name in ("all", e["object"])]
        lines.append(f"| {name} | {len(sel)} | {sum(e['moved'] for e in sel)} | "
                     f"{sum(e['step'] == 'succeeded' for e in sel)} |")
    odd = [e for e in eps if not (e["moved"] and e["step"] == "succeeded")]
    if odd:
        lines += ["", "| seed | object | moved (x, y, z) m | step | why |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e['seed']} | {e['object']} | {', '.join(map(str, e['moved_m']))} | "
                  f"{e['step']} | {e['failure'] or '-'} |" for e in odd]
    lines += ["", f"Each episode: the plan 'push <object> distance={cfg['distance']}' at "
              f"{cfg['speed']} m/s, the stroke at most at {cfg['push_speed']} m/s, for one object "
              "of a seeded layout (1-3 task objects, 0-2 distractors, random yaw); the reference "
              "controller at 500 Hz, the executor at 20 Hz. "
              f"Wall time {cfg['wall_s']} s on this machine.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
