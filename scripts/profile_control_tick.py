#!/usr/bin/env python3
"""The control tick's parts without inference (issue 3): what a tick costs around the backend.

On the H200 the loop-process tick ran ~40 us at the median with a ~22 us backend step
(docs/benchmarks/control_persistent_h200.md), and nobody had split the rest. This script times
each host-side part on the machine it runs on, with the backend's step replaced by a no-op
(CPU, no GPU needed), so the parts are the same code the loop runs:
  step_all host path   PolicyRunner.step_all, in-process buffers, tanh/clamp on the host
                       (cpu_* / cuda_eager / cuda_graph backends)
  step_all post path   the same on the loop process's shared-memory buffers, with the
                       command/finite/clamped row a POST backend (cuda_graph_compiled /
                       cuda_graph_triton / cuda_persistent) computes on the GPU
  child tick           loop_child._Tick: step_all (post path) + command into shared memory
                       + eventfd write; and the same with the C tick (native_tick.py:
                       prepare and finish in C, the no-op step between them in Python)
  parts                shared-memory reads/writes, LoopStats.record (in-process; in shared
                       memory through memoryviews; and through numpy element access as before
                       session 8, for comparison), eventfd_write, time.time_ns.
Percentiles over --iters calls each, after 2,000 warm-up calls. JSON + a table.

    python scripts/profile_control_tick.py --out docs/benchmarks/control_tick_parts_cpu
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

N = 12  # joints, as the reference policy's 12 actions


def measure(fn, iters: int) -> dict:
    p = np.percentile(bc.time_calls(fn, iters, warmup=2000), [50, 99, 99.9]) * 1e6
    return {"p50_us": float(p[0]), "p99_us": float(p[1]), "p999_us": float(p[2])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--git-commit", default="")
    ap.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    args = ap.parse_args()

    from kestrel_control.core.loop_child import _Tick
    from kestrel_control.core.policy_runner import PolicyRunner, RunnerConfig
    from kestrel_control.core.shm_control import ShmLayout, ShmSegment, ShmViews
    from kestrel_control.core.stats import LoopStats

    def config() -> RunnerConfig:
        return RunnerConfig(joint_lower=[-3.0] * N, joint_upper=[3.0] * N, max_obs_age_s=30.0,
                            warmup_steps=2)

    now = time.time_ns()
    js = np.zeros((2, N))
    js[0] = 0.1  # rad
    rows: dict[str, dict] = {}
    host = PolicyRunner(config())
    host.backend.step = lambda: None  # the parts around inference only
    host.joint_states.write(js, now)
    host.target.write(np.zeros(N), now)
    rows["step_all host path (in-process buffers)"] = measure(lambda: host.step_all(now),
                                                              args.iters)
    layout = ShmLayout(1, N, 1e-3)
    seg = ShmSegment(f"kestrel_profile_tick_{os.getpid()}", layout.size, create=True)
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    try:
        views = ShmViews(seg.buf, layout)
        views.clear()
        run = PolicyRunner(config(), counters=views.stats,
                           buffers=list(zip(views.joint_states, views.targets, strict=True)))
        run.backend.step = lambda: None
        run._post = np.zeros((run.batch, N + 2), np.float32)  # what a POST backend fills
        run._post[:, N] = 1.0  # all finite, none clamped
        views.joint_states[0].write(js, now)
        views.targets[0].write(np.zeros(N), now)
        rows["step_all post path (shared memory)"] = measure(lambda: run.step_all(now),
                                                             args.iters)
        tick = _Tick(run, views, efd)

        def child_tick() -> None:
            tick(0)
            try:
                os.eventfd_read(efd)  # keep the counter from saturating (not the tick's)
            except BlockingIOError:
                pass

        rows["child tick (+ one eventfd_read)"] = measure(child_tick, args.iters)
        ctick = _Tick(run, views, efd, native=True)  # the C tick (native_tick.py)
        if ctick.native is not None:
            def child_tick_c() -> None:
                ctick(0)
                try:
                    os.eventfd_read(efd)
                except BlockingIOError:
                    pass

            rows["child tick, C: prepare + finish in C, the step in Python (+ eventfd_read)"] = \
                measure(child_tick_c, args.iters)
        else:
            print(f"C tick not measured: {ctick.native_status}", file=sys.stderr)
        robot = run.robots[0]
        rows["shm joint-state read_into"] = measure(
            lambda: views.joint_states[0].read_into(robot.js), args.iters)
        rows["shm command write"] = measure(
            lambda: views.commands[0].write(run.commands[0], now), args.iters)
        stats = views.stats
        rows["LoopStats.record in shared memory"] = measure(
            lambda: stats.record(0.0, 1e-5, 1e-3, 5), args.iters)
        rows["  same, numpy element access (before)"] = measure(
            lambda: LoopStats.record(stats, 0.0, 1e-5, 1e-3, 5), args.iters)
        local = LoopStats(1e-3)
        rows["LoopStats.record in-process"] = measure(lambda: local.record(0.0, 1e-5, 1e-3, 5),
                                                      args.iters)
        rows["eventfd_write"] = measure(lambda: os.eventfd_write(efd, 1), args.iters)
        rows["time.time_ns"] = measure(time.time_ns, args.iters)
        views.release()
    finally:
        os.close(efd)
        seg.unlink()
    commit = bc.git_commit(args.git_commit)
    result = {"command": " ".join(sys.argv), "git_commit": commit,
              "machine": bc.machine_info(), "iters": args.iters, "rows": rows}
    lines = [f"# Control tick parts without inference ({result['machine'].get('cpu_model', '?')})",
             "", f"`{result['command']}`, git {commit}, {args.iters} calls each, us:", "",
             "| part | p50 | p99 | p99.9 |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['p50_us']:.2f} | {v['p99_us']:.2f} | {v['p999_us']:.2f} |"
              for k, v in rows.items()]
    bc.write_result(args.out, result, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
