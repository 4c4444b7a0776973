#!/usr/bin/env python3
"""Benchmark of the perception forward: eager fp32 first, then each optimized variant, in ONE
run on the same inputs (cameras x batch uint8 images + a bucketed LiDAR cloud projected into
every camera; optionally the BEV fusion block). Latency p50/p99 with CUDA events (perf_counter
on CPU), throughput, peak GPU memory, accuracy drift against eager fp32, compile times, and a
torch.profiler top-kernel table of the target case. Writes JSON + a Markdown table.

  # H200, ResNet-50 (the reference architecture):
  python scripts/bench_perception.py --config r50 --out docs/benchmarks/perception_h200
  # the output-preserving transforms (optimize.py) against the previous best, target case only:
  python scripts/bench_perception.py --config r50 --cams 6 --batches --profile --variants \
      eager_fp32 compile_bf16w_fold_graph whole_bf16w_fold_s2d_group_graph
  # CPU smoke run (tiny config, small images, few iterations):
  python scripts/bench_perception.py --config tiny --device cpu --image-hw 128 128 \
      --points 20000 --batches 1 2 --iters 10 --out docs/benchmarks/perception_cpu
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# accuracy of a variant when eager fp32 (the reference) did not run or failed
NO_REFERENCE = {"seg_max_abs": None, "depth_max_abs": None, "det_agreement": None,
                "note": "no eager_fp32 reference in this case"}
sys.path.insert(0, str(ROOT / "models"))

import bench_common  # noqa: E402 (scripts/ is on sys.path: this file's folder)
from kestrel_models.perception import MultiTaskPerceptionModel, PerceptionConfig  # noqa: E402
from kestrel_models.perception.accuracy import compare_outputs  # noqa: E402
from kestrel_models.perception.flops import count_flops  # noqa: E402
from kestrel_models.perception.lidar import bucket_points  # noqa: E402
from kestrel_models.perception.runtime import VARIANTS, PerceptionRuntime  # noqa: E402
from kestrel_models.perception.model import load_weights  # noqa: E402


def make_config(name: str, bev: bool) -> PerceptionConfig:
    if name == "r50":
        return PerceptionConfig(backbone_depth=50, base_width=64, fpn_channels=256, bev=bev)
    return PerceptionConfig.tiny(bev=bev, bev_grid=32)


def camera_rig(cams: int, hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cams cameras around the base, yaw 360/cams apart, optical axis horizontal."""
    T = torch.zeros(cams, 4, 4)
    base_to_cam0 = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0]])
    for c in range(cams):
        a = 2 * math.pi * c / cams
        yaw = torch.tensor([[math.cos(a), math.sin(a), 0.0], [-math.sin(a), math.cos(a), 0.0],
                            [0.0, 0.0, 1.0]])  # base -> camera-yawed frame
        T[c, :3, :3] = base_to_cam0 @ yaw
        T[c, 3, 3] = 1.0
    K = torch.tensor([[hw[1] / 2, 0.0, hw[1] / 2], [0.0, hw[1] / 2, hw[0] / 2],
                      [0.0, 0.0, 1.0]]).repeat(cams, 1, 1)
    return T, K


