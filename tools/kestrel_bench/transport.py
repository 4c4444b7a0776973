"""`kestrel_bench transport`: what ROS 2 transport costs Kestrel's messages, without models.
Publishers in this process, subscribers in other processes (transport_parts.py), the DDS setup
of the environment (Fast DDS with the stack's profile when sourced through scripts/env.sh).

Parts (--parts, all by default):
  build     the perception result built on the host (no DDS): the Python message
            (ResultBuilder.build, baseline) vs the CDR bytes (build_cdr + payload, the node's
            path, optimized); 6 cameras, 120 detections, maps at stride 4
  results   the same result from build start to the subscriber's callback entry, published
            as a message (baseline) or as CDR bytes (optimized); subscriber msg or raw
  commands  the control node's command (JointState, 6 joints, reliable) published at --rate
            1 kHz from one preallocated message: the publish() call, a matched subscriber in
            another process counting what arrives
  inputs    one camera set (--cams rgb8 Images + a --points PointCloud2) at 10 Hz: the last
            message of each set after its stamp, subscriber msg / raw x executor single / multi
  sizes     one Image of each --sizes bytes: callback entry - stamp with the subscriber's
            heap at glibc's defaults (baseline) and tuned as every Kestrel process (optimized)
ratios: build_optimized_vs_baseline_p50, results_optimized_vs_baseline_p50,
sizes_optimized_vs_baseline_p50_<bytes>.

  python -m kestrel_bench transport
  python -m kestrel_bench transport --parts results inputs --sets 50
Left out: the result builder of an older git revision side by side (a one-off comparison).
"""

from __future__ import annotations

import argparse
import array
import json
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from kestrel_bench import record as rec_mod
from kestrel_bench import stats
from kestrel_bench.repo import ensure_paths

PARTS = ("build", "results", "commands", "inputs", "sizes")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    ap.add_argument("--cams", type=int, default=6)
    ap.add_argument("--image-hw", type=int, nargs=2, default=[640, 640])
    ap.add_argument("--points", type=int, default=120_000)
    ap.add_argument("--dets", type=int, default=120)
    ap.add_argument("--output-stride", type=int, default=4)
    ap.add_argument("--sets", type=int, default=100, help="camera sets / results per case")
    ap.add_argument("--count", type=int, default=20_000, help="commands published")
    ap.add_argument("--rate", type=float, default=1000.0, help="commands, Hz")
    ap.add_argument("--executors", nargs="+", choices=("single", "multi"),
                    default=["single", "multi"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 10, 1 << 20, 2 << 20])
    rec_mod.add_common_arguments(ap)


