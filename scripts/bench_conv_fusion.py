#!/usr/bin/env python3
"""Does cuDNN's fused conv + bias (+ residual) + ReLU beat inductor's conv + Triton epilogue?

For every conv shape of the ResNet-50 trunk at the perception benchmark's size (6 images of
640x640, bf16, channels_last), one run times on the GPU, side by side:
  inductor  torch.compile(relu(conv2d(x, w, b) [+ z])): cuDNN conv (extern kernel) + one Triton
            pointwise kernel that reads the conv output (and the residual) back: what the
            perception runtime runs today;
  cudnn     torch.cudnn_convolution_relu / torch.cudnn_convolution_add_relu (eager): one cuDNN
            call whose epilogue applies bias, residual and ReLU;
  cudnn_in_compile  the same op inside torch.compile (inductor keeps it as a fallback kernel):
            checks that the fused op survives the compiled region.
Weighted by how often each shape occurs in one forward, the sum says what fusing the trunk's
epilogues could save at most. Median / p99 of CUDA-event times over --iters calls after
--warmup. JSON + a table.

  python scripts/bench_conv_fusion.py --out docs/benchmarks/conv_fusion_h200
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import git_commit, machine_info, pct, write_result  # noqa: E402

# (name, cin, cout, kernel, stride, H_in, residual, count per forward) for 640x640 inputs
TRUNK = [
    ("l1.conv1 1x1", 256, 64, 1, 1, 160, False, 2),
    ("l1.conv1(first) 1x1", 64, 64, 1, 1, 160, False, 1),
    ("l1.conv2 3x3", 64, 64, 3, 1, 160, False, 3),
    ("l1.conv3 1x1 +res", 64, 256, 1, 1, 160, True, 3),
    ("l2.conv1 1x1", 512, 128, 1, 1, 80, False, 3),
    ("l2.conv2 3x3", 128, 128, 3, 1, 80, False, 3),
    ("l2.conv3 1x1 +res", 128, 512, 1, 1, 80, True, 4),
    ("l3.conv1 1x1", 1024, 256, 1, 1, 40, False, 5),
    ("l3.conv2 3x3", 256, 256, 3, 1, 40, False, 5),
    ("l3.conv3 1x1 +res", 256, 1024, 1, 1, 40, True, 6),
    ("l4.conv1 1x1", 2048, 512, 1, 1, 20, False, 2),
    ("l4.conv2 3x3", 512, 512, 3, 1, 20, False, 2),
    ("l4.conv3 1x1 +res", 512, 2048, 1, 1, 20, True, 3),
]


def timed(fn, args: tuple, iters: int, warmup: int, per_graph: int = 10) -> list[float]:
    """us per call: `per_graph` calls captured in one CUDA graph (no launch or guard overhead
    in the figure, as in the runtime's whole-forward graph), the graph replayed `iters`
    times, each replay timed by CUDA events."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn(*args)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn(*args)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(iters)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) * 1e3 / per_graph for a, b in ev]  # us


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=6)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_conv_fusion: no CUDA device (the fused ops are cuDNN-only)")
        return 0
    torch.backends.cudnn.benchmark = True
    dev, dt, cl = torch.device("cuda"), torch.bfloat16, torch.channels_last

    def plain(x, w, b, z, stride, pad):
        y = F.conv2d(x, w, b, stride, pad)
        return torch.relu(y + z) if z is not None else torch.relu(y)

    def fused(x, w, b, z, stride, pad):
        if z is None:
            return torch.cudnn_convolution_relu(x, w, b, (stride,) * 2, (pad,) * 2, (1, 1), 1)
        return torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, (stride,) * 2, (pad,) * 2,
                                                (1, 1), 1)

    rows = []
    for name, cin, cout, k, stride, h, res, count in TRUNK:
        pad = k // 2
        x = torch.randn(args.batch, cin, h, h, device=dev, dtype=dt).to(memory_format=cl)
        w = (torch.randn(cout, cin, k, k, device=dev, dtype=dt) / (cin * k * k) ** 0.5
             ).to(memory_format=cl)
        b = torch.randn(cout, device=dev, dtype=dt)
        ho = h // stride
        z = torch.randn(args.batch, cout, ho, ho, device=dev, dtype=dt
                        ).to(memory_format=cl) if res else None
        row = {"name": name, "cin": cin, "cout": cout, "k": k, "hw": h, "residual": res,
               "count": count, "gflop": 2 * args.batch * cout * ho * ho * cin * k * k / 1e9}
        torch._dynamo.reset()
        comp = torch.compile(lambda x, w, b, z, f=plain, s=stride, p=pad: f(x, w, b, z, s, p))
        comp_fused = torch.compile(lambda x, w, b, z, f=fused, s=stride, p=pad:
                                   f(x, w, b, z, s, p))
        ref = comp(x, w, b, z).float()
        for label, fn in (("inductor", comp),
                          ("cudnn", lambda x, w, b, z, s=stride, p=pad: fused(x, w, b, z, s, p)),
                          ("cudnn_in_compile", comp_fused)):
            try:
                out = fn(x, w, b, z)
                us = timed(fn, (x, w, b, z), args.iters, args.warmup)
                row[label] = {"p50_us": pct(us, 50), "p99_us": pct(us, 99),
                              "max_abs_vs_inductor": float((out.float() - ref).abs().max())}
            except Exception as exc:  # noqa: BLE001 (an unsupported fused op is a result)
                row[label] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append(row)
        print(json.dumps(row), flush=True)

    def total(label: str) -> float:
        return sum(r["count"] * r[label]["p50_us"] for r in rows if "p50_us" in r[label])

    totals = {k: total(k) for k in ("inductor", "cudnn", "cudnn_in_compile")}
    commit = git_commit(args.git_commit or "")
    res = {"command": "python " + " ".join(sys.argv), "git_commit": commit,
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "machine": machine_info(device=torch.cuda.get_device_name()),
           "batch": args.batch, "rows": rows, "weighted_total_us": totals}
    lines = [f"# Conv + epilogue: inductor vs cuDNN fused ({res['machine']['device']})", "",
             f"`{res['command']}`, git {commit}, torch {res['torch']}, cuDNN {res['cudnn']}, "
             f"batch {args.batch}, bf16 channels_last, p50 us (CUDA events).", "",
             "| conv | x/fwd | GFLOP | inductor | cudnn fused | fused in compile | max abs |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        def cell(label: str, r=r) -> str:
            v = r[label]
            return f"{v['p50_us']:.1f}" if "p50_us" in v else v["error"][:40]
        mad = r["cudnn"].get("max_abs_vs_inductor", float("nan"))
        lines.append(f"| {r['name']} | {r['count']} | {r['gflop']:.1f} | {cell('inductor')} | "
                     f"{cell('cudnn')} | {cell('cudnn_in_compile')} | {mad:.3g} |")
    lines.append(f"| **weighted sum per forward** | | | {totals['inductor']:.0f} | "
                 f"{totals['cudnn']:.0f} | {totals['cudnn_in_compile']:.0f} | |")
    write_result(args.out, res, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
