#!/usr/bin/env python3
"""Would 8-bit convolutions close the perception forward's gap? cuDNN FP8 / INT8 vs bf16 (H200).

The perception forward (ResNet-50 + FPN + FCOS/seg/depth, 6 x 640x640) is 3.56-3.6 ms against
the issue's 2.5 ms target; ~2.7 ms of it are bf16 convolutions already at 440-725 TFLOP/s
(docs/benchmarks/perception_node_h200.md, session 12). Hopper's 8-bit tensor cores have twice
the bf16 rate. torch has no 8-bit convolution, TensorRT cannot be installed on the device
machine (its libraries are ~1 GB), so this asks cuDNN directly through its Python frontend
(`nvidia-cudnn-frontend`, carried as a wheel; a benchmark-only dependency, not the product's):
for the model's main conv shapes, one conv each as
  bf16   torch.nn.functional.conv2d, channels_last (what the compiled model runs),
  fp8    a cuDNN graph conv_fprop with float8_e4m3fn image and filter, fp32 accumulation,
         bf16 output (heuristic mode A's first supported plan),
  int8   the same with int8 image and filter, int32 accumulation and output.
Each is captured in a CUDA graph (eager loop if the capture fails) and replayed `--iters`
times after `--warmup`; p50 device time per conv from CUDA events. The fp8 output is checked
against the bf16 conv of the same (dequantised) values. JSON + a table:

    python scripts/bench_conv_fp8.py --out docs/benchmarks/conv_fp8_h200
"""
from __future__ import annotations

import argparse
import sys
import traceback

import numpy as np
import torch
import torch.nn.functional as F
from bench_common import cuda_graph_us, git_commit, machine_info, write_result

# name, N, C, H, W, K, kernel, padding (stride 1): the head convs at P3 are ~40 % of the FLOPs
SHAPES = [
    ("FCOS tower P3 256->256 3x3", 6, 256, 80, 80, 256, 3, 1),
    ("FCOS first P3 256->512 3x3 (merged)", 6, 256, 80, 80, 512, 3, 1),
    ("FCOS tower P4 256->256 3x3", 6, 256, 40, 40, 256, 3, 1),
    ("layer1 3x3 64->64 @160", 6, 64, 160, 160, 64, 3, 1),
    ("layer2 3x3 128->128 @80", 6, 128, 80, 80, 128, 3, 1),
    ("layer3 3x3 256->256 @40", 6, 256, 40, 40, 256, 3, 1),
    ("layer4 3x3 512->512 @20", 6, 512, 20, 20, 512, 3, 1),
    ("layer1 1x1 64->256 @160", 6, 64, 160, 160, 256, 1, 0),
    ("layer3 1x1 1024->256 @40", 6, 1024, 40, 40, 256, 1, 0),
]


def time_fn(fn, iters: int, warmup: int) -> tuple[float, bool]:
    """p50 us per call: CUDA-graph replays if fn can be captured, else an eager loop."""
    us, _, captured = cuda_graph_us(fn, iters, warmup, eager_fallback=True)
    return float(np.percentile(us, 50)), captured


def cudnn_conv(cudnn, handle, x: torch.Tensor, w: torch.Tensor, pad: int, kind: str,
               all_plans: bool = False):
    """A built cuDNN graph conv for x, w (8-bit) -> (run(plan index or None), y); with
    all_plans every plan cuDNN offers is built (run.plans of them)."""
    dt = cudnn.data_type
    io, acc, out_dt, out_torch = ((dt.FP8_E4M3, dt.FLOAT, dt.BFLOAT16, torch.bfloat16)
                                  if kind == "fp8" else
                                  (dt.INT8, dt.INT32, dt.INT32, torch.int32))
    g = cudnn.pygraph(io_data_type=io, intermediate_data_type=acc, compute_data_type=acc,
                      handle=handle)
    X = g.tensor(dim=list(x.shape), stride=list(x.stride()), data_type=io)
    W = g.tensor(dim=list(w.shape), stride=list(w.stride()), data_type=io)
    Y = g.conv_fprop(image=X, weight=W, padding=[pad, pad], stride=[1, 1], dilation=[1, 1])
    Y.set_output(True).set_data_type(out_dt)
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans(*([cudnn.build_plan_policy.ALL] if all_plans else []))
    n, _, h, wd = x.shape
    y = torch.empty((n, w.shape[0], h, wd), dtype=out_torch, device=x.device
                    ).to(memory_format=torch.channels_last)
    ws = torch.empty(max(1, g.get_workspace_size(), 1 << 28 if all_plans else 1),
                     dtype=torch.uint8, device=x.device)

    def run(index: int | None = None) -> None:
        cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
        if index is None:
            g.execute({X: x, W: w, Y: y}, ws, handle=handle)
        else:
            g.execute_plan_at_index({X: x, W: w, Y: y}, ws, index, handle=handle)
    run.plans = g.get_execution_plan_count() if all_plans else 1  # type: ignore[attr-defined]
    return run, y


