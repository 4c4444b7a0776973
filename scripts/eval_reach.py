#!/usr/bin/env python3
"""Reach success of the control node's controllers in the simulator's world, like a paper's table.

    python scripts/eval_reach.py --targets 200 --seed 1       # -> docs/benchmarks/reach_cpu.*

For each controller and control rate, the same seeded random reachable targets (end-effector
positions of collision-free configurations in the task box, held out from training by the seed)
and starts; each episode runs `--episode-s` of sim time:
  learned   the exported rsl_rl policy (weights/reach/policy.pt) through the node's user-model
            path: PolicyRunner with a TorchScript ModelSpec and the obs_layout / action_mode /
            action_scales / default_joint_positions of its metrics.json, the Cartesian target
            in the robot's `ee_target` buffer;
  diff_ik   the differential-IK reference controller (IkRunner, MODE_CARTESIAN at --ik-speed).
Per tick (every 1 / rate s of sim time): the joint state (stamped with the sim time) goes into
the runner's buffer, the runner's command becomes the arm's position-servo targets after
`--latency-steps` physics steps (1 ms each). Success: the end effector within 1 cm of the
target at the end of the episode; also reported: reached within 1 cm at any time, time to
first reach, final distance quantiles, and the controller's step time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from source_paths import ROOT  # noqa: E402  (the checkout's packages first on sys.path)

import mujoco  # noqa: E402
import numpy as np  # noqa: E402

WEIGHTS = ROOT / "ros2_ws/src/kestrel_control/weights/reach"
SUCCESS_M = 0.01
SHOULDER_M = 0.52  # height of the shoulder above the base, m (the arm's reach is measured from it)
REACH_BINS_M = (0.0, 0.5, 0.6, 0.7, 1.0)  # target distance from the shoulder, m


class Scene:
    """The simulator's world without its free objects, the arm on position servos."""

    def __init__(self, seed: int, count: int) -> None:
        from train_reach import home_positions, world_spec

        from kestrel_models.control.arm_chain import ArmChain
        from kestrel_models.control.reach_env import ARM_JOINTS, ReachConfig, arm_model
        from kestrel_models.control.reach_env import ConfigurationPool

        self.model = arm_model(world_spec())
        self.data = mujoco.MjData(self.model)
        cfg = ReachConfig(default_q=home_positions())
        chain = ArmChain(self.model, ARM_JOINTS, cfg.base_body, cfg.ee_site)
        rng = np.random.default_rng(seed)
        pool = ConfigurationPool(self.model, chain, cfg, 2 * count, rng)
        self.targets = pool.ee[:count]  # [count, 3] m, base frame
        self.starts = pool.q[count:]  # [count, 6] rad
        home = rng.random(count) < cfg.home_start_prob
        self.starts[home] = np.asarray(cfg.default_q) + rng.uniform(-0.1, 0.1, (home.sum(), 6))
        m = self.model
        ids = [m.joint(j).id for j in ARM_JOINTS]
        self.qadr, self.vadr = m.jnt_qposadr[ids], m.jnt_dofadr[ids]
        self.act = np.array([m.actuator(j).id for j in ARM_JOINTS])
        self.site = m.site(cfg.ee_site).id
        self.base = m.body(cfg.base_body).id

    def ee_base(self) -> np.ndarray:
        """End-effector position in the base frame, m (after mj_kinematics)."""
        d = self.data
        rot = d.xmat[self.base].reshape(3, 3)
        return rot.T @ (d.site_xpos[self.site] - d.xpos[self.base])


def policy_runner(weights: Path, model_file: str = "policy.pt",  # noqa: ANN201 - PolicyRunner
                  backend: str = "cpu_eager", latency_compensation: bool = False):
    """The exported policy through the node's user-model path (PolicyRunner + ModelSpec)."""
    from kestrel_control.core.kinematics import ArmKinematics
    from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
    from kestrel_models.control.external import ModelSpec

    p = json.loads((weights / "metrics.json").read_text())["node_parameters"]
    kin = ArmKinematics.from_default(joint_names=tuple(p["joint_names"]))
    cfg = RunnerConfig(
        joint_lower=kin.lower, joint_upper=kin.upper, warmup_steps=5, max_obs_age_s=0.05,
        backend=backend, latency_compensation=latency_compensation,
        model=ModelSpec(path=str(weights / model_file), obs_dim=p["policy.obs_dim"]),
        obs_layout=tuple(p["policy.obs_layout"]), action_mode=p["policy.action_mode"],
        action_scales=tuple(p["policy.action_scales"]), action_clip=p["policy.action_clip"],
        default_joint_positions=tuple(p["policy.default_joint_positions"]),
        joint_names=tuple(p["joint_names"]))
    return PolicyRunner(cfg)


