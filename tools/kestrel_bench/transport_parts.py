"""Subscriber processes and the message sources of `kestrel_bench transport` (transport.py).

Run as `python -m kestrel_bench.transport_parts --role ROLE ...`: each subscriber prints
READY once subscribed, records (stamp, callback entry) per message until stdin closes, then
prints `ROWS <json>`. Roles:
  inputs    a camera set (Image x cams + PointCloud2), SENSOR QoS; --mode msg (a Python
            message per sample) or raw (the CDR bytes, stamp read from the CDR header);
            --executor single | multi
  result    PerceptionResult, the node's output QoS (reliable); --mode msg | raw
  sizes     sensor_msgs/Image of any size, raw, the process's heap set as --heap says
            (default: glibc's; tuned: kestrel_common.heap.tune_malloc, as every Kestrel
            process)
  commands  sensor_msgs/JointState with the command QoS (reliable, depth 10): a counter
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import threading
import time
from typing import Any

import numpy as np

from kestrel_bench.repo import ensure_paths


def cdr_stamp_ns(data: Any) -> int:
    """header.stamp of a serialised message (4-byte encapsulation, int32 s, uint32 ns)."""
    sec, ns = struct.unpack_from("<iI", data, 4)
    return sec * 10**9 + ns


def qos(kind: str):  # noqa: ANN201
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data

    if kind == "sensor":
        return qos_profile_sensor_data
    return QoSProfile(depth=10, history=HistoryPolicy.KEEP_LAST,
                      reliability=ReliabilityPolicy.RELIABLE if kind == "reliable"
                      else ReliabilityPolicy.BEST_EFFORT)


def subscriber(args: argparse.Namespace) -> int:
    if args.heap == "tuned":
        from kestrel_common.heap import tune_malloc
        print(tune_malloc(), file=sys.stderr)
    import rclpy
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor

    raw = args.mode == "raw"
    rows: list[list] = []

    def make_cb(topic: str):  # noqa: ANN202
        def cb(m: Any) -> None:
            t = time.time_ns()
            stamp = cdr_stamp_ns(m) if raw else (m.header.stamp.sec * 10**9
                                                 + m.header.stamp.nanosec)
            rows.append([topic, stamp, t, len(m) if raw else 0])
        return cb

    rclpy.init()
    node = rclpy.create_node(f"kestrel_bench_transport_{args.role}")
    if args.role == "inputs":
        from sensor_msgs.msg import Image, PointCloud2
        subs = [(Image, f"/kestrel_bench/cam{i}") for i in range(args.cams)]
        subs.append((PointCloud2, "/kestrel_bench/points"))
        q = qos("sensor")
    elif args.role == "result":
        from kestrel_interfaces.msg import PerceptionResult
        subs, q = [(PerceptionResult, "/kestrel_bench/result")], qos("reliable")
    elif args.role == "sizes":
        from sensor_msgs.msg import Image
        subs, q = [(Image, "/kestrel_bench/sizes")], qos("reliable")
    else:
        from sensor_msgs.msg import JointState
        subs, q = [(JointState, "/kestrel_bench/command")], qos("reliable")
    for mtype, topic in subs:
        node.create_subscription(mtype, topic, make_cb(topic), q, raw=raw)
    ex = MultiThreadedExecutor(num_threads=4) if args.executor == "multi" \
        else SingleThreadedExecutor()
    ex.add_node(node)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("READY", flush=True)
    end = time.monotonic() + args.seconds  # bounded even if stdin never closes
    while not stop.is_set() and time.monotonic() < end:
        ex.spin_once(timeout_sec=0.05)
    print("ROWS " + json.dumps(rows), flush=True)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


def camera_set(cams: int, hw: tuple[int, int], points: int) -> tuple[Any, Any]:
    """One rgb8 Image (shared by the cameras) and one xyz float32 PointCloud2."""
    from sensor_msgs.msg import Image, PointCloud2, PointField

    h, w = hw
    img = Image(height=h, width=w, encoding="rgb8", step=3 * w)
    img.data = np.random.default_rng(0).integers(0, 255, h * w * 3, dtype=np.uint8).tobytes()
    cloud = PointCloud2(height=1, width=points, point_step=12, row_step=12 * points,
                        is_dense=True)
    cloud.fields = [PointField(name=n, offset=4 * i, datatype=PointField.FLOAT32, count=1)
                    for i, n in enumerate("xyz")]
    cloud.data = np.random.default_rng(1).random(3 * points, dtype=np.float32).tobytes()
    return img, cloud


def result_source(cams: int, hw: tuple[int, int], stride: int, dets: int) -> tuple[Any, ...]:
    """(ResultBuilder, cameras, PerceptionOutput) of a result as the node publishes one:
    `dets` detections as parallel arrays, mono8 masks and 16UC1 depths at `stride`."""
    ensure_paths("kestrel_perception")
    from kestrel_perception.core import CameraModel, PerceptionOutput
    from kestrel_perception.core.types import DEFAULT_CLASS_NAMES, DetectionArrays
    from kestrel_perception.result_msg import ResultBuilder

    rng = np.random.default_rng(0)
    h, w = (-(-x // stride) for x in hw)
    K = np.array([[500.0, 0, 320], [0, 500.0, 320], [0, 0, 1]])
    cameras = [CameraModel(K, hw[1], hw[0], f"camera_{i}_optical") for i in range(cams)]
    arrays = DetectionArrays(
        np.sort(rng.integers(0, cams, dets)).astype(np.uint32),
        rng.integers(1, 7, dets).astype(np.uint16), rng.random(dets).astype(np.float32),
        (rng.random((dets, 4)) * 600).astype(np.float32), rng.normal(0, 2, (dets, 3)),
        rng.integers(0, 3, dets).astype(np.uint8))
    out = PerceptionOutput(0, None, [rng.integers(0, 7, (h, w), dtype=np.uint8)] * cams,
                           [rng.integers(0, 8000, (h, w), dtype=np.uint16)] * cams,
                           {k: 1e-3 for k in ("preprocess", "model", "postprocess",
                                              "lidar_fusion", "download", "unpack")},
                           depth_encoding="16UC1", output_stride=stride, arrays=arrays,
                           class_names=DEFAULT_CLASS_NAMES)
    return ResultBuilder("world", DEFAULT_CLASS_NAMES), cameras, out


def build_result(builder: Any, cameras: list, out: Any, stamp_ns: int, cdr: bool) -> Any:
    """The result as a Python message (cdr False) or as its CDR bytes, as the node's
    ResultPublisher builds it."""
    stamps = [stamp_ns] * len(cameras)
    if not cdr:
        return builder.build(stamp_ns, stamps, cameras, out, {"wait": 1e-4})
    wr = builder.build_cdr(stamp_ns, stamps, cameras, out)
    wr.timings({**out.timings, "wait": 1e-4})
    wr.f64(1e-3)
    return wr.payload()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="a subscriber process of kestrel_bench transport")
    ap.add_argument("--role", choices=("inputs", "result", "sizes", "commands"), required=True)
    ap.add_argument("--mode", choices=("msg", "raw"), default="msg")
    ap.add_argument("--executor", choices=("single", "multi"), default="single")
    ap.add_argument("--heap", choices=("default", "tuned"), default="default")
    ap.add_argument("--cams", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=120.0)
    ensure_paths("kestrel_common")
    sys.exit(subscriber(ap.parse_args()))