def best_plan(run, iters: int, warmup: int) -> tuple[float, int, int]:
    """(p50 us of the fastest plan, its index, plans that ran) over every built plan."""
    best, best_i, ran = float("inf"), -1, 0
    for i in range(run.plans):
        try:
            us, _ = time_fn(lambda i=i: run(i), iters, warmup)
        except Exception:  # noqa: BLE001 (a plan that did not build or run)
            torch.cuda.synchronize()
            continue
        ran += 1
        if us < best:
            best, best_i = us, i
    return best, best_i, ran


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--all-plans", nargs="*", default=[], choices=("fp8", "int8"),
                    help="also build and time every plan cuDNN offers for these kinds")
    ap.add_argument("--shapes", type=int, nargs="*", default=None,
                    help="indices into SHAPES (default: all)")
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_conv_fp8: needs a CUDA GPU; skipped")
        return 0
    try:
        import cudnn
    except ImportError as exc:
        print(f"bench_conv_fp8: needs nvidia-cudnn-frontend ({exc}); skipped")
        return 0
    torch.backends.cudnn.benchmark = True
    commit = git_commit(args.git_commit or "")
    handle = cudnn.create_handle()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    shapes = SHAPES if args.shapes is None else [SHAPES[i] for i in args.shapes]
    for name, n, c, h, wd, k, ks, pad in shapes:
        gflop = 2 * n * h * wd * k * c * ks * ks / 1e9
        x = (torch.rand(n, c, h, wd, device="cuda", generator=g) * 2).to(
            memory_format=torch.channels_last)
        w = ((torch.rand(k, c, ks, ks, device="cuda", generator=g) - 0.5) * 0.2).to(
            memory_format=torch.channels_last)
        row = {"shape": name, "gflop": gflop}
        xb, wb = x.bfloat16(), w.bfloat16()
        row["bf16_us"], _ = time_fn(lambda xb=xb, wb=wb, pad=pad: F.conv2d(xb, wb, padding=pad),
                                    args.iters, args.warmup)
        for kind in ("fp8", "int8"):
            try:
                if kind == "fp8":
                    x8, w8 = x.to(torch.float8_e4m3fn), (w * 16).to(torch.float8_e4m3fn)
                else:
                    x8 = (x * 60).round().clamp(-127, 127).to(torch.int8)
                    w8 = (w * 1200).round().clamp(-127, 127).to(torch.int8)
                x8 = x8.contiguous(memory_format=torch.channels_last)
                w8 = w8.contiguous(memory_format=torch.channels_last)
                run, y = cudnn_conv(cudnn, handle, x8, w8, pad, kind)
                row[f"{kind}_us"], row[f"{kind}_graph"] = time_fn(run, args.iters, args.warmup)
                if args.all_plans and kind in args.all_plans:
                    run_all, _ = cudnn_conv(cudnn, handle, x8, w8, pad, kind, all_plans=True)
                    us, i, ran = best_plan(run_all, args.iters // 4, args.warmup)
                    row[f"{kind}_best_plan_us"], row[f"{kind}_best_plan"] = us, i
                    row[f"{kind}_plans"] = f"{ran} of {run_all.plans}"
                if kind == "fp8":
                    ref = F.conv2d(x8.float(), w8.float(), padding=pad)
                    err = (y.float() - ref).abs().max() / ref.abs().max()
                    row["fp8_rel_err"] = float(err)
            except Exception as exc:  # noqa: BLE001 (unsupported here: say so, go on)
                row[f"{kind}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                traceback.print_exc(limit=2)
        rows.append(row)
        print(row, flush=True)
    machine = machine_info(cudnn_backend=cudnn.backend_version_string())
    cmd = "python scripts/bench_conv_fp8.py " + " ".join(sys.argv[1:])

    def cell(r: dict, kind: str) -> str:
        if f"{kind}_us" not in r:
            return "n/a: " + r.get(f"{kind}_error", "?")[:60]
        us = r[f"{kind}_us"]
        return (f"{us:.1f} ({r['gflop'] / us * 1e3:.0f} TF/s, {r['bf16_us'] / us:.2f}x"
                f"{'' if r[f'{kind}_graph'] else ', eager'})")
    lines = [f"# 8-bit convolutions through cuDNN vs bf16 ({machine['gpu']})", "",
             f"`{cmd}`, git {commit}, torch {machine['torch']}, cuDNN "
             f"{machine['cudnn_backend']}; p50 device us per conv over {args.iters} replays.", "",
             "| conv | GFLOP | bf16 us (TF/s) | fp8 us (TF/s, x bf16) | int8 us (TOP/s, x bf16) "
             "| fp8 max rel err | best of all plans us (plans run) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        best = "; ".join(f"{kd} {r[f'{kd}_best_plan_us']:.1f} ({r[f'{kd}_plans']})"
                         for kd in ("fp8", "int8") if f"{kd}_best_plan_us" in r) or "-"
        lines.append(f"| {r['shape']} | {r['gflop']:.1f} | {r['bf16_us']:.1f} "
                     f"({r['gflop'] / r['bf16_us'] * 1e3:.0f}) | {cell(r, 'fp8')} | "
                     f"{cell(r, 'int8')} | {r.get('fp8_rel_err', float('nan')):.2g} | {best} |")
    write_result(args.out, {"command": cmd, "commit": commit, "machine": machine,
                            "args": vars(args), "rows": rows}, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
