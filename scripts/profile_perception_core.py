#!/usr/bin/env python3
"""Where the perception node's model stage differs from the forward benchmark, without ROS.

The node reports its model stage at ~4.4 ms on the H200, `bench_perception.py` the same
variant's forward at 3.56 ms back to back and 3.78 ms with the GPU idle 90 ms before each
forward (docs/benchmarks/perception_node_h200.md). This script runs, in ONE process with the
node's settings (core_config of the node's parameters, r50, 6 cameras, 120k points, 16UC1 at
stride 4, zero-copy maps), on the same inputs:
  core     PerceptionCore.process(frames) every `--gap-ms` (sleep between frames, as the node at
           10 Hz): the core's own stage timings (CUDA events), i.e. the node's figures without
           ROS;
  runtime  the core's PerceptionRuntime.run() on the staged device input, CUDA events around it,
           with the same gap: what bench_perception.py measures, in the core's process.
If `core` shows the node's model stage and `runtime` the benchmark's, the difference is in the
core's path around the forward; if both show the benchmark's, it is in the node process (ROS
threads, DDS). JSON + a table.

  python scripts/profile_perception_core.py --device cuda --out docs/benchmarks/perception_core_h200
  python scripts/profile_perception_core.py --config tiny --device cpu --cams 2 --frames 5  # smoke
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for sub in ("scripts", "models", "ros2_ws/src/kestrel_common", "ros2_ws/src/kestrel_perception"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from bench_common import git_commit, machine_info, pct, write_result  # noqa: E402
from bench_perception_node import camera_poses  # noqa: E402

CONFIGS = {"tiny": {"backbone_depth": 18, "base_width": 16, "fpn_channels": 64, "head_convs": 1},
           "r50": {"backbone_depth": 50, "base_width": 64, "fpn_channels": 256, "head_convs": 4}}


def frames(cams: int, hw: tuple[int, int], points: int):  # noqa: ANN201 (FrameSet)
    from kestrel_perception.core.types import CameraModel, FrameSet

    h, w = hw
    rng = np.random.default_rng(1)
    K = np.array([[w / 2, 0.0, w / 2], [0.0, w / 2, h / 2], [0.0, 0.0, 1.0]])
    _, poses = camera_poses(cams)  # the node benchmark's ring, 1 m up: T_world_from_cam
    cameras = [CameraModel(K, w, h, f"cam{c}_optical", T) for c, T in enumerate(poses)]
    r = 2 + 28 * rng.random(points)
    a = 2 * math.pi * rng.random(points)
    xyz = np.stack([r * np.cos(a), r * np.sin(a), -0.5 + 3 * rng.random(points)], 1)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for _ in range(cams)]
    return FrameSet(0, images, cameras, xyz.astype(np.float32) if points else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=tuple(CONFIGS), default="r50")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--variant", default="branch_bf16w_fold_s2d4_group_cudnn_stem_graph")
    ap.add_argument("--cams", type=int, default=6)
    ap.add_argument("--image-hw", type=int, nargs=2, default=(640, 640))
    ap.add_argument("--points", type=int, default=120_000)
    ap.add_argument("--frames", type=int, default=30)
    ap.add_argument("--gap-ms", type=float, default=90.0)
    ap.add_argument("--kernels", type=int, default=0,
                    help="then profile this many frames (torch.profiler, CUDA kernels): the top "
                         "kernels per frame and one frame's kernel timeline into the JSON")
    ap.add_argument("--region-compile", choices=("on", "off"), default="on",
                    help="node parameter region_compile (torch.compile'd region steps)")
    ap.add_argument("--git-commit", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch
    from kestrel_perception.core import PerceptionCore
    from kestrel_perception.core.params import SPECS, core_config

    h, w = args.image_hw
    values = {**{spec.name: spec.default for spec in SPECS}, **CONFIGS[args.config],
              "device": args.device, "num_cameras": args.cams, "warmup_size": [w, h],
              "runtime_variant": args.variant,
              "depth_encoding": "16UC1", "output_stride": 4, "score_threshold": 0.0,
              "max_detections": 20, "max_points": max(500_000, args.points),
              "region_compile": args.region_compile == "on"}
    t0 = time.monotonic()
    core = PerceptionCore(core_config(values))
    ready_s = time.monotonic() - t0
    fs = frames(args.cams, (h, w), args.points)
    cuda = core.device.type == "cuda"
    stages: dict[str, list[float]] = {}
    for i in range(args.frames + 3):
        time.sleep(args.gap_ms * 1e-3)
        out = core.process(fs)
        if i >= 3:
            for k, v in out.timings.items():
                stages.setdefault(k, []).append(v * 1e3)
    rt = core.runtime
    if rt is None:
        raise SystemExit(f"--variant {args.variant!r}: no PerceptionRuntime to time (use a "
                         "runtime variant, e.g. eager_fp32 on the CPU)")
    x = core.staging.images(fs.images)
    run_ms: list[float] = []
    for i in range(args.frames + 3):
        if cuda:
            torch.cuda.synchronize()
        time.sleep(args.gap_ms * 1e-3)
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            rt.run(x, heads=core.heads)
            b.record()
            b.synchronize()
            ms = a.elapsed_time(b)
        else:
            t = time.perf_counter()
            rt.run(x, heads=core.heads)
            ms = (time.perf_counter() - t) * 1e3
        if i >= 3:
            run_ms.append(ms)
    kernels = profile_kernels(core, fs, args.kernels, args.gap_ms) if args.kernels else None
    device = torch.cuda.get_device_name() if cuda else "cpu"
    res = {"command": "python " + " ".join(sys.argv), "git_commit": git_commit(args.git_commit),
           "torch": torch.__version__, "device": device, "machine": machine_info(device=device),
           "ready_s": ready_s, "gap_ms": args.gap_ms, "frames": args.frames,
           "region_compile": args.region_compile,
           "core_stage_ms": {k: {"p50": pct(v, 50), "p99": pct(v, 99)} for k, v in
                             stages.items()},
           "runtime_run_ms": {"p50": pct(run_ms, 50), "p99": pct(run_ms, 99)}}
    lines = [f"# Perception core vs runtime.run, one process ({res['device']})", "",
             f"`{res['command']}`, git {res['git_commit']}, gap {args.gap_ms} ms before each "
             f"frame, {args.frames} frames, ready after {ready_s:.1f} s, region_compile "
             f"{args.region_compile}.", "",
             "| measure | p50 ms | p99 ms |", "|---|---|---|"]
    lines += [f"| core stage {k} | {v['p50']:.3f} | {v['p99']:.3f} |"
              for k, v in res["core_stage_ms"].items()]
    lines.append(f"| runtime.run alone (CUDA events) | {res['runtime_run_ms']['p50']:.3f} | "
                 f"{res['runtime_run_ms']['p99']:.3f} |")
    if kernels is not None:
        res["kernels"] = kernels
        lines += ["", f"Kernels per frame ({args.kernels} profiled frames; us = device time per "
                  "frame), top 40:", "", "| kernel | calls / frame | us / frame |", "|---|---|---|"]
        lines += [f"| {k['name'][:90]} | {k['calls']:.1f} | {k['us']:.1f} |"
                  for k in kernels["top"][:40]]
        lines += ["", "One frame's kernels in issue order, grouped into runs of the same name "
                  "(start us from the first kernel, duration us):", ""]
        lines += [f"    {g['start_us']:9.1f} {g['us']:8.1f}  x{g['n']:<4d} {g['name'][:80]}"
                  for g in kernels["timeline_runs"]]
    write_result(args.out, res, "\n".join(lines) + "\n")
    return 0


def _kernels(core, fs, n: int, gap_ms: float) -> list:  # noqa: ANN001
    """The CUDA kernel events of `n` frames of core.process under torch.profiler, by start."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        for _ in range(n):
            time.sleep(gap_ms * 1e-3)
            core.process(fs)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
    evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
    return sorted(evs, key=lambda e: e.time_range.start)