def ik_runner(rate_hz: float):  # noqa: ANN201 - IkRunner
    from kestrel_control.core.cartesian import CartesianConfig
    from kestrel_control.core.ik_runner import IkRunner
    from kestrel_control.core.kinematics import ArmKinematics
    from kestrel_control.core.policy_runner import RunnerConfig

    kin = ArmKinematics.from_default()
    cfg = RunnerConfig(joint_lower=kin.lower, joint_upper=kin.upper, max_obs_age_s=0.05,
                       warmup_steps=0)
    return IkRunner(cfg, kin, CartesianConfig(rate_hz=rate_hz))


def run_episode(scene: Scene, runner, kind: str, i: int, rate_hz: float, episode_s: float,  # noqa: ANN001
                latency_steps: int, ik_speed: float, step_times: list[float]) -> dict:
    """One reach: start i, target i; returns final distance, first time within 1 cm."""
    m, d = scene.model, scene.data
    mujoco.mj_resetData(m, d)
    d.qpos[scene.qadr] = scene.starts[i]
    d.ctrl[scene.act] = scene.starts[i]
    mujoco.mj_forward(m, d)
    target = scene.targets[i]
    runner.reset()
    robot = runner.robots[0]
    if kind == "learned":
        robot.ee_target.write(target)
    else:
        robot.mode.write(np.array([*target, ik_speed, 2.0]))  # MODE_CARTESIAN
    per_tick = round(1.0 / (rate_hz * m.opt.timestep))
    ticks = round(episode_s * rate_hz)
    js = np.zeros((2, 6))
    pending = d.ctrl[scene.act].copy()
    first = float("nan")
    for k in range(ticks):
        now_ns = round(d.time * 1e9)
        js[0], js[1] = d.qpos[scene.qadr], d.qvel[scene.vadr]
        robot.joint_states.write(js, now_ns)
        t0 = time.perf_counter()
        cmd, info = runner.step(now_ns)
        step_times.append(time.perf_counter() - t0)
        if info.valid:
            pending[:] = cmd
        for s in range(per_tick):
            if s == latency_steps:
                d.ctrl[scene.act] = pending
            mujoco.mj_step(m, d)
        if latency_steps >= per_tick:
            d.ctrl[scene.act] = pending  # later than the tick: from the next tick's first step
        if first != first:  # not reached yet (NaN)
            mujoco.mj_kinematics(m, d)
            if np.linalg.norm(scene.ee_base() - target) < SUCCESS_M:
                first = (k + 1) / rate_hz
    mujoco.mj_kinematics(m, d)
    return {"final_m": float(np.linalg.norm(scene.ee_base() - target)), "first_s": first}


def evaluate(scene: Scene, kind: str, rate_hz: float, episode_s: float = 2.0,
             latency_steps: int = 1, ik_speed: float = 1.0, weights: Path = WEIGHTS,
             progress=None, latency_compensation: bool = False) -> dict:  # noqa: ANN001
    """Every target of `scene` with one controller at one rate -> summary numbers."""
    runner = policy_runner(weights, latency_compensation=latency_compensation) \
        if kind == "learned" else ik_runner(rate_hz)
    finals, firsts, times = [], [], []
    for i in range(len(scene.targets)):
        r = run_episode(scene, runner, kind, i, rate_hz, episode_s, latency_steps, ik_speed,
                        times)
        finals.append(r["final_m"])
        firsts.append(r["first_s"])
        if progress is not None:
            progress()
    finals, firsts = np.array(finals), np.array(firsts)
    reached = np.isfinite(firsts)
    return {
        "n": len(finals),
        "success_rate": float(np.mean(finals < SUCCESS_M)),
        "success_ci95": wilson(int(np.sum(finals < SUCCESS_M)), len(finals)),
        "reached_rate": float(np.mean(reached)),
        "time_to_1cm_s_p50": float(np.median(firsts[reached])) if reached.any() else None,
        "time_to_1cm_s_p95": float(np.quantile(firsts[reached], 0.95)) if reached.any()
        else None,
        "final_distance_mm_p50": float(np.median(finals) * 1e3),
        "final_distance_mm_p95": float(np.quantile(finals, 0.95) * 1e3),
        "final_distance_mm_max": float(finals.max() * 1e3),
        "failures": [int(i) for i in np.flatnonzero(finals >= SUCCESS_M)],
        "success_by_shoulder_distance": by_reach(scene.targets, finals < SUCCESS_M),
        "step_s": np.asarray(times),
    }


