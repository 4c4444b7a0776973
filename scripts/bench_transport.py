#!/usr/bin/env python3
"""ROS 2 transport cost of camera-sized inputs, without any model: where the perception node's
end-to-end time outside the node goes (issue 4).

A publisher (this process) sends one input set per period: `--cams` sensor_msgs/Image of
H x W rgb8 and one PointCloud2 of `--points` xyz float32 points, all stamped with the wall clock
taken just before the first publish() of the set (as scripts/bench_perception_node.py does). A
subscriber in a separate process (same machine, the DDS setup of the environment: Fast DDS with
kestrel_bringup/config/fastdds_large_data.xml when sourced through scripts/env.sh) records, per
message, receipt - stamp. Modes of the subscriber, one run each, same publisher:
  msg  rclpy's normal path: the sample deserialised into a Python message object;
  raw  `create_subscription(..., raw=True)`: the serialised CDR bytes, no Python message (the
       stamp parsed from the CDR header), i.e. what deserialisation into Python costs.
Each mode runs with each subscriber executor (`--executors`): single (SingleThreadedExecutor),
multi (MultiThreadedExecutor, 4 threads, as the Kestrel nodes spin), events (rclpy's
experimental EventsExecutor; not the default: a Kestrel lifecycle node spun by it busy-looped
without delivering results on the dev machine).
Reported per mode: first / last message of a set (p50, p99, max, ms), complete sets, and the
publisher's time inside publish() for one set. JSON + a table.

    python scripts/bench_transport.py --sets 100 --rate 10 --out docs/benchmarks/transport_cpu
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def subscriber(args: argparse.Namespace) -> int:
    import rclpy
    from rclpy.node import Node
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image, PointCloud2

    raw = args.mode == "raw"
    rclpy.init()
    node = Node("bench_transport_sub")
    lat: dict[int, dict[str, float]] = {}

    def make_cb(name: str):  # noqa: ANN202
        def cb(m) -> None:  # noqa: ANN001
            t = time.time_ns()
            if raw:  # CDR: 4-byte encapsulation, stamp (int32 s, uint32 ns), frame_id string
                sec, ns, ln = struct.unpack_from("<iII", m, 4)
                stamp, fid = sec * 10**9 + ns, int(bytes(m[16:16 + ln - 1]))
            else:
                stamp = m.header.stamp.sec * 10**9 + m.header.stamp.nanosec
                fid = int(m.header.frame_id)
            lat.setdefault(fid, {})[name] = (t - stamp) * 1e-6
        return cb

    subs = [node.create_subscription(Image, f"/bench_transport/cam{i}", make_cb(f"cam{i}"),
                                     qos_profile_sensor_data, raw=raw) for i in range(args.cams)]
    subs.append(node.create_subscription(PointCloud2, "/bench_transport/points",
                                         make_cb("points"), qos_profile_sensor_data, raw=raw))
    if args.executor == "multi":
        from rclpy.executors import MultiThreadedExecutor
        executor = MultiThreadedExecutor(num_threads=4)
    elif args.executor == "events":
        from rclpy.experimental import EventsExecutor
        executor = EventsExecutor()
    else:
        from rclpy.executors import SingleThreadedExecutor
        executor = SingleThreadedExecutor()
    executor.add_node(node)
    print("READY", flush=True)
    end = time.monotonic() + args.sub_seconds
    while time.monotonic() < end and len(lat) < args.sets + args.skip:
        executor.spin_once(timeout_sec=0.05)
    end = time.monotonic() + 1.0  # let the last set finish (bounded)
    while time.monotonic() < end:
        executor.spin_once(timeout_sec=0.05)
    n_msgs = args.cams + 1
    sets = [v for k, v in sorted(lat.items())
            if args.skip <= k < args.skip + args.sets and len(v) == n_msgs]
    out = {"mode": args.mode, "executor": args.executor, "seen_sets": len(lat),
           "complete_sets": len(sets),
           "first_ms": bc.summary([min(v.values()) for v in sets]),
           "last_ms": bc.summary([max(v.values()) for v in sets]),
           "points_ms": bc.summary([v["points"] for v in sets])}
    print("RESULT " + json.dumps(out), flush=True)
    node.destroy_node()
    rclpy.shutdown()
    return 0


def publish_sets(args: argparse.Namespace, node, pubs, pc, img, cloud) -> list[float]:  # noqa: ANN001
    period = 1.0 / args.rate
    t_next = time.monotonic()
    pub_ms = []
    for k in range(args.sets + args.skip + 2):
        t = time.time_ns()
        for m in (img, cloud):
            m.header.stamp.sec, m.header.stamp.nanosec = divmod(t, 10**9)
            m.header.frame_id = str(k)
        for p in pubs:
            p.publish(img)
        pc.publish(cloud)
        pub_ms.append((time.time_ns() - t) * 1e-6)
        t_next += period
        time.sleep(max(0.0, t_next - time.monotonic()))
    return pub_ms[args.skip:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["run", "sub"], default="run")
    ap.add_argument("--mode", choices=["msg", "raw"], default="msg")
    ap.add_argument("--modes", nargs="+", default=["msg", "raw"])
    ap.add_argument("--executor", choices=["single", "multi", "events"], default="single")
    ap.add_argument("--executors", nargs="+", default=["single", "multi"],
                    help="subscriber executors, each with each mode")
    ap.add_argument("--cams", type=int, default=6)
    ap.add_argument("--image-hw", type=int, nargs=2, default=[640, 640])
    ap.add_argument("--points", type=int, default=120000)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--sets", type=int, default=100)
    ap.add_argument("--skip", type=int, default=5, help="first sets not counted (discovery)")
    ap.add_argument("--sub-seconds", type=float, default=60.0)
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--out", default=None, help="path prefix for .json and .md")
    args = ap.parse_args()
    if args.role == "sub":
        return subscriber(args)

    import rclpy
    from rclpy.node import Node
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import Image, PointCloud2, PointField

    rclpy.init()
    node = Node("bench_transport_pub")
    pubs = [node.create_publisher(Image, f"/bench_transport/cam{i}", qos_profile_sensor_data)
            for i in range(args.cams)]
    pc = node.create_publisher(PointCloud2, "/bench_transport/points", qos_profile_sensor_data)
    h, w = args.image_hw
    img = Image(height=h, width=w, encoding="rgb8", step=3 * w)
    img.data = np.random.default_rng(0).integers(0, 255, h * w * 3, dtype=np.uint8).tobytes()
    cloud = PointCloud2(height=1, width=args.points, point_step=12, row_step=12 * args.points,
                        is_dense=True)
    cloud.fields = [PointField(name=n, offset=4 * i, datatype=PointField.FLOAT32, count=1)
                    for i, n in enumerate("xyz")]
    cloud.data = np.random.default_rng(1).random(3 * args.points, dtype=np.float32).tobytes()
    results = []
    for mode, exe in [(m, e) for e in args.executors for m in args.modes]:
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "sub", "--mode", mode,
               "--executor", exe,
               "--cams", str(args.cams), "--sets", str(args.sets), "--skip", str(args.skip),
               "--sub-seconds", str(args.sets / args.rate + 20)]
        sub = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        line = sub.stdout.readline()  # bounded by the subprocess start; READY or EOF
        if not line.startswith("READY"):
            print(f"subscriber ({mode}) did not start", file=sys.stderr)
            return 2
        deadline = time.monotonic() + 10.0
        while node.count_subscribers("/bench_transport/points") < 1 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # matched: give the other topics' discovery a moment
        pub_ms = publish_sets(args, node, pubs, pc, img, cloud)
        try:
            out, _ = sub.communicate(timeout=args.sets / args.rate + 40)
        except subprocess.TimeoutExpired:
            sub.kill()
            out = ""
        res = next((json.loads(ln[7:]) for ln in out.splitlines() if ln.startswith("RESULT ")),
                   {"mode": mode, "executor": exe, "error": "no result"})
        res["publish_set_ms"] = bc.summary(pub_ms)
        results.append(res)
        print(json.dumps(res), flush=True)
    node.destroy_node()
    rclpy.shutdown()

    set_mb = (args.cams * h * w * 3 + 12 * args.points) / 1e6
    doc = {"machine": bc.machine_info() if hasattr(bc, "machine_info") else {},
           "git_commit": args.git_commit, "command": " ".join(sys.argv),
           "rmw": os.environ.get("RMW_IMPLEMENTATION"),
           "fastdds_profile": os.path.basename(os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE",
                                                              "") or "none"),
           "set_mb": set_mb, "cams": args.cams, "image_hw": [h, w], "points": args.points,
           "rate_hz": args.rate, "results": results}
    rows = ["| executor | subscriber | sets | publish() of a set p50 | first msg p50 / p99 | "
            "last msg p50 / p99 / max |", "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['executor']} | {r['mode']} | {r['error']} | | | |")
            continue
        f, last, p = r["first_ms"], r["last_ms"], r["publish_set_ms"]
        rows.append(f"| {r['executor']} | {r['mode']} | {r['complete_sets']}/{args.sets} | "
                    f"{p.get('p50', 0):.2f} | "
                    f"{f.get('p50', 0):.2f} / {f.get('p99', 0):.2f} | {last.get('p50', 0):.2f} / "
                    f"{last.get('p99', 0):.2f} / {last.get('max', 0):.2f} |")
    table = "\n".join(rows)
    print(f"\n{set_mb:.1f} MB per set ({args.cams} x {h}x{w} rgb8 + {args.points} points), "
          f"{args.rate:g} Hz, ms after the set's stamp:\n{table}")
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump(doc, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(f"# ROS 2 transport of one perception input set\n\nCommand: `{doc['command']}`"
                    f"  \ngit {args.git_commit}, RMW {doc['rmw']}, Fast DDS profile "
                    f"{doc['fastdds_profile']}, {set_mb:.1f} MB per set.\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
