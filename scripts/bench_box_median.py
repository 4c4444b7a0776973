#!/usr/bin/env python3
"""LiDAR box medians on the GPU: the Triton kernel's modes side by side (issue 4, lidar_fusion).

Modes of `kestrel_models.perception.box_median_triton.lidar_box_medians`, on the node's sizes
(6 cameras, a 131072-point bucket, `--dets` box slots per camera), each captured in a CUDA
graph as the node's region graph does and replayed `--iters` times after `--warmup`:
  prebin   the points binned into the boxes first (one pass over the points for all boxes),
           then one select program per box over its keys (the default since session 11);
  compact  one program per box scans all N points in pass 0 and compacts its inside keys;
  scan     one program per box scans all N points in each of the 4 radix passes.
Inputs: uniform projections over the image (`--valid` of them valid), depths 0.5-50 m, boxes
of 20-200 px at random places. Every mode's medians and counts are checked equal to the
first mode's. Latency per replay from CUDA events (device time), p50 / p99 / p99.9. JSON + a
table:

    python scripts/bench_box_median.py --out docs/benchmarks/box_median_h200
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "models"))
from kestrel_models.perception import box_median_triton as bmt  # noqa: E402
from bench_common import (cuda_graph_us, git_commit, machine_info, us_stats,  # noqa: E402
                          write_result)

MODES = {"prebin": {"prebin": True}, "compact": {"prebin": False, "compact": True},
         "scan": {"prebin": False, "compact": False}}


def inputs(c: int, d: int, n: int, hw: tuple[int, int], valid: float, seed: int):
    g = torch.Generator().manual_seed(seed)
    h, w = hw
    uv = torch.rand(c, n, 2, generator=g) * torch.tensor([w, h]) - 0.5
    z = 0.5 + 49.5 * torch.rand(c, n, generator=g)
    ok = torch.rand(c, n, generator=g) < valid
    xy = torch.rand(c, d, 2, generator=g) * torch.tensor([w - 20, h - 20])
    boxes = torch.cat([xy, xy + 20 + 180 * torch.rand(c, d, 2, generator=g)], 2)
    return [t.cuda() for t in (z, uv, ok, boxes)]


def time_mode(args, inp, kw: dict) -> tuple[dict, tuple[torch.Tensor, torch.Tensor]]:
    z, uv, ok, boxes = inp
    us, out, _ = cuda_graph_us(lambda: bmt.lidar_box_medians(z, uv, ok, boxes, **kw),
                               args.iters, args.warmup)
    return us_stats(us), (out[0].clone(), out[1].clone())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cams", type=int, default=6)
    ap.add_argument("--dets", type=int, nargs="+", default=[20, 100])
    ap.add_argument("--points", type=int, default=131072)
    ap.add_argument("--image-hw", type=int, nargs=2, default=[640, 640])
    ap.add_argument("--valid", type=float, default=0.3,
                    help="share of the projections inside the image (a 360 deg LiDAR: ~1/6)")
    ap.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and bmt.HAVE_TRITON):
        print("bench_box_median: needs a CUDA GPU and triton; skipped")
        return 0
    commit = git_commit(args.git_commit or "")
    rows = []
    for d in args.dets:
        inp = inputs(args.cams, d, args.points, tuple(args.image_hw), args.valid, seed=d)
        first = None
        for mode in args.modes:
            stats, out = time_mode(args, inp, MODES[mode])
            if first is None:
                first = out
            same = bool(torch.equal(out[1], first[1]) and torch.equal(
                torch.where(out[1] > 0, out[0], 0), torch.where(first[1] > 0, first[0], 0)))
            rows.append({"dets": d, "mode": mode, **stats, "equal_to_first": same,
                         "mean_count": float(out[1].float().mean())})
    machine = machine_info()
    cmd = "python scripts/bench_box_median.py " + " ".join(sys.argv[1:])
    lines = [f"# LiDAR box medians ({machine['gpu']})", "",
             f"`{cmd}`, git {commit}, torch {machine['torch']}; {args.cams} cameras x "
             f"{args.points} points ({args.valid:.0%} valid), CUDA-graph replays, "
             f"{args.iters} iterations after {args.warmup}.", "",
             "| box slots / camera | mode | p50 us | p99 us | p99.9 us | mean points / box | "
             "equal to first |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dets']} | {r['mode']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | "
                     f"{r['p999_us']:.1f} | {r['mean_count']:.0f} | {r['equal_to_first']} |")
    write_result(args.out, {"command": cmd, "commit": commit, "machine": machine,
                            "args": vars(args), "rows": rows}, "\n".join(lines) + "\n")
    return 0 if all(r["equal_to_first"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
