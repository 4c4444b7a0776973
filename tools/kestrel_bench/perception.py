"""`kestrel_bench perception`: the perception forward, eager fp32 first, then each variant,
in ONE run on the same inputs (cameras x batch uint8 images + a bucketed LiDAR cloud projected
into every camera; optionally the BEV fusion block).

Per variant and case: latency percentiles (CUDA events on a GPU, perf_counter on a CPU),
throughput (img/s), peak memory, accuracy drift against eager fp32 (seg / depth max abs,
detection agreement), compile time, TFLOP/s from the model's FLOP count, power and energy per
inference (NVML). Cases: the target case (the last --cams, batch 1), the BEV case (--bev), and
the throughput-vs-batch sweep (the first --cams, each --batches).

Variants are names of `kestrel_models.perception.runtime.VARIANTS` (the experiment-only
combinations live there) or `auto`: what the node's `auto` options resolve to on the device
(options.resolve_options). Roles: eager_fp32 = baseline, --optimized (default auto) =
optimized. ratios: optimized_vs_baseline_p50 / _p99 (target case), and per sweep batch
optimized_vs_baseline_img_s_b<N>.
--compile-modes: the compile-mode comparison, torch.compile's default / reduce-overhead /
max-autotune per submodule group (trunk = backbone + FPN, heads) on the same transforms, and
the one-region form with max-autotune, against eager fp32 and auto.
--quick: tiny model, 2 cameras 64x96, no LiDAR, eager fp32 vs auto, 10 iterations (CPU, s).

  python -m kestrel_bench perception --quick
  python -m kestrel_bench perception --config r50 --bev          # GPU: 6 cameras 640x640
  python -m kestrel_bench perception --config r50 --compile-modes --batches
"""

from __future__ import annotations

import argparse
import math
import time

from kestrel_bench import memory, stats
from kestrel_bench import record as rec_mod
from kestrel_bench.repo import ensure_paths

COMPILE_MODE_VARIANTS = (  # trunk / heads modes on the s2d_group_cudnn transforms
    "compile_bf16w_fold_s2d_group_cudnn_graph",      # default / default + our CUDA graph
    "compile_bf16w_fold_s2d_group_cudnn_ro",         # reduce-overhead / reduce-overhead
    "compile_bf16w_fold_s2d_group_cudnn_graph_at",   # default / max-autotune
    "compile_bf16w_fold_s2d_group_cudnn_graph_tat",  # max-autotune / default
    "whole_bf16w_fold_s2d_group_cudnn_at_graph")     # one region, max-autotune
CPU_FALLBACK = "eager_fp32_cl"  # the plain model in channels_last: the node's CPU path


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, 2 small cameras, eager fp32 vs auto, 10 iterations")
    ap.add_argument("--config", choices=("tiny", "r50"), default="tiny")
    ap.add_argument("--device", default="", help="cpu | cuda (default: cuda where available)")
    ap.add_argument("--image-hw", type=int, nargs=2, default=(640, 640), metavar=("H", "W"))
    ap.add_argument("--cams", type=int, nargs="+", default=(1, 6),
                    help="camera counts; the last is the target case (batch 1), the first the "
                         "batch sweep's")
    ap.add_argument("--batches", type=int, nargs="*", default=(1, 2, 4, 8),
                    help="batch sizes of the throughput sweep (none: target case only)")
    ap.add_argument("--points", type=int, default=120_000, help="LiDAR points (0 = none)")
    ap.add_argument("--variants", nargs="+", default=None,
                    help="variants of the target case (default: eager_fp32 and auto, + "
                         "eager_bf16_cl on a GPU); 'auto' = the node's auto options")
    ap.add_argument("--optimized", default="auto", help="the variant in the 'optimized' role")
    ap.add_argument("--sweep-variants", nargs="+", default=None,
                    help="variants of the batch sweep (default: eager_fp32 and --optimized)")
    ap.add_argument("--compile-modes", action="store_true",
                    help="the compile-mode comparison as the target case's variants")
    ap.add_argument("--bev", action="store_true", help="also the target case with BEV fusion")
    ap.add_argument("--weights", default="",
                    help="state dict of the --config architecture (drift on trained weights; "
                         "default seeded random weights)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="device idle time before each timed iteration (a node's frame gap)")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="skip compiled variants once this much wall time is spent (0: none)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    ap.add_argument("--allow-tf32", action="store_true",
                    help="let fp32 convs/matmuls use TF32 (default: strict fp32 reference)")
    rec_mod.add_common_arguments(ap)


def make_config(name: str, bev: bool):  # noqa: ANN201
    from kestrel_models.perception import PerceptionConfig

    if name == "r50":
        return PerceptionConfig(backbone_depth=50, base_width=64, fpn_channels=256, bev=bev)
    return PerceptionConfig.tiny(bev=bev, bev_grid=32)


def camera_rig(cams: int, hw: tuple[int, int]):  # noqa: ANN201
    """cams cameras around the base, yaw 360/cams apart, optical axis horizontal: T [cams,4,4]
    (camera from base), K [cams,3,3]."""
    import torch

    T = torch.zeros(cams, 4, 4)
    base_to_cam0 = torch.tensor([[0.0, -1.0, 0.0], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0]])
    for c in range(cams):
        a = 2 * math.pi * c / cams
        yaw = torch.tensor([[math.cos(a), math.sin(a), 0.0], [-math.sin(a), math.cos(a), 0.0],
                            [0.0, 0.0, 1.0]])
        T[c, :3, :3] = base_to_cam0 @ yaw
        T[c, 3, 3] = 1.0
    K = torch.tensor([[hw[1] / 2, 0.0, hw[1] / 2], [0.0, hw[1] / 2, hw[0] / 2],
                      [0.0, 0.0, 1.0]]).repeat(cams, 1, 1)
    return T, K