def make_points(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, Nb, 3] m: n points on a noisy ring 2-30 m around the base, NaN-padded."""
    out = []
    for _ in range(batch):
        r = 2 + 28 * torch.rand(n, generator=gen)
        a = 2 * math.pi * torch.rand(n, generator=gen)
        z = -1.5 + 3 * torch.rand(n, generator=gen)
        pts = torch.stack([r * torch.cos(a), r * torch.sin(a), z], dim=1)
        out.append(bucket_points(pts)[0])
    return torch.stack(out)


def to_cpu(out: dict) -> dict:
    return {k: ([t.float().cpu() for t in v] if isinstance(v, list) else v.float().cpu())
            for k, v in out.items()}


def time_runtime(rt: PerceptionRuntime, images: torch.Tensor, points: torch.Tensor | None,
                 iters: int, warmup: int, gap_ms: float = 0.0) -> list[float]:
    """Per-iteration latencies in ms. gap_ms > 0: the GPU idles that long before each
    iteration (synchronize + sleep), as in the node between frames (90 ms at 10 Hz)."""
    for _ in range(warmup):
        rt.run(images, points)
    if rt.device.type == "cuda":
        torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(iters)]
        for s, e in ev:
            if gap_ms > 0:
                torch.cuda.synchronize()
                time.sleep(gap_ms * 1e-3)
            s.record()
            rt.run(images, points)
            e.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in ev]
    lat = []
    for _ in range(iters):
        t0 = time.perf_counter()
        rt.run(images, points)
        lat.append((time.perf_counter() - t0) * 1e3)
    return lat


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


def profile_top(rt: PerceptionRuntime, images: torch.Tensor, points: torch.Tensor | None,
                top: int = 15) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if rt.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(5):
            rt.run(images, points)
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
    key = "self_device_time_total" if rt.device.type == "cuda" else "self_cpu_time_total"
    rows = []
    events = prof.key_averages()
    for evt in sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]:
        rows.append({"name": evt.key[:120], "calls": evt.count,
                     "self_us_per_iter": getattr(evt, key) / 5})
    if rt.device.type == "cuda":  # per-forward totals over every kernel (not only the top)
        from torch.autograd import DeviceType
        kern = [e for e in events if e.device_type == DeviceType.CUDA]

        def tot(pred) -> dict:  # noqa: ANN001
            sel = [e for e in kern if pred(e.key)]
            return {"kernels": sum(e.count for e in sel) / 5,
                    "us": sum(e.self_device_time_total for e in sel) / 5}
        rows.append({"name": "TOTAL (all kernels)", "summary": tot(lambda k: True)})
        for label, pat in (("padding", "Padding"), ("memset", "emset"),
                           ("group_norm", "group_norm"), ("triton", "triton_")):
            rows.append({"name": f"TOTAL {label}",
                         "summary": tot(lambda k, p=pat: p in k)})
    return rows


def run_case(args: argparse.Namespace, cams: int, batch: int, bev: bool, variants: list[str],
             t_start: float, device: torch.device, budget_s: float | None = None,
             checkpoint: Callable[[dict], None] | None = None) -> dict:
    """One (cameras, batch, BEV) case: every variant on the same inputs, eager fp32 first.
    Compiled variants are skipped once `budget_s` (default --budget-s) of wall time is spent.
    `checkpoint(case)` runs after each variant (writes the partial JSON: a max-autotune
    compile can outlast the caller's time limit, the rows before it must survive)."""
    budget_s = args.budget_s if budget_s is None else budget_s
    hw = tuple(args.image_hw)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    cfg = make_config(args.config, bev)
    model = MultiTaskPerceptionModel(cfg).eval()
    if args.weights and not bev:  # trained weights: the drift columns then mean something
        load_weights(model, args.weights)
    images = torch.randint(0, 256, (cams * batch, 3, *hw), dtype=torch.uint8, generator=gen)
    points = make_points(batch, args.points, gen) if args.points else None
    T, K = camera_rig(cams, hw)
    n_pts = 0 if points is None else points.shape[1]
    case = {"cameras": cams, "batch": batch, "bev": bev, "image_hw": list(hw),
            "lidar_points": args.points, "lidar_bucket": n_pts, "variants": []}
    flops = count_flops(cfg, cams * batch, hw, n_pts)
    case["flops"] = flops.as_dict()
    h2d = images.pin_memory() if device.type == "cuda" else images
    images_d = images.to(device)
    points_d = None if points is None else points.to(device)
    if device.type == "cuda":  # host -> device copy of the uint8 images (pinned), for reference
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            images_d.copy_(h2d, non_blocking=True)
        e.record()
        torch.cuda.synchronize()
        case["h2d_images_ms"] = s.elapsed_time(e) / 10
    ref = None
    base = None
    for name in variants:
        row: dict = {"variant": name}
        spec = VARIANTS[name]
        compiled = spec.compiled
        if compiled and time.perf_counter() - t_start > budget_s:
            row["skipped"] = f"time budget {budget_s:.0f} s spent before this variant"
            case["variants"].append(row)
            print(f"  {name:24s} skipped (budget)", flush=True)
            if checkpoint is not None:
                checkpoint(case)
            continue
        if spec.cuda_graph and device.type != "cuda":
            continue
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        try:
            rt = PerceptionRuntime(model, name, hw, cams, batch, device=device,
                                   lidar_points=n_pts)
            if points is not None:
                rt.set_geometry(T.to(device), K.to(device))
            out = to_cpu(rt.run(images_d, points_d))
            lat = time_runtime(rt, images_d, points_d, args.iters, args.warmup, args.gap_ms)
        except Exception as exc:  # a failing variant is recorded, the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            case["variants"].append(row)
            print(f"  {name:24s} ERROR {row['error']}", flush=True)
            if checkpoint is not None:
                checkpoint(case)
            continue
        if name == "eager_fp32":  # the reference; no other variant may stand in for it
            ref = out
        acc = None if ref is None else compare_outputs(ref, out, hw,
                                                       class_offset=cfg.det_class_offset)
        p50 = pct(lat, 50)
        row.update(prepare_s=round(rt.prepare_s, 2), compile_s=round(rt.compile_s, 2),
                   p50_ms=p50, p99_ms=pct(lat, 99), p999_ms=pct(lat, 99.9),
                   mean_ms=sum(lat) / len(lat), tflops=flops.total_gflop / p50,
                   images_per_s=cams * batch * 1e3 / p50,
                   accuracy=dict(NO_REFERENCE) if acc is None else acc.as_dict())
        if name == "eager_fp32":
            base = p50
        row["speedup_vs_eager_fp32"] = base / p50 if base else None
        if device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
        if args.profile and cams == args.cams[-1] and batch == 1 and not bev and \
                args.profile_variant in ("all", name):
            row["profile_top"] = profile_top(rt, images_d, points_d)
        case["variants"].append(row)
        if getattr(rt, "optimized", None):
            row["optimized"] = rt.optimized
        print(f"  {name:24s} p50 {p50:8.3f} ms  p99 {row['p99_ms']:8.3f} ms  "
              f"x{row['speedup_vs_eager_fp32'] or 0:.2f}  compile {rt.compile_s:6.1f} s  "
              f"seg {row['accuracy']['seg_max_abs']}  det {row['accuracy']['det_agreement']}",
              flush=True)
        del rt
        if checkpoint is not None:
            checkpoint(case)
    return case


def markdown(result: dict) -> str:
    lines = [f"# Perception forward benchmark ({result['machine']['device']})", "",
             f"Command: `{result['command']}`  ", f"git {result['git_commit']}, torch "
             f"{result['torch']}, config {result['config']}, {result['iters']} iterations", "",
             "| cams | batch | BEV | variant | p50 ms | p99 ms | img/s | TFLOP/s | "
             "x eager fp32 | peak GiB | compile s | seg max abs | depth max abs | det agree |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        for r in case["variants"]:
            head = f"| {case['cameras']} | {case['batch']} | {case['bev']} | {r['variant']} |"
            if "p50_ms" not in r:
                lines.append(head + f" {r.get('skipped') or r.get('error')} |" + " |" * 10)
                continue
            a = r["accuracy"]

            def f(x: float | None, fmt: str = "{:.3g}") -> str:
                return "-" if x is None else fmt.format(x)
            lines.append(head + f" {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | "
                         f"{r['images_per_s']:.0f} | {f(r.get('tflops'), '{:.3g}')} | "
                         f"{f(r['speedup_vs_eager_fp32'], '{:.2f}')} | "
                         f"{f(r.get('peak_mem_gib'), '{:.2f}')} | {r['compile_s']:.1f} | "
                         f"{f(a['seg_max_abs'])} | {f(a['depth_max_abs'])} | "
                         f"{f(a['det_agreement'], '{:.3f}')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=("tiny", "r50"), default="tiny")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--image-hw", type=int, nargs=2, default=(640, 640))
    ap.add_argument("--cams", type=int, nargs="+", default=(1, 6),
                    help="camera counts; the last one is the target case (batch 1)")
    ap.add_argument("--batches", type=int, nargs="*", default=(1, 2, 4, 8),
                    help="batches swept with 1 camera (none: only the target case)")
    ap.add_argument("--points", type=int, default=120_000, help="LiDAR points (0 = none)")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="variants of the target case (eager_fp32 always first)")
    ap.add_argument("--sweep-variants", nargs="+", default=None,
                    help="variants of the other cases; 'best' = the fastest compiled variant "
                         "of the target case (default: eager and compile_bf16w_graph)")
    ap.add_argument("--target-budget-s", type=float, default=None,
                    help="skip the target case's compiled variants after this wall time "
                         "(default --budget-s), leaving time for the other cases")
    ap.add_argument("--bev", action="store_true", help="also the target case with BEV fusion")
    ap.add_argument("--weights", default="",
                    help="state dict of the --config architecture (default: seeded random "
                         "weights, whose near-tied scores make the detection agreement "
                         "pessimistic); not used by the BEV case")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="GPU idle time before each timed iteration (the node's frame gap)")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=1e9,
                    help="skip compiled variants once this much wall time is spent")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-variant", default="all",
                    help="variant profiled in the target case ('all': each one, ~1 s each)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0 = default)")
    ap.add_argument("--allow-tf32", action="store_true",
                    help="let fp32 convs/matmuls use TF32 (default: strict fp32 reference)")
    ap.add_argument("--git-commit", default=None,
                    help="commit to record where the tree has no .git (e.g. the GPU machine)")
    ap.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if gpu:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32  # default: strict fp32
        torch.backends.cudnn.allow_tf32 = args.allow_tf32
    target = args.variants or (["eager_fp32", "eager_bf16_cl", "compile_bf16",
                                "compile_bf16_graph", "compile_bf16w_graph"] if gpu else
                               ["eager_fp32", "eager_fp32_cl", "eager_bf16_cl"])
    sweep = args.sweep_variants or (["eager_fp32", "eager_bf16_cl", "compile_bf16w_graph"]
                                    if gpu else ["eager_fp32", "eager_fp32_cl"])
    for v in target + sweep:
        if v not in VARIANTS and v != "best":
            ap.error(f"unknown variant {v!r}; known: {sorted(VARIANTS)}")
    target = ["eager_fp32"] + [v for v in target if v != "eager_fp32"]
    sweep = ["eager_fp32"] + [v for v in sweep if v != "eager_fp32"]
    cases = [(args.cams[-1], 1, False, target)]
    if args.bev:
        cases.append((args.cams[-1], 1, True, target if not gpu else
                      ["eager_fp32", "eager_bf16_cl", "compile_bf16w_graph"]))
    cases += [(args.cams[0], b, False, sweep) for b in args.batches]
    commit = bench_common.git_commit(args.git_commit)
    result = {"command": "python " + " ".join(sys.argv), "git_commit": commit,
              "allow_tf32": bool(args.allow_tf32),
              "torch": torch.__version__, "config": args.config,
              "weights": args.weights or None, "iters": args.iters,
              "gap_ms": args.gap_ms,
              "machine": bench_common.machine_info(
                  torch.cuda.get_device_name(device) if gpu else None, cpu=platform.processor(),
                  device=torch.cuda.get_device_name(device) if gpu else "cpu"),
              "note": "working tree may have uncommitted changes on top of git_commit",
              "cases": []}
    t0 = time.perf_counter()
    for i, (cams, batch, bev, variants) in enumerate(cases):
        print(f"case: {cams} camera(s) x batch {batch}, BEV {bev}, {args.points} points",
              flush=True)
        if "best" in variants:  # the fastest compiled variant of the target case
            rows = [r for r in result["cases"][0]["variants"]
                    if "p50_ms" in r and VARIANTS[r["variant"]].compiled]
            best = min(rows, key=lambda r: r["p50_ms"])["variant"] if rows else None
            result["sweep_best"] = best
            variants = [v for v in variants if v != "best"] + ([best] if best else [])
            variants = list(dict.fromkeys(variants))
        budget = args.target_budget_s if i == 0 and args.target_budget_s else None

        def checkpoint(case: dict) -> None:
            if args.out:
                partial = dict(result, cases=[*result["cases"], case], partial=True)
                tmp = Path(args.out + ".json.tmp")
                tmp.write_text(json.dumps(partial, indent=1))
                tmp.replace(args.out + ".json")  # atomic: a kill never leaves half a file
        result["cases"].append(run_case(args, cams, batch, bev, variants, t0, device, budget,
                                        checkpoint))
    result["total_s"] = time.perf_counter() - t0
    bench_common.write_result(args.out, result, markdown(result))


if __name__ == "__main__":
    main()
