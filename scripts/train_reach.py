#!/usr/bin/env python3
"""Train the learned reaching policy with rsl_rl's PPO in the embedded MuJoCo world.

    python scripts/train_reach.py --iterations 600 --num-envs 4096 --seed 0 --device cuda
    python scripts/train_reach.py --iterations 2 --num-envs 8 --out /tmp/reach   # smoke run

The world is the simulator's own (kestrel_sim's tabletop with the kestrel_description arm
attached); the task, observation, action and randomisation are kestrel_models.control.reach_env.
Writes into --out: policy.pt (rsl_rl's export_policy_to_jit), policy.onnx
(export_policy_to_onnx) and metrics.json (seed, sizes, time, learning curve, and the control
node parameters that run the exported policy: obs_layout, action_mode, action_scales, ...).
--time-budget-s stops training early (after a whole iteration) and still exports.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from source_paths import ROOT  # noqa: E402  (the checkout's packages first on sys.path)

DEFAULT_OUT = ROOT / "ros2_ws/src/kestrel_control/weights/reach"


class _Budget(Exception):
    """Raised from the per-iteration hook when the time budget is spent."""


def world_spec(world_file: str = "", robot_file: str = ""):  # noqa: ANN201 - mujoco.MjSpec
    """The simulator's world with the arm attached (kestrel_sim.core), as an MjSpec."""
    import mujoco
    from kestrel_sim.core.robot import attach_robot
    from kestrel_sim.core.scene import default_world_file

    spec = mujoco.MjSpec.from_file(str(world_file or default_world_file()))
    attach_robot(spec, robot_file)
    return spec


def home_positions() -> tuple[float, ...]:
    """The simulator's home arm configuration (its reset pose), rad."""
    from kestrel_sim.core.world import HOME_JOINT_POSITIONS

    return tuple(HOME_JOINT_POSITIONS)


def node_parameters(env, clip: float) -> dict:  # noqa: ANN001
    """The control node's parameters that run the exported policy as it was trained."""
    from kestrel_models.control.reach_env import ACTION_MODE, OBS_LAYOUT

    return {"policy.obs_layout": list(OBS_LAYOUT), "policy.action_mode": ACTION_MODE,
            "policy.action_scales": [float(s) for s in env.scales],
            "policy.action_clip": clip,
            "policy.default_joint_positions": [float(v) for v in env.default_q],
            "policy.obs_dim": int(env.get_observations()["policy"].shape[1]),
            "joint_names": list(env.cfg.joint_names)}