def profile_kernels(core, fs, n: int, gap_ms: float) -> dict:  # noqa: ANN001
    """Device time per kernel name per frame over `n` profiled frames (top), and one more
    frame's kernels in start order with consecutive same-name kernels merged (timeline_runs):
    a kernel's stage shows from its place in the sequence."""
    agg: dict[str, list[float]] = {}
    for e in _kernels(core, fs, n, gap_ms):
        a = agg.setdefault(e.name, [0, 0.0])
        a[0] += 1
        a[1] += e.time_range.elapsed_us()
    top = sorted(({"name": k, "calls": v[0] / n, "us": v[1] / n} for k, v in agg.items()),
                 key=lambda d: -d["us"])
    one = _kernels(core, fs, 1, gap_ms)
    runs: list[dict] = []
    t0 = one[0].time_range.start if one else 0
    for e in one:
        if runs and runs[-1]["name"] == e.name:
            runs[-1]["n"] += 1
            runs[-1]["us"] += e.time_range.elapsed_us()
        else:
            runs.append({"name": e.name, "n": 1, "start_us": e.time_range.start - t0,
                         "us": e.time_range.elapsed_us()})
    return {"frames": n, "top": top[:80], "timeline_runs": runs}


if __name__ == "__main__":
    raise SystemExit(main())
