#!/usr/bin/env python3
"""Dense class-wise NMS on the GPU: the round kernel's tiling side by side (issue 4, postprocess).

`kestrel_models.perception.nms_triton.nms_dense` = one suppress-matrix kernel + `rounds` + 1
launches of `_round_kernel`. A round program owns RJ columns j and loops over the rows i in
steps of RI, so a round is ~N/RI dependent steps in B * N/RJ programs: with the session-11
tiling (RI 64, RJ 128) 6 x 1000 candidates make 48 programs of 16 steps, 15 us per round
(docs/benchmarks/perception_core_kernels_h200_s11.md: 9 launches, 135 us per frame).
Each tiling is captured in a CUDA graph (as the node's region graph does) and replayed
`--iters` times after `--warmup`; keep masks must equal the first tiling's. Inputs: the
node's sizes, `--cams` images x `--cands` candidates sorted by score, boxes of 10-200 px in a
640x640 image, `--classes` classes shifted apart (the offset trick). JSON + a table:

    python scripts/bench_nms_rounds.py --out docs/benchmarks/nms_rounds_h200
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "models"))
from kestrel_models.perception import nms_triton as nt  # noqa: E402
from bench_common import (cuda_graph_us, git_commit, machine_info, us_stats,  # noqa: E402
                          write_result)


def inputs(c: int, n: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(c, n, 2, generator=g) * 600
    boxes = torch.cat([xy, xy + 10 + 190 * torch.rand(c, n, 2, generator=g)], 2)
    cls = torch.randint(0, classes, (c, n), generator=g).float()
    boxes = boxes + (cls * 1000.0)[..., None]  # classes never overlap
    valid = torch.rand(c, n, generator=g) < 0.9
    return boxes.cuda(), valid.cuda()


def time_tiling(args, boxes, valid, ri: int, rj: int):
    nt.RI, nt.RJ = ri, rj
    us, (keep, conv), _ = cuda_graph_us(
        lambda: nt.nms_dense(boxes, valid, args.iou, args.rounds), args.iters, args.warmup)
    return us_stats(us), keep.clone(), bool(conv)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cams", type=int, default=6)
    ap.add_argument("--cands", type=int, default=1000)
    ap.add_argument("--classes", type=int, default=6)
    ap.add_argument("--iou", type=float, default=0.6)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tilings", nargs="+", default=["64x128", "128x64", "256x32", "128x32",
                                                      "256x16", "512x16"],
                    help="round kernel tilings RIxRJ (rows per step x columns per program)")
    ap.add_argument("--iters", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and nt.HAVE_TRITON):
        print("bench_nms_rounds: needs a CUDA GPU and triton; skipped")
        return 0
    commit = git_commit(args.git_commit or "")
    default = (nt.RI, nt.RJ)
    boxes, valid = inputs(args.cams, args.cands, args.classes, seed=0)
    rows, first = [], None
    try:
        for t in args.tilings:
            ri, rj = (int(x) for x in t.split("x"))
            stats, keep, conv = time_tiling(args, boxes, valid, ri, rj)
            first = keep if first is None else first
            rows.append({"tiling": t, **stats, "converged": conv,
                         "equal_to_first": bool(torch.equal(keep, first)),
                         "kept": int(keep.sum())})
    finally:
        nt.RI, nt.RJ = default
    machine = machine_info()
    cmd = "python scripts/bench_nms_rounds.py " + " ".join(sys.argv[1:])
    lines = [f"# Dense class-wise NMS, round kernel tilings ({machine['gpu']})", "",
             f"`{cmd}`, git {commit}, torch {machine['torch']}; {args.cams} images x "
             f"{args.cands} candidates, {args.rounds} rounds + the check round, CUDA-graph "
             f"replays of the whole nms_dense, {args.iters} iterations after {args.warmup}.", "",
             "| round tiling RIxRJ | p50 us | p99 us | p99.9 us | kept | converged | "
             "equal to first |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tiling']} | {r['p50_us']:.1f} | {r['p99_us']:.1f} | "
                     f"{r['p999_us']:.1f} | {r['kept']} | {r['converged']} | "
                     f"{r['equal_to_first']} |")
    write_result(args.out, {"command": cmd, "commit": commit, "machine": machine,
                            "args": vars(args), "rows": rows}, "\n".join(lines) + "\n")
    return 0 if all(r["equal_to_first"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