class Sub:
    """A subscriber process of transport_parts: started, READY awaited (bounded), stopped."""

    def __init__(self, role: str, *extra: str, seconds: float = 120.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kestrel_bench.transport_parts",
                                      "--role", role, "--seconds", str(seconds), *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not self.proc.stdout.readline().startswith("READY"):
            self.proc.kill()
            raise RuntimeError(f"{role} subscriber did not start")

    def rows(self) -> list[list]:
        try:
            out, _ = self.proc.communicate(input="", timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return []
        return next((json.loads(ln[5:]) for ln in out.splitlines() if ln.startswith("ROWS ")),
                    [])


def _matched(pub: Any, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while pub.get_subscription_count() < 1 and time.monotonic() < deadline:
        time.sleep(0.02)  # bounded wait for discovery
    time.sleep(0.5)  # the other endpoints settle (every sample after this is counted)


def part_build(rec: rec_mod.Record, args: argparse.Namespace, node: Any) -> None:
    from kestrel_bench.timing import time_calls
    from kestrel_bench.transport_parts import build_result, result_source

    builder, cams, out = result_source(args.cams, tuple(args.image_hw), args.output_stride,
                                       args.dets)
    lat = {}
    for name, role, cdr in (("build:message", "baseline", False), ("build:cdr", "optimized",
                                                                     True)):
        t = time_calls(lambda cdr=cdr: build_result(builder, cams, out, 1, cdr), 500, 50)
        lat[role] = stats.summary(t, 1e3)
        rec.add(name, role, latency_ms=lat[role], config={"cams": args.cams, "dets": args.dets,
                                                          "stride": args.output_stride})
    rec.ratio("build_optimized_vs_baseline_p50",
              stats.ratio(lat["baseline"]["p50"], lat["optimized"]["p50"]))


def part_results(rec: rec_mod.Record, args: argparse.Namespace, node: Any) -> None:
    from kestrel_common.base_node import COMMAND_QOS
    from kestrel_interfaces.msg import PerceptionResult

    from kestrel_bench.transport_parts import build_result, result_source

    builder, cams, out = result_source(args.cams, tuple(args.image_hw), args.output_stride,
                                       args.dets)
    pub = node.create_publisher(PerceptionResult, "/kestrel_bench/result", COMMAND_QOS)
    p50 = {}
    for name, role, cdr, mode in (("results:message", "baseline", False, "msg"),
                                  ("results:cdr", "optimized", True, "msg"),
                                  ("results:cdr+raw_subscriber", "variant", True, "raw")):
        sub = Sub("result", "--mode", mode)
        _matched(pub)
        sent, build_ms, call_ms, size = [], [], [], 0
        for k in range(args.sets + 5):
            stamp = time.time_ns()
            t0 = time.perf_counter()
            msg = build_result(builder, cams, out, stamp, cdr)
            t1 = time.perf_counter()
            pub.publish(msg)
            t2 = time.perf_counter()
            if k >= 5:
                sent.append(stamp)
                build_ms.append((t1 - t0) * 1e3)
                call_ms.append((t2 - t1) * 1e3)
                size = len(msg) if cdr else size
            time.sleep(0.1)  # 10 Hz, as the node at its target rate
        time.sleep(1.0)  # the last results in flight (bounded)
        got = {r[1]: r[2] for r in sub.rows()}
        lat = [(got[s] - s) / 1e6 for s in sent if s in got]
        p50[role] = stats.summary(lat)
        rec.add(name, role, latency_ms=p50[role],
                config={"measure": "build start -> subscriber callback entry",
                        "subscriber": mode},
                metrics={"build_p50_ms": stats.summary(build_ms).get("p50"),
                         "publish_call_p50_ms": stats.summary(call_ms).get("p50"),
                         "bytes": size or None, "published": len(sent),
                         "received": len(lat)})
    node.destroy_publisher(pub)
    if "baseline" in p50 and "optimized" in p50 and p50["optimized"].get("n"):
        rec.ratio("results_optimized_vs_baseline_p50",
                  stats.ratio(p50["baseline"].get("p50"), p50["optimized"].get("p50")))


def part_commands(rec: rec_mod.Record, args: argparse.Namespace, node: Any) -> None:
    from sensor_msgs.msg import JointState

    from kestrel_bench.transport_parts import qos

    pub = node.create_publisher(JointState, "/kestrel_bench/command", qos("reliable"))
    sub = Sub("commands")
    _matched(pub)
    msg = JointState(name=[f"joint_{i}" for i in range(6)])
    msg.position = array.array("d", [0.0] * 6)
    view = np.frombuffer(msg.position, dtype=np.float64)
    clock = node.get_clock()
    n = args.count
    t_clock, t_pub = np.zeros(n), np.zeros(n)
    period, next_t = 1.0 / args.rate, time.perf_counter()
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
        t_clock[k], t_pub[k] = (t1 - t0) * 1e-6, (time.perf_counter_ns() - t2) * 1e-6
    time.sleep(0.5)  # the last reliable samples land (bounded)
    received = len(sub.rows())
    node.destroy_publisher(pub)
    rec.add("commands:publish", "variant", latency_ms=stats.summary(t_pub),
            throughput=args.rate, unit="Hz",
            config={"measure": "publish() of the command, reliable, one matched reader"},
            metrics={"clock_read_p50_us": float(np.percentile(t_clock, 50)) * 1e3,
                     "published": n, "received_by_subscriber": received})


def part_inputs(rec: rec_mod.Record, args: argparse.Namespace, node: Any) -> None:
    from sensor_msgs.msg import Image, PointCloud2

    from kestrel_bench.transport_parts import camera_set, qos

    img, cloud = camera_set(args.cams, tuple(args.image_hw), args.points)
    pubs = [node.create_publisher(Image, f"/kestrel_bench/cam{i}", qos("sensor"))
            for i in range(args.cams)]
    pc = node.create_publisher(PointCloud2, "/kestrel_bench/points", qos("sensor"))
    set_mb = (args.cams * img.height * img.width * 3 + 12 * args.points) / 1e6
    for exe in args.executors:
        for mode in ("msg", "raw"):
            sub = Sub("inputs", "--mode", mode, "--executor", exe, "--cams", str(args.cams))
            _matched(pc)
            sent, pub_ms = [], []
            t_next = time.monotonic()
            for k in range(args.sets + 5):
                t = time.time_ns()
                for m in (img, cloud):
                    m.header.stamp.sec, m.header.stamp.nanosec = divmod(t, 10**9)
                for p in pubs:
                    p.publish(img)
                pc.publish(cloud)
                if k >= 5:
                    sent.append(t)
                    pub_ms.append((time.time_ns() - t) * 1e-6)
                t_next += 0.1
                time.sleep(max(0.0, t_next - time.monotonic()))
            time.sleep(1.0)
            by: dict[int, list[float]] = {}
            for _topic, stamp, t_cb, _n in sub.rows():
                by.setdefault(stamp, []).append((t_cb - stamp) / 1e6)
            done = [by[s] for s in sent if len(by.get(s, ())) == args.cams + 1]
            rec.add(f"inputs:{exe}:{mode}", "baseline" if (exe, mode) == ("single", "msg")
                    else "variant", latency_ms=stats.summary([max(v) for v in done]),
                    config={"measure": "last message of a set after its stamp",
                            "executor": exe, "subscriber": mode, "set_mb": round(set_mb, 2)},
                    metrics={"first_msg_p50_ms": stats.summary([min(v) for v in done]).get("p50"),
                             "complete_sets": len(done), "sets": len(sent),
                             "publish_set_p50_ms": stats.summary(pub_ms).get("p50")})
    for p in [*pubs, pc]:
        node.destroy_publisher(p)


def part_sizes(rec: rec_mod.Record, args: argparse.Namespace, node: Any) -> None:
    from sensor_msgs.msg import Image

    from kestrel_bench.transport_parts import qos

    pub = node.create_publisher(Image, "/kestrel_bench/sizes", qos("reliable"))
    p50: dict[tuple[str, int], float] = {}
    for heap, role in (("default", "baseline"), ("tuned", "optimized")):
        sub = Sub("sizes", "--mode", "raw", "--heap", heap)
        _matched(pub)
        for size in args.sizes:
            m = Image(height=1, width=size, encoding="mono8", step=size, data=bytes(size))
            for _ in range(30):
                t = time.time_ns()
                m.header.stamp.sec, m.header.stamp.nanosec = divmod(t, 10**9)
                pub.publish(m)
                time.sleep(0.05)
        time.sleep(0.5)
        rows = sub.rows()
        for size in args.sizes:
            lat = [(t_cb - st) / 1e6 for _tp, st, t_cb, n in rows if size <= n < size + 1024][3:]
            s = stats.summary(lat)
            p50[(role, size)] = s.get("p50")
            rec.add(f"sizes:{heap}@{size}", role, latency_ms=s,
                    config={"bytes": size, "subscriber_heap": heap,
                            "measure": "callback entry - stamp, raw subscriber"})
    node.destroy_publisher(pub)
    for size in args.sizes:
        rec.ratio(f"sizes_optimized_vs_baseline_p50_{size}",
                  stats.ratio(p50.get(("baseline", size)), p50.get(("optimized", size))))


def run(args: argparse.Namespace) -> int:
    ensure_paths("kestrel_common", "kestrel_perception", "kestrel_bench")
    import rclpy

    config = {k: v for k, v in vars(args).items() if k not in ("argv", "out", "commit", "note")}
    config["rmw"] = os.environ.get("RMW_IMPLEMENTATION")
    config["fastdds_profile"] = os.path.basename(
        os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE", "") or "none")
    rec = rec_mod.Record("transport", config, getattr(args, "argv", None), args.commit)
    rclpy.init()
    node = rclpy.create_node("kestrel_bench_transport")
    try:
        for part in args.parts:
            print(f"transport: {part}", flush=True)
            fn = {"build": part_build, "results": part_results, "commands": part_commands,
                  "inputs": part_inputs, "sizes": part_sizes}[part]
            try:
                fn(rec, args, node)
            except Exception as exc:  # noqa: BLE001 (a failed part is a row; the others run)
                rec.add(part, "variant", error=f"{type(exc).__name__}: {exc}"[:300])
    finally:
        node.destroy_node()
        rclpy.try_shutdown()
    rec_mod.finish(rec, args)
    return 0