def machine(device: str) -> dict:
    import torch

    info = {"host": platform.node(), "cpu_model": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next(line.split(":", 1)[1].strip() for line in f
                                     if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iterations", type=int, default=600, help="PPO iterations")
    ap.add_argument("--num-envs", type=int, default=4096, help="arms simulated in parallel")
    ap.add_argument("--steps-per-env", type=int, default=24, help="rollout length per iteration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="torch device of the learner (cpu, cuda)")
    ap.add_argument("--threads", type=int, default=0, help="MuJoCo threads (0: all CPUs)")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch CPU threads (the learner; MuJoCo has its own)")
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="stop after the iteration that passes this wall time (0: no limit)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="policy.pt/.onnx + metrics.json")
    ap.add_argument("--export-every", type=int, default=0,
                    help="also export policy.pt and a checkpoint every N iterations (0: at the "
                    "end only)")
    ap.add_argument("--world-file", default="", help="MJCF world ('' = the simulator's)")
    ap.add_argument("--robot-file", default="", help="URDF ('' = kestrel_description's)")
    ap.add_argument("--no-progress", action="store_true", help="plain log lines, no bar")
    args = ap.parse_args(argv)
    if args.iterations < 1 or args.num_envs < 1:
        ap.error("--iterations and --num-envs must be >= 1")

    import numpy as np
    import torch
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)
    from rsl_rl.runners import OnPolicyRunner

    from kestrel_models.control.reach_env import ReachConfig, ReachEnv, train_config

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(max(1, args.torch_threads))
    t0 = time.perf_counter()
    cfg = ReachConfig(num_envs=args.num_envs, seed=args.seed, threads=args.threads,
                      default_q=home_positions())
    env = ReachEnv(world_spec(args.world_file, args.robot_file), cfg)
    train_cfg = train_config(num_steps_per_env=args.steps_per_env, seed=args.seed)
    runner = OnPolicyRunner(env, train_cfg, log_dir=None, device=args.device)
    setup_s = time.perf_counter() - t0

    curve: list[dict] = []
    losses: dict = {}
    update = runner.alg.update

    def update_and_keep() -> dict:
        out = update()
        losses.clear()
        losses.update(out)
        return out

    runner.alg.update = update_and_keep
    progress = Progress(TextColumn("[bold]train_reach"), BarColumn(), MofNCompleteColumn(),
                        TextColumn("{task.description}"), TimeElapsedColumn(),
                        TimeRemainingColumn(), disable=args.no_progress)
    task = progress.add_task("", total=args.iterations)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_train = time.perf_counter()

    def on_iteration(it: int, **_: object) -> None:
        stats = env.take_episode_stats()
        row = {"iteration": it, "wall_s": round(time.perf_counter() - t_train, 2),
               "episodes": stats["episodes"],
               "within_1cm": stats["within_1cm"], "final_distance_m": stats["final_distance_m"],
               "mean_reward_per_step": stats["mean_reward"],
               "action_std": float(runner.alg.get_policy().output_std.detach().mean()),
               **{f"loss_{k}": float(v) for k, v in losses.items()}}
        curve.append(row)
        text = (f"1cm {row['within_1cm']:.3f} d {row['final_distance_m'] * 100:.2f} cm "
                f"std {row['action_std']:.2f}")
        progress.update(task, advance=1, description=text)
        if args.no_progress and (it % 10 == 0 or it == args.iterations - 1):
            print(f"it {it} {row['wall_s']:.0f} s {text}", flush=True)
        if args.export_every and it and it % args.export_every == 0:
            runner.export_policy_to_jit(str(out), filename="policy.pt")
            runner.save(str(out / "checkpoint.pt"))
        if args.time_budget_s and time.perf_counter() - t0 > args.time_budget_s:
            raise _Budget

    runner.logger.log = on_iteration  # rsl_rl calls it once per iteration
    stopped = False
    with progress:
        try:
            runner.learn(num_learning_iterations=args.iterations, init_at_random_ep_len=True)
        except _Budget:
            stopped = True
    train_s = time.perf_counter() - t_train

    runner.export_policy_to_jit(str(out), filename="policy.pt")
    runner.export_policy_to_onnx(str(out), filename="policy.onnx")
    if args.export_every:
        runner.save(str(out / "checkpoint.pt"))
    last = curve[-10:]
    metrics = {
        "task": "reach",
        "command": " ".join(["python", "scripts/train_reach.py", *(argv or sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(args.device),
        "seed": args.seed, "iterations_done": len(curve), "iterations_asked": args.iterations,
        "stopped_by_time_budget": stopped,
        "num_envs": args.num_envs, "steps_per_env": args.steps_per_env,
        "env_steps": len(curve) * args.steps_per_env * args.num_envs,
        "setup_s": round(setup_s, 1), "train_s": round(train_s, 1),
        "train_final": {k: (sum(r[k] for r in last) / len(last) if last else None)
                        for k in ("within_1cm", "final_distance_m")},
        "node_parameters": node_parameters(env, cfg.action_clip),
        "env_config": {k: v for k, v in vars(cfg).items() if k not in ("num_envs", "threads")},
        "train_config": train_cfg,
        "versions": versions(),
        "curve": curve[:: max(1, len(curve) // 100)] + curve[-1:],
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"wrote {out / 'policy.pt'}, {out / 'policy.onnx'}, {out / 'metrics.json'}: "
          f"{len(curve)} iterations in {train_s:.0f} s, train within 1 cm "
          f"{metrics['train_final']['within_1cm']}")
    return 0


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    got = {}
    for name in ("rsl-rl-lib", "tensordict", "mujoco", "torch", "numpy"):
        try:
            got[name] = version(name)
        except PackageNotFoundError:
            got[name] = None
    return got


if __name__ == "__main__":
    sys.exit(main())
