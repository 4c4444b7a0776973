#!/usr/bin/env python3
"""The perception node's result build on the host, alone (no DDS): what runs between the
frame's sync and publish() (issue 4: it is on the end-to-end path).

Times `ResultBuilder.build_cdr` + the timings + the latency + `payload()` (the one join that
copies the maps), as `ResultPublisher.publish` does, for a result like the node's: `--cams`
cameras, `--dets` detections as parallel arrays (as the core hands them over), mono8 masks and
16UC1 depths at `--output-stride`, 25 stage timings. Each `--writers` entry is the CDR writer
of the working tree ("tree") or of a git revision's result_cdr.py (read with git show), patched
into the same builder, so the rows differ only in the writer; rows alternate over `--rounds`.
Every writer's payload is checked byte-equal to the tree's. JSON + table:

    python scripts/bench_result_build.py --writers HEAD~1 tree \
        --out docs/benchmarks/result_build_cpu
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import timeit
import types

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_CDR = "ros2_ws/src/kestrel_perception/kestrel_perception/result_cdr.py"


def writer_class(rev: str):  # noqa: ANN201
    from kestrel_perception import result_cdr
    if rev == "tree":
        return result_cdr.CdrWriter
    src = subprocess.run(["git", "-C", REPO, "show", f"{rev}:{RESULT_CDR}"], check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType(f"result_cdr_{rev}")
    exec(compile(src, f"{rev}:{RESULT_CDR}", "exec"), mod.__dict__)  # noqa: S102
    return mod.CdrWriter


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--writers", nargs="+", default=["HEAD", "tree"])
    ap.add_argument("--cams", type=int, default=6)
    ap.add_argument("--image-hw", type=int, nargs=2, default=[640, 640])
    ap.add_argument("--output-stride", type=int, default=4)
    ap.add_argument("--dets", type=int, default=120)
    ap.add_argument("--iters", type=int, default=500, help="timed builds per writer and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    args = ap.parse_args()
    from kestrel_perception import result_msg
    from kestrel_perception.core import CameraModel, PerceptionOutput
    from kestrel_perception.core.types import DEFAULT_CLASS_NAMES, DetectionArrays

    rng = np.random.default_rng(0)
    c, d = args.cams, args.dets
    h, w = (-(-x // args.output_stride) for x in args.image_hw)
    K = np.array([[500.0, 0, 320], [0, 500.0, 320], [0, 0, 1]])
    cams = [CameraModel(K, args.image_hw[1], args.image_hw[0], f"camera_{i}_optical")
            for i in range(c)]
    arrays = DetectionArrays(
        np.sort(rng.integers(0, c, d)).astype(np.uint32), rng.integers(1, 7, d).astype(np.uint16),
        rng.random(d).astype(np.float32), (rng.random((d, 4)) * 600).astype(np.float32),
        rng.normal(0, 2, (d, 3)), rng.integers(0, 3, d).astype(np.uint8))
    out = PerceptionOutput(0, None, [rng.integers(0, 7, (h, w), dtype=np.uint8)] * c,
                           [rng.integers(0, 8000, (h, w), dtype=np.uint16)] * c,
                           {k: 1e-3 for k in ("preprocess", "model", "postprocess",
                                              "lidar_fusion", "download", "unpack")},
                           depth_encoding="16UC1", output_stride=args.output_stride,
                           arrays=arrays, class_names=DEFAULT_CLASS_NAMES)
    extra = {f"{k}_host": 1e-4 for k in ("preprocess", "model", "postprocess", "lidar_fusion",
                                         "download")}
    extra.update({k: 1e-4 for k in ("wait", "input_age", "input_spread", "cloud_lag",
                                    "rx_handoff", "rx_write", "rx_read", "rx_handler")})
    builder = result_msg.ResultBuilder("world", DEFAULT_CLASS_NAMES)
    stamps = [1_234_567_890_123] * c

    def build() -> bytes:  # ResultPublisher.publish's CDR path, without the publish() call
        wr = builder.build_cdr(stamps[0], stamps, cams, out)
        wr.timings({**out.timings, **extra, "build": 1e-4})
        wr.f64(1e-3)
        return wr.payload()

    classes = {rev: writer_class(rev) for rev in args.writers}
    times: dict[str, list[float]] = {rev: [] for rev in args.writers}
    payloads = {}
    tree_cls = result_msg.CdrWriter
    try:
        for _ in range(args.rounds):
            for rev, cls in classes.items():
                result_msg.CdrWriter = cls
                payloads[rev] = build()
                for _ in range(50):
                    build()
                times[rev] += [timeit.timeit(build, number=1) * 1e6 for _ in range(args.iters)]
    finally:
        result_msg.CdrWriter = tree_cls
    ref = payloads.get("tree", next(iter(payloads.values())))
    rows = [{"writer": rev, "p50_us": float(np.percentile(t, 50)),
             "p90_us": float(np.percentile(t, 90)), "p99_us": float(np.percentile(t, 99)),
             "bytes": len(payloads[rev]), "same_payload": payloads[rev] == ref}
            for rev, t in times.items()]
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    cmd = "python scripts/bench_result_build.py " + " ".join(sys.argv[1:])
    lines = [f"# Perception result build on the host ({platform.node()}, "
             f"{os.cpu_count()} CPUs)", "",
             f"`{cmd}`, git {commit} (+ working tree), Python {platform.python_version()}; "
             f"{c} cameras, {d} detections, maps at stride {args.output_stride}, "
             f"{args.rounds} x {args.iters} builds per writer, alternating.", "",
             "| CDR writer | p50 us | p90 us | p99 us | payload bytes | payload = tree's |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['writer']} | {r['p50_us']:.1f} | {r['p90_us']:.1f} | {r['p99_us']:.1f} | "
              f"{r['bytes']:,} | {r['same_payload']} |" for r in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"command": cmd, "commit": commit, "args": vars(args), "rows": rows,
                       "machine": {"host": platform.node(), "cpus": os.cpu_count(),
                                   "python": platform.python_version()}}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0 if all(r["same_payload"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
