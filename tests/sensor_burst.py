"""Publishes camera + LiDAR sets at a fixed rate from a process of its own (not a test module).

    python sensor_burst.py --prefix /perception/input --rate 30 --duration 4

One set = PointCloud2 on <prefix>/points, CameraInfo and Image (rgb8) on
<prefix>/camera_<i>/{camera_info,image} for every camera, all stamped alike: stamps start at
the wall clock when publishing starts and step by exactly 1 / rate, whatever the pacing.
Waits (bounded, --match-timeout) until every topic has a subscriber, publishes --warmup sets
at --warmup-rate (a subscriber can match a publisher a little after the publisher matched it:
what is lost then is lost at this low rate), then rate x duration sets on a fixed schedule
(late sets go out at once, never skipped), then prints one JSON line: {"sets": n, "image": n
per camera, "cloud": n, "warmup": n, "elapsed_s": s of the fast sets}, and
keeps its publishers (the last samples are the subscribers' to take) until stdin closes or
--linger s pass. Exit code 3 when the subscribers never matched.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time

import numpy as np
import rclpy
from kestrel_common.base_node import SENSOR_QOS
from kestrel_common.conversions import (make_camera_info, make_header, numpy_to_image,
                                        xyz_to_pointcloud2)
from sensor_msgs.msg import CameraInfo, Image, PointCloud2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--rate", type=float, required=True, help="sets per second")
    ap.add_argument("--duration", type=float, required=True, help="s")
    ap.add_argument("--cameras", type=int, default=1)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--height", type=int, default=48)
    ap.add_argument("--points", type=int, default=500)
    ap.add_argument("--warmup", type=int, default=5, help="sets published first, slowly")
    ap.add_argument("--warmup-rate", type=float, default=5.0, help="their rate, sets/s")
    ap.add_argument("--match-timeout", type=float, default=30.0)
    ap.add_argument("--linger", type=float, default=60.0, help="s, at most, after the last set")
    a = ap.parse_args(argv)
    rclpy.init()
    node = rclpy.create_node("sensor_burst")
    try:
        p = a.prefix.rstrip("/")
        imgs = [node.create_publisher(Image, f"{p}/camera_{i}/image", SENSOR_QOS)
                for i in range(a.cameras)]
        infos = [node.create_publisher(CameraInfo, f"{p}/camera_{i}/camera_info", SENSOR_QOS)
                 for i in range(a.cameras)]
        cloud = node.create_publisher(PointCloud2, f"{p}/points", SENSOR_QOS)
        deadline = time.monotonic() + a.match_timeout
        while any(pub.get_subscription_count() < 1 for pub in (*imgs, *infos, cloud)):
            if time.monotonic() > deadline:
                print(json.dumps({"error": "no subscriber matched"}), flush=True)
                return 3
            time.sleep(0.05)
        rng = np.random.default_rng(0)
        image = rng.integers(0, 256, (a.height, a.width, 3), dtype=np.uint8)
        xyz = np.column_stack([np.full(a.points, 2.0), rng.uniform(-1, 1, (a.points, 2))]
                              ).astype(np.float32)
        k = np.array([[50.0, 0.0, a.width / 2], [0.0, 50.0, a.height / 2], [0.0, 0.0, 1.0]])
        def publish_sets(count: int, rate: float) -> float:
            """`count` sets at `rate` on a fixed schedule, stamped 1 / rate apart from the wall
            clock at the start; returns the time taken, s."""
            period_ns = int(round(1e9 / rate))
            stamp0 = time.time_ns()
            t0 = time.monotonic()
            for i in range(count):
                wait = t0 + i / rate - time.monotonic()
                if wait > 0:
                    time.sleep(wait)  # pacing of the publisher, not synchronisation
                stamp = stamp0 + i * period_ns
                cloud.publish(xyz_to_pointcloud2(xyz, make_header(stamp, "world")))
                for c in range(a.cameras):
                    header = make_header(stamp, f"cam{c}_optical")
                    infos[c].publish(make_camera_info(k, a.width, a.height, header))
                    imgs[c].publish(numpy_to_image(image, "rgb8", header))
            return time.monotonic() - t0

        publish_sets(a.warmup, a.warmup_rate)
        n = int(round(a.rate * a.duration))
        elapsed = publish_sets(n, a.rate)
        total = a.warmup + n
        print(json.dumps({"sets": total, "image": [total] * a.cameras, "cloud": total,
                          "warmup": a.warmup, "elapsed_s": round(elapsed, 3)}), flush=True)
        if select.select([sys.stdin], [], [], a.linger)[0]:  # stdin closed (or a line)
            sys.stdin.readline()
        return 0
    finally:
        node.destroy_node()
        rclpy.try_shutdown()


if __name__ == "__main__":
    sys.exit(main())