def make_points(batch: int, n: int, gen):  # noqa: ANN001, ANN201
    """[batch, Nb, 3] m: n points on a noisy ring 2-30 m around the base, NaN-padded."""
    import torch
    from kestrel_models.perception.lidar import bucket_points

    out = []
    for _ in range(batch):
        r = 2 + 28 * torch.rand(n, generator=gen)
        a = 2 * math.pi * torch.rand(n, generator=gen)
        z = -1.5 + 3 * torch.rand(n, generator=gen)
        out.append(bucket_points(torch.stack([r * torch.cos(a), r * torch.sin(a), z], 1))[0])
    return torch.stack(out)


def resolve_variant(name: str, device: str):  # noqa: ANN201 (str | VariantSpec)
    """A VARIANTS name as is; 'auto' -> the spec the node's auto options pick on `device`."""
    if name != "auto":
        return name
    try:
        from kestrel_models.perception.options import resolve_options
    except ImportError:
        return "branch_bf16w_fold_s2d4_group_cudnn_stem_graph" if device == "cuda" \
            else CPU_FALLBACK
    spec = resolve_options(device).spec
    return spec if spec is not None else CPU_FALLBACK


def _to_cpu(out: dict) -> dict:
    return {k: ([t.float().cpu() for t in v] if isinstance(v, list) else v.float().cpu())
            for k, v in out.items()}


