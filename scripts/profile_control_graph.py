#!/usr/bin/env python3
"""Where the CUDA-graph policy step's time goes (a profile, not a test): for each backend, the
kernels and copies inside one replay (torch.profiler over `--iters` steps: count and GPU us per
step), the host-timed backend step (replay + poll) percentiles and, as a sanity check, the
largest |action - fp32 eager CPU| over 200 recurrent steps on random observations. GPU only.
cuda_persistent is one resident kernel: it gets the step percentiles and the diff, no profile.

  python scripts/profile_control_graph.py --backends cuda_graph,cuda_graph_triton \
      --out docs/benchmarks/control_graph_profile_h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402
import bench_control as bc  # noqa: E402 (puts models/ and kestrel_control on sys.path)
from kestrel_models.control.policy import PolicyConfig, build_policy  # noqa: E402


def max_diff_vs_eager(backend, steps: int = 200) -> float:
    """Largest |actions - fp32 eager CPU ActorCritic.step| over `steps` recurrent steps (the
    runner's seed-0 reference policy; random observations, state carried)."""
    model = build_policy(PolicyConfig(), seed=0)
    gen = torch.Generator().manual_seed(0)
    h, c = model.initial_state(backend.batch, "cpu")
    backend.reset_state()
    worst = 0.0
    with torch.no_grad():
        for _ in range(steps):
            x = torch.randn(backend.batch, backend.policy.obs_dim, generator=gen)
            backend.obs_host.copy_(x)
            backend.step()
            a, _, h, c = model.step(x, h, c)
            worst = max(worst, (backend.act_host - a).abs().max().item())
    backend.reset_state()
    return worst


def profile_backend(name: str, iters: int, cache: str) -> dict:
    runner = bc.make_runner(name, cache)
    diff = max_diff_vs_eager(runner.backend)
    step = runner.backend.step
    times = bench_common.time_calls(step, iters, warmup=200)
    if name == "cuda_persistent":  # one resident kernel: nothing per step for the profiler
        runner.close()
        return {"backend_step_us": bc.pct(times), "max_abs_diff_vs_fp32_eager": diff,
                "gpu_us_per_step": float("nan"), "gpu_ops_per_step": 0.0, "ops": []}
    n_prof = 100
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(n_prof):
            step()
        torch.cuda.synchronize()
    per = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            per[ev.name][0] += 1
            per[ev.name][1] += ev.device_time_total
    rows = sorted(((k, c / n_prof, us / n_prof) for k, (c, us) in per.items()),
                  key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    count = sum(r[1] for r in rows)
    return {"backend_step_us": bc.pct(times), "max_abs_diff_vs_fp32_eager": diff,
            "gpu_us_per_step": total,
            "gpu_ops_per_step": count,
            "ops": [{"name": k[:90], "per_step": c, "us_per_step": us} for k, c, us in rows]}


def spaced_steps(name: str, iters: int, cache: str, gaps_us: list[float]) -> dict:
    """The same backend step and full tick (`runner.step`) back to back and with the loop's idle
    gap between calls (busy-waited, as the loop with spin_us = period does): does a GPU (or
    core) that idled ~1 ms between steps make the step slower? No ROS, one process."""
    runner = bc.make_runner(name, cache)
    js = np.zeros((2, bc.N_JOINTS))
    clock = time.perf_counter_ns
    out = {}
    for gap in gaps_us:
        gap_ns = int(gap * 1e3)
        step_t, tick_t = np.empty(iters), np.empty(iters)
        for i in range(iters + 100):
            t_end = clock() + gap_ns
            while clock() < t_end:
                pass
            now = time.time_ns()
            runner.joint_states.write(js, now)
            a = clock()
            runner.step(now + 1000)
            b = clock()
            if i >= 100:
                tick_t[i - 100] = (b - a) * 1e-9
                step_t[i - 100] = runner._last_step_s
        out[f"gap_{gap:g}us"] = {"tick_us": bc.pct(tick_t), "backend_step_us": bc.pct(step_t)}
        t, s = out[f"gap_{gap:g}us"]["tick_us"], out[f"gap_{gap:g}us"]["backend_step_us"]
        print(f"  {name} gap {gap:6.0f} us: tick p50 {t['p50']:.1f} p99.9 {t['p999']:.1f} | "
              f"backend p50 {s['p50']:.1f} p99.9 {s['p999']:.1f} us", flush=True)
    runner.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="cuda_graph,cuda_graph_compiled")
    ap.add_argument("--iters", type=int, default=5000)
    ap.add_argument("--gaps-us", default="", help="e.g. 0,200,950: the spaced-steps test only")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: needs a CUDA GPU")
        return 0
    torch.set_num_threads(1)
    result = {"machine": bench_common.machine_info(),
              "commit": args.commit or bench_common.git_commit(),
              "command": " ".join(sys.argv), "backends": {}}
    with tempfile.TemporaryDirectory() as cache:
        if args.gaps_us:
            gaps = [float(g) for g in args.gaps_us.split(",")]
            result["spaced"] = {n: spaced_steps(n, args.iters, cache, gaps)
                                for n in args.backends.split(",")}
        for name in ([] if args.gaps_us else args.backends.split(",")):
            r = profile_backend(name, args.iters, cache)
            result["backends"][name] = r
            s = r["backend_step_us"]
            print(f"## {name}: step p50 {s['p50']:.1f} p99 {s['p99']:.1f} p99.9 {s['p999']:.1f}"
                  f" us; GPU {r['gpu_us_per_step']:.1f} us in {r['gpu_ops_per_step']:.0f} ops; "
                  f"max |diff| vs fp32 eager {r['max_abs_diff_vs_fp32_eager']:.1e}", flush=True)
            for op in r["ops"][:25]:
                print(f"  {op['per_step']:4.1f} x {op['us_per_step']:7.2f} us  {op['name']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
