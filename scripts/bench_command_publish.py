"""The control node's direct publish, measured: what the loop thread pays per cycle in thread
mode (kestrel_control/control_node.py's docstring cites this file).

One rclpy node publishes the command message the node publishes (sensor_msgs/JointState, 6
joints, one preallocated message, stamp and positions written in place) with the command QoS
(RELIABLE, keep last 10) at `--rate` Hz for `--count` calls, with a subscriber in another
process counting what arrives (a matched reader, as on a robot). Timed per call: the node
clock read (`get_clock().now()`), the in-place update, and `publish()`. Writes JSON + a table.

    python scripts/bench_command_publish.py --out docs/benchmarks/command_publish_cpu
"""

from __future__ import annotations

import argparse
import array
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common  # noqa: E402

TOPIC = "/kestrel_bench/command"
JOINTS = [f"joint_{i}" for i in range(6)]

SUBSCRIBER = """
import sys, threading
import rclpy
from rclpy.executors import SingleThreadedExecutor
from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import JointState
rclpy.init()
node = rclpy.create_node("kestrel_bench_command_sink")
got = [0]
node.create_subscription(JointState, sys.argv[1], lambda m: got.__setitem__(0, got[0] + 1),
                         QoSProfile(history=HistoryPolicy.KEEP_LAST, depth=10,
                                    reliability=ReliabilityPolicy.RELIABLE))
ex = SingleThreadedExecutor()
ex.add_node(node)
threading.Thread(target=ex.spin, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
print("received", got[0], flush=True)
ex.shutdown(timeout_sec=2.0)
node.destroy_node()
rclpy.try_shutdown()
"""


def pct(x: np.ndarray) -> dict:
    return {"p50": float(np.percentile(x, 50)), "p99": float(np.percentile(x, 99)),
            "p999": float(np.percentile(x, 99.9)), "max": float(x.max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=20_000)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    import rclpy
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    from sensor_msgs.msg import JointState

    sink_out = tempfile.TemporaryFile()
    sink = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, TOPIC], stdin=subprocess.PIPE,
                            stdout=sink_out)
    rclpy.init()
    node = rclpy.create_node("kestrel_bench_command_publisher")
    pub = node.create_publisher(JointState, TOPIC, QoSProfile(
        history=HistoryPolicy.KEEP_LAST, depth=10, reliability=ReliabilityPolicy.RELIABLE))
    deadline = time.monotonic() + 30.0
    while pub.get_subscription_count() < 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # bounded wait for discovery
    matched = pub.get_subscription_count()
    msg = JointState(name=JOINTS)
    msg.position = array.array("d", [0.0] * len(JOINTS))
    view = np.frombuffer(msg.position, dtype=np.float64)
    clock = node.get_clock()
    n = args.count
    t_clock, t_fill, t_pub = np.zeros(n), np.zeros(n), np.zeros(n)
    period = 1.0 / args.rate
    next_t = time.perf_counter()
    for k in range(n):
        next_t += period
        while time.perf_counter() < next_t:
            pass  # spin to the period, as the loop does
        t0 = time.perf_counter_ns()
        now = clock.now().nanoseconds
        t1 = time.perf_counter_ns()
        msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(now, 1_000_000_000)
        view[:] = k * 1e-3
        t2 = time.perf_counter_ns()
        pub.publish(msg)
        t3 = time.perf_counter_ns()
        t_clock[k], t_fill[k], t_pub[k] = (t1 - t0) * 1e-3, (t2 - t1) * 1e-3, (t3 - t2) * 1e-3
    time.sleep(0.5)  # let the last reliable samples land (not a synchronisation of results)
    sink.stdin.close()
    sink.wait(20)
    sink_out.seek(0)
    received = next((int(line.split()[1]) for line in sink_out.read().decode().splitlines()
                     if line.startswith("received ")), None)
    node.destroy_node()
    rclpy.try_shutdown()
    result = {"command": "python " + " ".join(sys.argv), "commit": bench_common.git_commit(None),
              "machine": bench_common.machine_info(), "count": n, "rate_hz": args.rate,
              "matched_subscribers": matched, "received_by_subscriber": received,
              "clock_read_us": pct(t_clock), "fill_us": pct(t_fill), "publish_us": pct(t_pub)}
    rows = [("node clock read", result["clock_read_us"]), ("stamp + positions in place",
            result["fill_us"]), ("publish()", result["publish_us"])]
    md = [f"# The control node's direct command publish ({result['machine'].get('cpu_model')})",
          "", f"`{result['command']}`, git {result['commit']}; {n} calls at {args.rate:g} Hz, "
          f"{matched} matched RELIABLE subscriber(s) in another process, {received} received.",
          "", "| part | p50 us | p99 us | p99.9 us | max us |", "|---|---|---|---|---|"]
    md += [f"| {name} | {r['p50']:.1f} | {r['p99']:.1f} | {r['p999']:.1f} | {r['max']:.1f} |"
           for name, r in rows]
    bench_common.write_result(args.out, result, "\n".join(md) + "\n")


if __name__ == "__main__":
    main()
