#!/usr/bin/env python3
"""LiDAR/depth fusion benchmark: `box_positions_batched(static=True)` with the torch medians vs
the Triton kernel (models/kestrel_models/perception/box_median_triton.py), in one run.

Node sizes by default: 6 cameras x 20 detection slots (all valid), a 131072-point bucket
(120000 points around the vehicle + NaN padding, projected with a 6-camera ring), 640x640
predicted depth. Scenarios: `typical` (most boxes get >= 5 LiDAR points), `no_lidar` (no valid
projection: all 120 boxes take the depth-map median over their rectangle), `worst` (no LiDAR
and every box is the whole image: the kernel reads every pixel 4x per box). Each path is timed
eager and replayed as a CUDA graph (how the node runs it), CUDA events around each call,
warm-up first; p50/p99/p99.9 ms. Outputs of the two paths are compared exactly per scenario.

  python scripts/bench_perception_fusion.py --out $OUT/perception_fusion_h200 --git-commit X
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "models"))

import bench_common  # noqa: E402 (scripts/ is on sys.path: this file's folder)
from kestrel_models.perception import box_median_triton as bmt  # noqa: E402
from kestrel_models.perception import lidar  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def camera_ring(c: int, hw: tuple[int, int], dev: torch.device):
    """c cameras at the origin, yaw i * 360/c deg, optical frame (x right, y down, z fwd)."""
    h, w = hw
    K = torch.tensor([[400.0, 0, (w - 1) / 2], [0, 400.0, (h - 1) / 2], [0, 0, 1]])
    T = torch.zeros(c, 4, 4)
    for i in range(c):
        a = 2 * math.pi * i / c
        T[i, :3, :3] = torch.tensor([[math.sin(a), -math.cos(a), 0.0], [0.0, 0.0, -1.0],
                                     [math.cos(a), math.sin(a), 0.0]])
        T[i, 3, 3] = 1
    return K.expand(c, 3, 3).to(dev), T.to(dev)


def make_inputs(scenario: str, a: argparse.Namespace, dev: torch.device) -> tuple:
    g = torch.Generator().manual_seed(0)
    hw = (a.size, a.size)
    K, T = camera_ring(a.cams, hw, dev)
    r = 1 + 49 * torch.rand(a.points, generator=g)
    ang = 2 * math.pi * torch.rand(a.points, generator=g)
    pts = torch.stack([r * ang.cos(), r * ang.sin(), -1 + 4 * torch.rand(a.points,
                                                                          generator=g)], 1)
    pts, _, _ = lidar.bucket_points(pts.to(dev), (a.bucket,))
    uv, z, ok = lidar.project_points(pts, T, K, hw)
    if scenario != "typical":
        ok = torch.zeros_like(ok)
    xy = torch.rand(a.cams, a.slots, 2, generator=g) * (a.size - 20)
    wh = 20 + torch.rand(a.cams, a.slots, 2, generator=g) * 180
    boxes = torch.cat([xy, (xy + wh).clamp(max=a.size)], 2).to(dev)
    if scenario == "worst":
        boxes = torch.tensor([0.0, 0.0, a.size, a.size], device=dev).expand_as(boxes).clone()
    dmap = (0.5 + 50 * torch.rand(a.cams, a.size, a.size, generator=g)).to(dev)
    bvalid = torch.ones(a.cams, a.slots, dtype=torch.bool, device=dev)
    return boxes, bvalid, uv, z, ok, dmap, torch.linalg.inv(K), torch.linalg.inv(T)


def run_path(inp: tuple, use_triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
    lidar.USE_TRITON = use_triton
    try:
        return lidar.box_positions_batched(*inp, min_points=5)
    finally:
        lidar.USE_TRITON = True


def time_it(fn, iters: int, warmup: int) -> list[float]:  # noqa: ANN001
    ts = []
    for i in range(warmup + iters):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        if i >= warmup:
            ts.append(e0.elapsed_time(e1))
    return ts


def graphed(inp: tuple, use_triton: bool):  # noqa: ANN201
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            run_path(inp, use_triton)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run_path(inp, use_triton)
    return g.replay, out


LIDAR_CFGS = [(True, 1024, 4), (True, 2048, 8), (True, 4096, 8), (True, 8192, 16),
              (False, 2048, 8)]  # (compact, block, num_warps), points scanned per box
# (scripts/bench_box_median.py compares these with the default: points binned first)
RECT_CFGS = [(1024, 4), (2048, 8), (4096, 8), (4096, 16)]


def sweep(a: argparse.Namespace, dev: torch.device) -> list[dict]:
    """Kernel alone (eager launches, CUDA events), per launch configuration: p50 ms."""
    rows = []
    typ, nol, worst = (make_inputs(s, a, dev) for s in ("typical", "no_lidar", "worst"))
    boxes, bvalid, uv, z, ok = typ[:5]
    jobs = [(f"lidar typical compact={c} block={b} warps={w}",
             lambda c=c, b=b, w=w: bmt.lidar_box_medians(z, uv, ok, boxes, bvalid, c, b, w,
                                                         prebin=False))
            for c, b, w in LIDAR_CFGS]
    for name, inp in (("no_lidar", nol), ("worst", worst)):
        rect = bmt.pixel_rects(inp[0], a.size, a.size)
        jobs += [(f"depth {name} block={b} warps={w}",
                  lambda rect=rect, inp=inp, b=b, w=w: bmt.depth_box_medians(
                      inp[5], rect, inp[1], b, w)) for b, w in RECT_CFGS]
    for name, fn in jobs:
        try:
            ts = time_it(fn, a.sweep_iters, 10)
            rows.append(dict(kernel=name, p50_ms=pct(ts, 50), p99_ms=pct(ts, 99)))
        except Exception:  # noqa: BLE001 - recorded
            rows.append(dict(kernel=name, error=traceback.format_exc()[-600:]))
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cams", type=int, default=6)
    ap.add_argument("--slots", type=int, default=20)
    ap.add_argument("--points", type=int, default=120000)
    ap.add_argument("--bucket", type=int, default=131072)
    ap.add_argument("--size", type=int, default=640, help="image / depth map side, px")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--scenarios", default="typical,no_lidar,worst")
    ap.add_argument("--sweep-iters", type=int, default=200, help="0: no launch-config sweep")
    ap.add_argument("--git-commit", default="")
    ap.add_argument("--out", default="perception_fusion")
    a = ap.parse_args()
    dev = torch.device("cuda")
    res: dict = dict(command=" ".join(sys.argv), commit=bench_common.git_commit(a.git_commit),
                     machine=bench_common.machine_info(torch.cuda.get_device_name()),
                     triton=bmt.triton.__version__ if bmt.HAVE_TRITON else None,
                     sizes=dict(cams=a.cams, slots=a.slots, points=a.points, bucket=a.bucket,
                                depth_hw=[a.size, a.size]),
                     iters=a.iters, warmup=a.warmup, kernel=dict(
                         block_lidar=bmt.BLOCK_LIDAR, block_rect=bmt.BLOCK_RECT,
                         num_warps=bmt.NUM_WARPS), rows=[], checks={})
    for sc in a.scenarios.split(","):
        inp = make_inputs(sc, a, dev)
        ref = run_path(inp, False)
        src = ref[1]
        info = dict(lidar=int((src == 1).sum()), depth=int((src == 2).sum()),
                    none=int((src == 0).sum()), valid_projections=int(inp[4].sum()))
        try:
            got = run_path(inp, True)
            same = bool(torch.equal(got[1], ref[1]) and torch.equal(
                got[0].nan_to_num(-7.0), ref[0].nan_to_num(-7.0)))
        except Exception:  # noqa: BLE001 - recorded
            same = "error: " + traceback.format_exc()[-600:]
        res["checks"][sc] = dict(triton_equals_torch=same, sources=info)
        print(f"[{sc}] sources {info}; triton == torch: {same}", flush=True)
        for path, use in (("torch", False), ("triton", True)):
            for mode in ("eager", "graph"):
                try:
                    fn = (lambda inp=inp, use=use: run_path(inp, use)) if mode == "eager" \
                        else graphed(inp, use)[0]
                    ts = time_it(fn, a.iters, a.warmup)
                    row = dict(scenario=sc, path=path, mode=mode, p50_ms=pct(ts, 50),
                               p99_ms=pct(ts, 99), p999_ms=pct(ts, 99.9), mean_ms=sum(ts) / len(ts))
                except Exception:  # noqa: BLE001 - recorded
                    row = dict(scenario=sc, path=path, mode=mode,
                               error=traceback.format_exc()[-600:])
                res["rows"].append(row)
                print(row, flush=True)
    if a.sweep_iters > 0:
        res["sweep"] = sweep(a, dev)
    lines = [f"commit {res['commit']}, {res['machine'].get('gpu')}, torch {res['machine']['torch']}"
             f", triton {res['triton']}, {a.iters} iterations after {a.warmup} warm-up",
             "", "| scenario | path | mode | p50 ms | p99 ms | p99.9 ms | speedup p50 vs torch |",
             "|---|---|---|---|---|---|---|"]
    base = {(r["scenario"], r["mode"]): r.get("p50_ms") for r in res["rows"]
            if r["path"] == "torch"}
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['scenario']} | {r['path']} | {r['mode']} | error | | | |")
            continue
        b = base.get((r["scenario"], r["mode"]))
        sp = f"{b / r['p50_ms']:.1f}x" if b else ""
        lines.append(f"| {r['scenario']} | {r['path']} | {r['mode']} | {r['p50_ms']:.3f} | "
                     f"{r['p99_ms']:.3f} | {r['p999_ms']:.3f} | {sp} |")
    if res.get("sweep"):
        lines += ["", "Kernel alone, per launch configuration (eager launches, "
                  f"{a.sweep_iters} iterations):", "", "| kernel | p50 ms | p99 ms |",
                  "|---|---|---|"]
        lines += [f"| {r['kernel']} | " + (f"{r['p50_ms']:.4f} | {r['p99_ms']:.4f} |"
                                           if "error" not in r else "error | |")
                  for r in res["sweep"]]
    table = "\n".join(lines)
    print(table)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
