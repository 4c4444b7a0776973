#!/usr/bin/env python3
"""Stacking success of the robot side of the loop, without ROS, perception or a learned
planner: seeded layouts of the simulator, every ordered pair of task objects (A, B) of a
layout stacked by the plan "pick A; place B" (what the planner makes of "stack A on B"; the
planner's executor, the reference controller at 500 Hz, MuJoCo physics;
kestrel_bringup.core_loop), object positions from the simulator's ground truth.

    python scripts/eval_stack.py --seeds 30 --out docs/benchmarks/stack_cores_cpu

An episode counts as stacked when, after the plan and a settling time, A rests on B
(kestrel_bringup.episode_tasks.stacked, as the closed-loop evaluation's `--task stack`): A's
bottom within `--tolerance` of B's top and its centre over B's top face; and no finger on A.
How far A's centre is from B's, how far B moved, the steps' own outcomes and the places that
released on contact short of their point (the executor's place_contact_height) are reported
beside it. Writes <out>.json and <out>.md.
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
    eval_command,
    eval_config,
    layout_pairs,
    run_plan,
    truth,
)
from kestrel_bringup.episode_tasks import stack_offsets, stacked  # noqa: E402
from kestrel_bringup.evaluation import record_lines, run_record, write_record  # noqa: E402
from kestrel_control.core.kinematics import ArmKinematics  # noqa: E402
from kestrel_planner.core.executor import StepState  # noqa: E402
from kestrel_sim.core import SimWorld  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=30, help="layouts 1..N (seed = index)")
    parser.add_argument("--speed", type=float, default=0.3, help="plan speed, m/s")
    parser.add_argument("--place-contact-height", type=float, default=None,
                        help="m, the executor's place_contact_height (default: the planner "
                             "node's; 0 = off)")
    parser.add_argument("--tolerance", type=float, default=0.01, help="m, see the docstring")
    parser.add_argument("--timeout", type=float, default=30.0, help="sim s per episode")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    world = SimWorld(EVAL_WORLD)
    kin = ArmKinematics.from_default()
    record = run_record()  # machine, commit, date: at the start
    executor = ({} if args.place_contact_height is None
                else {"place_contact_height": args.place_contact_height})
    episodes, t0 = [], time.monotonic()
    for seed, top, base in layout_pairs(world, args.seeds):
        before = truth(world)
        events: list = []
        ex = run_plan(world, f"pick {top} speed={args.speed}\nplace {base} "
                      f"speed={args.speed}\nend", args.timeout, kin, events=events, **executor)
        after, start = truth(world), before[base][0]
        ok = stacked(after, top, base, args.tolerance) and top not in world.task_status().held
        side, gap, moved = stack_offsets(after, top, base, start)
        failed = [e.message for e in events if e.status == StepState.FAILED]
        pair = f"{top.split('_')[-1]} on {base.split('_')[-1]}"
        episodes.append({
            "seed": seed, "top": top, "base": base, "pair": pair, "stacked": ok,
            "offset_m": round(side, 4), "gap_m": round(gap, 4), "base_moved_m": round(moved, 4),
            "steps": [s.name.lower() for s in ex.statuses],
            "landed": any(e.message.startswith("landed") for e in events),
            "failure": failed[0] if failed else ""})
        print(f"seed {seed} {top} on {base}: {'stacked' if ok else 'NOT stacked'} "
              f"(offset {side:.3f}, gap {gap:.3f}, base moved {moved:.3f} m), steps "
              f"{episodes[-1]['steps']}", flush=True)
    summary = {"schema": "kestrel_stack_eval/1", "config": eval_config(args, t0),
               "command": eval_command("scripts/eval_stack.py", argv), **record,
               "episodes": episodes}
    text = markdown(summary)
    print(text)
    if args.out:
        write_record(args.out, summary, text)
    return 0


def markdown(summary: dict) -> str:
    """Per shape pair: episodes, stacked, both steps succeeded, released on contact; then
    each episode not stacked or with a failed step."""
    cfg, eps = summary["config"], summary["episodes"]
    lines = ["# Stacking through the cores (ground-truth object positions)", "",
             f"Command: `{summary['command']}`", "", *record_lines(summary),
             f"Stacked: the top object rests on the base object, released: its bottom "
             f"within {cfg['tolerance']} m of the base's top, its centre over the base's top "
             "face.", "",
             "| top on base | episodes | stacked | both steps succeeded | released on contact |",
             "|---|---|---|---|---|"]
    for pair in [*sorted(Counter(e["pair"] for e in eps)), "all"]:
        sel = [e for e in eps if pair in ("all", e["pair"])]
        lines.append(f"| {pair} | {len(sel)} | {sum(e['stacked'] for e in sel)} | "
                     f"{sum(e['steps'] == ['succeeded'] * 2 for e in sel)} | "
                     f"{sum(e['landed'] for e in sel)} |")
    odd = [e for e in eps if not (e["stacked"] and e["steps"] == ["succeeded"] * 2)]
    if odd:
        lines += ["", "| seed | top on base | offset, gap, base moved (m) | steps | why |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e['seed']} | {e['top']} on {e['base']} | {e['offset_m']}, "
                  f"{e['gap_m']}, {e['base_moved_m']} | {', '.join(e['steps'])} | "
                  f"{e['failure'] or '-'} |" for e in odd]
    lines += ["", f"Each episode: the plan 'pick <top>; place <base>' at {cfg['speed']} m/s for "
              "an ordered pair of the task objects of a seeded layout (1-3 task objects: 5 cm "
              "cubes, 8 cm tall cylinders; 0-2 distractors, random yaw); the reference "
              "controller at 500 Hz, the executor at 20 Hz. Wall time "
              f"{cfg['wall_s']} s on this machine.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
