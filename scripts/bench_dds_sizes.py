#!/usr/bin/env python3
"""DDS delivery time of one large message by size, and what glibc's heap settings in the
SUBSCRIBING process do to it (kestrel_common.heap.tune_malloc).

A publisher (this process) sends sensor_msgs/Image messages of each `--sizes` (bytes of data)
`--count` times at 20 Hz, each stamped with the wall clock just before publish(); a subscriber
process (raw=True: the CDR bytes, no Python message objects) records callback entry - stamp.
For each `--cases` entry the subscriber is started again with its heap set as named:
  default  glibc's defaults;
  mmap     mallopt(M_MMAP_THRESHOLD, 32 MiB) only;
  trim     mallopt(M_TRIM_THRESHOLD, 256 MiB) only;
  both     both (= tune_malloc, what every Kestrel process does).
QoS `--reliability` (reliable, as the node's results; best_effort, as the sensor inputs). The
Fast DDS profile is the stack's (scripts/env.sh). Example (dev CPU, docs/benchmarks/
malloc_tuning.md):

    python scripts/bench_dds_sizes.py --out docs/benchmarks/dds_sizes_cpu
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import struct
import subprocess
import sys
import time

from kestrel_common.heap import MMAP_THRESHOLD, TRIM_THRESHOLD

# mallopt parameter (glibc malloc.h: -3 M_MMAP_THRESHOLD, -1 M_TRIM_THRESHOLD) -> value: each
# of tune_malloc's two settings alone, and both (= tune_malloc)
SETTINGS = {"default": {}, "mmap": {-3: MMAP_THRESHOLD}, "trim": {-1: TRIM_THRESHOLD},
            "both": {-3: MMAP_THRESHOLD, -1: TRIM_THRESHOLD}}


def qos(reliability: str):  # noqa: ANN201
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    rel = ReliabilityPolicy.RELIABLE if reliability == "reliable" else \
        ReliabilityPolicy.BEST_EFFORT
    return QoSProfile(depth=10, reliability=rel, history=HistoryPolicy.KEEP_LAST)


def subscriber(args: argparse.Namespace) -> int:
    libc = ctypes.CDLL("libc.so.6")
    for param, value in SETTINGS[args.case].items():
        if libc.mallopt(param, value) != 1:
            raise SystemExit(f"mallopt({param}, {value}) failed")
    import rclpy
    from sensor_msgs.msg import Image

    rows: list[tuple[int, float]] = []

    def cb(data: bytes) -> None:
        t = time.time_ns()
        sec, nsec = struct.unpack_from("<iI", data, 4)  # header.stamp after the CDR header
        rows.append((len(data), (t - (sec * 10**9 + nsec)) / 1e6))

    rclpy.init()
    node = rclpy.create_node("bench_dds_sizes_sub")
    node.create_subscription(Image, "/bench_dds_sizes", cb, qos(args.reliability), raw=True)
    print("READY", flush=True)
    end = time.monotonic() + 120.0  # bounded even if stdin never closes
    import threading
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.is_set() and time.monotonic() < end:
        rclpy.spin_once(node, timeout_sec=0.05)
    print("ROWS " + json.dumps(rows), flush=True)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


def run_case(args: argparse.Namespace, pub, case: str) -> dict:  # noqa: ANN001
    from sensor_msgs.msg import Image
    sub = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--role", "sub",
                            "--case", case, "--reliability", args.reliability],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if not sub.stdout.readline().startswith("READY"):
            return {"case": case, "error": "subscriber did not start"}
        deadline = time.monotonic() + 15.0
        while pub.get_subscription_count() < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.5)  # discovery settles (not a synchronisation: every sample is counted)
        for size in args.sizes:
            m = Image(height=1, width=size, encoding="mono8", step=size, data=bytes(size))
            for _ in range(args.count):
                t = time.time_ns()
                m.header.stamp.sec, m.header.stamp.nanosec = t // 10**9, t % 10**9
                pub.publish(m)
                time.sleep(0.05)
        time.sleep(0.5)
        sub.stdin.close()
        line = next((x for x in sub.stdout if x.startswith("ROWS ")), "ROWS []")
        sub.wait(30)
    finally:
        if sub.poll() is None:
            sub.kill()
    rows = json.loads(line[5:])
    out: dict = {"case": case, "by_size": {}}
    for size in args.sizes:
        lat = sorted(ms for n, ms in rows if size <= n < size + 1024)[args.skip:]
        out["by_size"][size] = {"n": len(lat), "p50_ms": statistics.median(lat) if lat else None,
                                "max_ms": lat[-1] if lat else None}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("run", "sub"), default="run")
    ap.add_argument("--case", choices=tuple(SETTINGS), default="default")
    ap.add_argument("--cases", nargs="+", choices=tuple(SETTINGS), default=list(SETTINGS))
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 10, 1 << 20, 2 << 20])
    ap.add_argument("--count", type=int, default=30)
    ap.add_argument("--skip", type=int, default=3, help="first samples per size not counted")
    ap.add_argument("--reliability", choices=("reliable", "best_effort"), default="reliable")
    ap.add_argument("--out", default=None, help="path stem: writes STEM.json")
    args = ap.parse_args()
    if args.role == "sub":
        return subscriber(args)
    import rclpy
    from sensor_msgs.msg import Image
    rclpy.init()
    node = rclpy.create_node("bench_dds_sizes_pub")
    pub = node.create_publisher(Image, "/bench_dds_sizes", qos(args.reliability))
    results = [run_case(args, pub, c) for c in args.cases]
    node.destroy_node()
    rclpy.try_shutdown()
    print(f"\ncallback entry - stamp, p50 / max ms ({args.reliability}, raw subscriber):")
    print("| subscriber heap | " + " | ".join(f"{s:,} B" for s in args.sizes) + " |")
    print("|---|" + "---|" * len(args.sizes))
    for r in results:
        cells = [f"{v['p50_ms']:.2f} / {v['max_ms']:.2f}" if v["n"] else "-"
                 for v in r.get("by_size", {}).values()]
        print(f"| {r['case']} | " + " | ".join(cells) + " |")
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(args.out + ".json", "w") as f:
            json.dump({"git_commit": commit, "command": " ".join(["python", *sys.argv]),
                       "machine": os.uname().nodename, "cpus": os.cpu_count(),
                       "fastdds_profile": os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE", ""),
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