def wilson(k: int, n: int, z: float = 1.96) -> list[float]:
    """95% Wilson score interval of a success rate k / n."""
    if n == 0:
        return [0.0, 1.0]
    p = k / n
    mid = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(float(mid - half), 4), round(float(mid + half), 4)]


def by_reach(targets: np.ndarray, ok: np.ndarray) -> dict:
    """Successes per bin of target distance from the shoulder: {"a-b m": "k/n"}."""
    dist = np.linalg.norm(targets - np.array([0.0, 0.0, SHOULDER_M]), axis=1)
    out = {}
    for lo, hi in zip(REACH_BINS_M[:-1], REACH_BINS_M[1:], strict=True):
        m = (dist >= lo) & (dist < hi)
        out[f"{lo:g}-{hi:g} m"] = f"{int(ok[m].sum())}/{int(m.sum())}"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1, help="targets and starts (training: 0)")
    ap.add_argument("--rates", type=float, nargs="+", default=[1000.0, 500.0], help="Hz")
    ap.add_argument("--controllers", nargs="+", default=["learned", "diff_ik"],
                    choices=["learned", "diff_ik"])
    ap.add_argument("--episode-s", type=float, default=2.0, help="sim time per target")
    ap.add_argument("--latency-steps", type=int, default=1,
                    help="physics steps (1 ms) from a tick to its command acting")
    ap.add_argument("--ik-speed", type=float, default=1.0,
                    help="the Cartesian target's max_speed for diff_ik, m/s")
    ap.add_argument("--latency-compensation", action="store_true",
                    help="the policy runner predicts positions forward (policy."
                    "latency_compensation)")
    ap.add_argument("--weights", default=str(WEIGHTS))
    ap.add_argument("--out", default=None, help="record path stem (default "
                    "docs/benchmarks/reach_<machine class>)")
    args = ap.parse_args(argv)

    import torch
    from rich.progress import Progress

    from kestrel_bench import stats
    from kestrel_bench.record import Record, out_stem, write

    torch.set_num_threads(1)
    scene = Scene(args.seed, args.targets)
    config = {"targets": args.targets, "seed": args.seed, "episode_s": args.episode_s,
              "success": "end effector within 1 cm of the target at the episode's end",
              "latency_steps": args.latency_steps, "physics_dt_s": scene.model.opt.timestep,
              "ik_max_speed_m_s": args.ik_speed, "latency_compensation": args.latency_compensation,
              "weights": str(Path(args.weights).resolve().relative_to(ROOT))
              if Path(args.weights).resolve().is_relative_to(ROOT) else args.weights}
    rec = Record("reach", config=config,
                 argv=["python", "scripts/eval_reach.py", *(argv or sys.argv[1:])],
                 machine=None)
    runs = [(c, r) for c in args.controllers for r in args.rates]
    with Progress() as progress:
        task = progress.add_task("eval_reach", total=len(runs) * args.targets)
        for kind, rate in runs:
            out = evaluate(scene, kind, rate, args.episode_s, args.latency_steps,
                           args.ik_speed, Path(args.weights),
                           lambda: progress.advance(task), args.latency_compensation)
            step_s = out.pop("step_s")
            rec.add(f"{kind}_{rate:g}hz", "optimized" if kind == "learned" else "baseline",
                    config={"controller": kind, "rate_hz": rate},
                    latency_ms=stats.summary(step_s, 1e3), metrics=out)
    for rate in args.rates:
        a, b = rec.result(f"learned_{rate:g}hz"), rec.result(f"diff_ik_{rate:g}hz")
        if a and b and b["metrics"]["success_rate"] > 0:
            rec.ratio(f"learned_vs_diff_ik_success_{rate:g}hz",
                      a["metrics"]["success_rate"] / b["metrics"]["success_rate"])
    rec.note("latency_ms: the controller's step (runner.step) on this machine's CPU, "
             "one thread")
    js, _ = write(rec, out_stem(args.out, "reach", rec.machine_class))
    for r in rec["results"]:
        mt = r["metrics"]
        print(f"{r['name']:>18}: success {mt['success_rate']:.3f} reached "
              f"{mt['reached_rate']:.3f} final p50 {mt['final_distance_mm_p50']:.2f} mm "
              f"p95 {mt['final_distance_mm_p95']:.2f} mm t1cm p50 {mt['time_to_1cm_s_p50']}")
    print(f"wrote {js} (+ .md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