def run_case(args: argparse.Namespace, record: rec_mod.Record, cams: int, batch: int,
             bev: bool, variants: list[str], device, t_start: float) -> None:  # noqa: ANN001
    """One (cameras, batch, BEV) case: every variant on the same inputs, eager fp32 first."""
    import torch
    from kestrel_models.perception import MultiTaskPerceptionModel
    from kestrel_models.perception.accuracy import compare_outputs
    from kestrel_models.perception.flops import count_flops
    from kestrel_models.perception.model import load_weights
    from kestrel_models.perception.runtime import VARIANTS, PerceptionRuntime

    from kestrel_bench.power import PowerMeter
    from kestrel_bench.timing import device_times_ms

    cuda = device.type == "cuda"
    hw = tuple(args.image_hw)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    cfg = make_config(args.config, bev)
    model = MultiTaskPerceptionModel(cfg).eval()
    if args.weights and not bev:
        load_weights(model, args.weights)
    images = torch.randint(0, 256, (cams * batch, 3, *hw), dtype=torch.uint8, generator=gen)
    points = make_points(batch, args.points, gen) if args.points else None
    T, K = camera_rig(cams, hw)
    n_pts = 0 if points is None else points.shape[1]
    flops = count_flops(cfg, cams * batch, hw, n_pts)
    images_d = images.to(device)
    points_d = None if points is None else points.to(device)
    case = {"cameras": cams, "batch": batch, "bev": bev, "lidar_bucket": n_pts}
    label = f"cams{cams}_b{batch}" + ("_bev" if bev else "")
    ref = None
    for name in variants:
        spec_or_name = resolve_variant(name, device.type)
        spec = VARIANTS[spec_or_name] if isinstance(spec_or_name, str) else spec_or_name
        row_name = f"{name}@{label}"
        role = ("baseline" if name == "eager_fp32" else "optimized" if name == args.optimized
                else "variant")
        resolved = spec_or_name if isinstance(spec_or_name, str) else "auto options"
        cfg_row = {**case, "variant": name, "resolved": resolved}
        if spec.compiled and args.budget_s and time.perf_counter() - t_start > args.budget_s:
            record.add(row_name, role, config=cfg_row,
                       skipped=f"time budget {args.budget_s:.0f} s spent")
            continue
        if spec.cuda_graph and not cuda:
            record.add(row_name, role, config=cfg_row, skipped="CUDA graphs need a GPU")
            continue
        memory.reset_peak(cuda)
        try:
            rt = PerceptionRuntime(model, spec_or_name, hw, cams, batch, device=device,
                                   lidar_points=n_pts)
            if points is not None:
                rt.set_geometry(T.to(device), K.to(device))
            out = _to_cpu(rt.run(images_d, points_d))
            meter = PowerMeter() if cuda else None
            if meter:
                meter.start()
            lat = device_times_ms(lambda rt=rt: rt.run(images_d, points_d), args.iters,
                                  args.warmup, cuda, args.gap_ms)
            if meter:
                meter.stop()
        except Exception as exc:  # noqa: BLE001 (a failing variant is a row; the others run)
            record.add(row_name, role, config=cfg_row,
                       error=f"{type(exc).__name__}: {str(exc)[:300]}")
            print(f"  {row_name:40s} ERROR {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            continue
        if name == "eager_fp32":
            ref = out
        drift = None
        if ref is not None and name != "eager_fp32":
            acc = compare_outputs(ref, out, hw, class_offset=cfg.det_class_offset).as_dict()
            vals = [v for v in (acc.get("seg_max_abs"), acc.get("depth_max_abs")) if v is not None]
            drift = {"max_abs": max(vals) if vals else None, "reference": "fp32 (eager_fp32)",
                     **{k: acc.get(k) for k in ("seg_max_abs", "depth_max_abs",
                                                "det_agreement")}}
        s = stats.summary(lat)
        record.add(row_name, role, config=cfg_row, latency_ms=s,
                   throughput=cams * batch * 1e3 / s["p50"], unit="img/s",
                   peak_memory_mb=memory.peak_mb(cuda), drift=drift,
                   power=meter.result(args.iters, "inference") if meter else
                   {"skipped": "runs on the CPU"},
                   metrics={"tflops": flops.total_gflop / s["p50"],  # GFLOP / ms
                            "compile_s": round(rt.compile_s, 2),
                            "prepare_s": round(rt.prepare_s, 2)})
        print(f"  {row_name:40s} p50 {s['p50']:8.3f} ms  p99 {s['p99']:8.3f} ms  compile "
              f"{rt.compile_s:6.1f} s  drift {drift and drift['max_abs']}", flush=True)
        del rt


def run(args: argparse.Namespace) -> int:
    ensure_paths("kestrel_models")
    import torch

    if args.quick:
        args.config, args.image_hw, args.cams, args.points = "tiny", (64, 96), (2,), 0
        args.batches, args.iters, args.warmup = (), min(args.iters, 10), 2
        args.device = args.device or "cpu"
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
        torch.backends.cudnn.allow_tf32 = args.allow_tf32
    from kestrel_models.perception.runtime import VARIANTS

    target = list(args.variants or (["eager_fp32", "eager_bf16_cl", args.optimized] if cuda
                                    else ["eager_fp32", args.optimized]))
    if args.compile_modes:
        target += list(COMPILE_MODE_VARIANTS)
    sweep = list(args.sweep_variants or ["eager_fp32", args.optimized])
    for v in target + sweep:
        if v not in VARIANTS and v != "auto":
            raise SystemExit(f"variant {v!r}: must be 'auto' or one of {sorted(VARIANTS)}")
    target = list(dict.fromkeys(["eager_fp32"] + target))
    sweep = list(dict.fromkeys(["eager_fp32"] + sweep))
    config = {"quick": args.quick, "model": args.config, "device": device.type,
              "image_hw": list(args.image_hw), "cams": list(args.cams),
              "batches": list(args.batches), "points": args.points, "bev": args.bev,
              "variants": target, "sweep_variants": sweep, "optimized": args.optimized,
              "compile_modes": args.compile_modes, "weights": args.weights or None,
              "iters": args.iters, "warmup": args.warmup, "gap_ms": args.gap_ms,
              "allow_tf32": args.allow_tf32, "threads": torch.get_num_threads()}
    record = rec_mod.Record("perception", config, getattr(args, "argv", None), args.commit)
    t0 = time.perf_counter()
    cams = args.cams[-1]
    print(f"case: {cams} camera(s) x batch 1, {args.points} points", flush=True)
    run_case(args, record, cams, 1, False, target, device, t0)
    if args.bev:
        run_case(args, record, cams, 1, True, ["eager_fp32", args.optimized], device, t0)
    for b in args.batches:
        print(f"sweep: {args.cams[0]} camera(s) x batch {b}", flush=True)
        run_case(args, record, args.cams[0], b, False, sweep, device, t0)
    _ratios(record, args, cams)
    rec_mod.finish(record, args)
    return 0


def _ratios(record: rec_mod.Record, args: argparse.Namespace, cams: int) -> None:
    def lat(name: str) -> dict | None:
        r = record.result(name)
        return r.get("latency_ms") if r else None

    b, o = lat(f"eager_fp32@cams{cams}_b1"), lat(f"{args.optimized}@cams{cams}_b1")
    if b and o:
        for q in ("p50", "p99"):
            record.ratio(f"optimized_vs_baseline_{q}", stats.ratio(b[q], o[q]))
    for bs in args.batches:
        rb = record.result(f"eager_fp32@cams{args.cams[0]}_b{bs}")
        ro = record.result(f"{args.optimized}@cams{args.cams[0]}_b{bs}")
        if rb and ro and "throughput" in rb and "throughput" in ro:
            record.ratio(f"optimized_vs_baseline_img_s_b{bs}",
                         ro["throughput"]["value"] / rb["throughput"]["value"])
