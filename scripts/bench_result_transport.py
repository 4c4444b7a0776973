#!/usr/bin/env python3
"""Where the perception node's result transport goes: one PerceptionResult (120 detections,
6 mono8 masks, 6 depth maps, ~1.8 MB) from publish() to the consumer's callback (issue 4).

A publisher (this process) builds realistic results with kestrel_perception.result_msg (the
node's ResultBuilder; sizes as the H200 run: `--cams` cameras, masks/depths at the node's
output_stride `--output-stride` (default 2: the node's default until session 11, now 4) and
depth_encoding 16UC1, `--dets` detections) and publishes them at
`--rate` Hz with the node's output QoS (COMMAND_QOS: reliable, keep last 10). Each message's
header stamp is the wall clock taken just before its publish() (same host clock in both
processes); the publisher records, per message: build (Python, s), the publish() call
(serialisation inside rclpy + the DDS write), and afterwards rclpy's serialize_message alone.
A subscriber in a separate process (SingleThreadedExecutor unless `--executor multi`; QoS
`--sub-qos`, default the node's output QoS) records callback entry - publish end. Modes:
  msg  rclpy's normal path: DDS + CDR -> C struct -> Python message objects, then the callback;
  raw  `raw=True`: the CDR bytes only (DDS alone); in the callback, after the entry time is
       taken, deserialize_message(bytes) is timed = deserialisation alone.
Cases are `payload:mode[:variant]`; payloads: full (dets + masks + depths), no_dets (maps
only), no_maps (dets only), empty (header + timings); variants: before (ResultBuilder of
`--before-rev`, from git; only revisions with the same PerceptionResult layout: the detections
became parallel arrays in the commit after 106ef39), be (subscriber best effort,
depth 10, as the planner / the node bench's sink), freeze (the subscriber gc.collect() +
gc.freeze()s its heap before receiving, as the Kestrel nodes do after configure: the cyclic
collections that the ~2,300 objects per result trigger then skip the old heap), cdr (the
node's default path since session 9: ResultBuilder.build_cdr writes the CDR bytes, published
with publish(bytes); "build" then includes the payload join, and serialize_message is not run;
the header stamp is taken before the build, so its publish -> callback column counts from the
publish() call as for the others), malloc (the subscriber tunes glibc's heap as every Kestrel
process does: kestrel_common.heap.tune_malloc). Variants combine with "+", e.g. cdr+malloc.
JSON + table:

    python scripts/bench_result_transport.py --messages 100 \
        --out docs/benchmarks/result_transport_cpu
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import threading
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT_MSG = "ros2_ws/src/kestrel_perception/kestrel_perception/result_msg.py"
PAYLOADS = ("full", "no_dets", "no_maps", "empty")
DEFAULT_CASES = ("full:msg", "full:raw", "no_dets:msg", "no_dets:raw", "no_maps:msg",
                 "no_maps:raw", "empty:msg", "empty:raw", "full:msg:be", "full:msg:freeze",
                 "full:raw:freeze", "full:msg:cdr", "full:raw:cdr", "full:msg:cdr+malloc",
                 "full:raw:cdr+malloc")
VARIANTS = ("", "before", "be", "freeze", "cdr", "malloc")


def msg_type(payload: str):  # noqa: ANN201
    from kestrel_interfaces.msg import PerceptionResult
    return PerceptionResult


def sub_qos(name: str):  # noqa: ANN201
    from kestrel_common.base_node import COMMAND_QOS
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    if name == "reliable":
        return COMMAND_QOS  # = the perception node's ~/output/result
    return QoSProfile(depth=10, reliability=ReliabilityPolicy.BEST_EFFORT,
                      history=HistoryPolicy.KEEP_LAST)


# ---- subscriber process ---------------------------------------------------------------------
def subscriber(args: argparse.Namespace) -> int:
    import rclpy
    from rclpy.executors import MultiThreadedExecutor, SingleThreadedExecutor
    from rclpy.serialization import deserialize_message

    raw = args.mode == "raw"
    mtype = msg_type(args.payload)
    rows: list[tuple[int, int, float, int]] = []  # (stamp ns, entry ns, deser s, bytes)

    def cb(m) -> None:  # noqa: ANN001
        t = time.time_ns()
        if raw:  # CDR: 4-byte encapsulation, then header.stamp (int32 s, uint32 ns)
            sec, ns = struct.unpack_from("<iI", m, 4)
            t0 = time.perf_counter()
            deserialize_message(m, mtype)
            rows.append((sec * 10**9 + ns, t, time.perf_counter() - t0, len(m)))
        else:
            rows.append((m.header.stamp.sec * 10**9 + m.header.stamp.nanosec, t, 0.0, 0))

    if args.tune_malloc:
        from kestrel_common.heap import tune_malloc
        print(tune_malloc(), file=sys.stderr)
    rclpy.init()
    node = rclpy.create_node("bench_result_transport_sub")
    node.create_subscription(mtype, args.topic, cb, sub_qos(args.sub_qos), raw=raw)
    ex = MultiThreadedExecutor(num_threads=4) if args.executor == "multi" \
        else SingleThreadedExecutor()
    ex.add_node(node)
    if args.gc_freeze:
        import gc
        gc.collect()
        gc.freeze()
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("READY", flush=True)
    end = time.monotonic() + args.sub_seconds  # bounded even if stdin never closes
    while not stop.is_set() and time.monotonic() < end:
        ex.spin_once(timeout_sec=0.05)
    print("ROWS " + json.dumps(rows), flush=True)
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


# ---- realistic results ----------------------------------------------------------------------
def make_outputs(cams: int, hw: tuple[int, int], stride: int, dets: int, maps: bool,
                 n: int = 4) -> list:
    """`n` different PerceptionOutputs (cycled): boxes, scores, positions, masks, 16UC1 depths
    as the node produces them at output_stride `stride`."""
    from kestrel_models.perception import PositionSource
    from kestrel_perception.core import Detection, PerceptionOutput
    from kestrel_perception.core.types import DEFAULT_CLASS_NAMES

    rng = np.random.default_rng(0)
    hs, ws = -(-hw[0] // stride), -(-hw[1] // stride)
    sources = (PositionSource.LIDAR, PositionSource.PREDICTED_DEPTH, PositionSource.NONE)
    outs = []
    for _ in range(n):
        ds = []
        for k in range(dets):
            x1, y1 = rng.uniform(0, hw[1] - 80), rng.uniform(0, hw[0] - 80)
            box = np.array([x1, y1, x1 + rng.uniform(8, 80), y1 + rng.uniform(8, 80)],
                           np.float32)
            cls = 1 + k % (len(DEFAULT_CLASS_NAMES) - 1)
            src = sources[k % 3]
            pos = None if src == PositionSource.NONE else rng.normal(0, 2, 3)
            ds.append(Detection(k % cams, cls, DEFAULT_CLASS_NAMES[cls], float(rng.uniform()),
                                box, pos, src))
        masks = [rng.integers(0, 7, (hs, ws), dtype=np.uint8) for _ in range(cams)] \
            if maps else []
        depths = [rng.integers(0, 8000, (hs, ws), dtype=np.uint16) for _ in range(cams)] \
            if maps else []
        timings = {k: 1e-3 for k in ("preprocess", "model", "postprocess", "lidar_fusion",
                                     "download", "unpack")}
        outs.append(PerceptionOutput(0, ds, masks, depths, timings, depth_encoding="16UC1",
                                     output_stride=stride))
    return outs


def load_builder(rev: str | None):  # noqa: ANN201
    """ResultBuilder of the working tree (rev None) or of git revision `rev` (read-only)."""
    if rev is None:
        from kestrel_perception.result_msg import ResultBuilder
        return ResultBuilder
    src = subprocess.run(["git", "-C", REPO, "show", f"{rev}:{RESULT_MSG}"], check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType(f"result_msg_{rev}")
    exec(compile(src, f"{rev}:{RESULT_MSG}", "exec"), mod.__dict__)  # noqa: S102
    return mod.ResultBuilder


def run_case(args: argparse.Namespace, node, case: str, k_case: int) -> dict:  # noqa: ANN001
    from kestrel_common.base_node import COMMAND_QOS
    from kestrel_perception.core import CameraModel
    from kestrel_perception.core.types import DEFAULT_CLASS_NAMES
    from rclpy.serialization import serialize_message

    payload, mode, *variant = case.split(":")
    variant = variant[0] if variant else ""
    vs = set(variant.split("+"))
    res: dict = {"case": case, "payload": payload, "mode": mode, "variant": variant,
                 "sub_qos": "best_effort" if "be" in vs else "reliable"}
    try:
        mtype = msg_type(payload)
    except ImportError as exc:
        res["skipped"] = f"{exc}"
        return res
    builder = load_builder(args.before_rev if "before" in vs else None)(
        "world", DEFAULT_CLASS_NAMES)
    res["builder"] = args.before_rev if "before" in vs else "working tree"
    K = np.array([[500.0, 0.0, 320.0], [0.0, 500.0, 320.0], [0.0, 0.0, 1.0]])
    cams = [CameraModel(K, args.image_hw[1], args.image_hw[0], f"camera_{i}_optical")
            for i in range(args.cams)]
    dets = 0 if payload in ("no_dets", "empty") else args.dets
    outs = make_outputs(args.cams, tuple(args.image_hw), args.output_stride, dets,
                        payload not in ("no_maps", "empty"))
    topic = f"/bench_result_transport/c{k_case}"
    pub = node.create_publisher(mtype, topic, COMMAND_QOS)

    def build(k: int, stamp: int):  # noqa: ANN202
        st = [stamp] * args.cams
        return builder.build(stamp, st, cams, outs[k % len(outs)], {"wait": 1e-4})

    cmd = [sys.executable, os.path.abspath(__file__), "--role", "sub", "--payload", payload,
           "--mode", mode, "--topic", topic, "--executor", args.executor,
           "--sub-qos", res["sub_qos"], "--sub-seconds", str(args.messages / args.rate + 60)]
    if "freeze" in vs:
        cmd.append("--gc-freeze")
    if "malloc" in vs:
        cmd.append("--tune-malloc")
    sub = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if not sub.stdout.readline().startswith("READY"):  # bounded: EOF if it dies
            res["error"] = "subscriber did not start"
            return res
        deadline = time.monotonic() + 15.0
        while pub.get_subscription_count() < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        # (stamp ns, publish end ns, build s, publish s, serialize s, bytes, publish start ns)
        pubs = []
        period = 1.0 / args.rate
        t_next = time.monotonic()
        for k in range(args.skip + args.messages):
            if "cdr" in vs:  # the node's path: CDR bytes, stamped when built
                stamp = time.time_ns()
                t0 = time.perf_counter()
                w = builder.build_cdr(stamp, [stamp] * args.cams, cams, outs[k % len(outs)])
                w.timings({**outs[k % len(outs)].timings, "wait": 1e-4})
                w.f64(0.0)
                payload_bytes = w.payload()
                t_build = time.perf_counter() - t0
                t_start = time.time_ns()
                t1 = time.perf_counter()
                pub.publish(payload_bytes)
                t_pub = time.perf_counter() - t1
                t_end = time.time_ns()
                if k >= args.skip:
                    pubs.append((stamp, t_end, t_build, t_pub, 0.0, len(payload_bytes),
                                 t_start))
                t_next += period
                time.sleep(max(0.0, t_next - time.monotonic()))  # rate control
                continue
            t0 = time.perf_counter()
            msg = build(k, 0)
            t_build = time.perf_counter() - t0
            # serialisation alone, before the publish (not while the subscriber takes one)
            t2 = time.perf_counter()
            nbytes = len(serialize_message(msg))
            t_ser = time.perf_counter() - t2
            stamp = time.time_ns()
            msg.header.stamp.sec, msg.header.stamp.nanosec = divmod(stamp, 10**9)
            t1 = time.perf_counter()
            pub.publish(msg)
            t_pub = time.perf_counter() - t1
            t_end = time.time_ns()
            if k >= args.skip:
                pubs.append((stamp, t_end, t_build, t_pub, t_ser, nbytes, stamp))
            t_next += period
            time.sleep(max(0.0, t_next - time.monotonic()))  # rate control
        # drain: the subscriber stops when stdin closes; a result older than this is lost
        time.sleep(1.0)
        out, _ = sub.communicate(input="", timeout=30)
    except subprocess.TimeoutExpired:
        sub.kill()
        out = ""
    finally:
        node.destroy_publisher(pub)
    rows = next((json.loads(ln[5:]) for ln in out.splitlines() if ln.startswith("ROWS ")), None)
    if rows is None:
        res["error"] = "no rows from the subscriber"
        return res
    got = {r[0]: r for r in rows}
    matched = [(p, got[p[0]]) for p in pubs if p[0] in got]
    res.update({
        "published": len(pubs), "received": len(matched),
        "bytes": pubs[0][5] if pubs else 0,
        "build_ms": bc.summary([p[2] * 1e3 for p in pubs]),
        "publish_call_ms": bc.summary([p[3] * 1e3 for p in pubs]),
        "serialize_ms": bc.summary([p[4] * 1e3 for p in pubs]),
        # publish() returned -> callback entered: DDS (+ deserialisation in mode msg)
        "delivery_ms": bc.summary([(r[1] - p[1]) * 1e-6 for p, r in matched]),
        # publish() called -> callback entered
        "publish_to_callback_ms": bc.summary([(r[1] - p[6]) * 1e-6 for p, r in matched]),
    })
    if mode == "raw":
        res["deserialize_ms"] = bc.summary([r[2] * 1e3 for _, r in matched])
    return res


def fmt(d: dict | None) -> str:
    return f"{d['p50']:.2f} / {d['p99']:.2f}" if d and d.get("n") else "-"


def report(doc: dict) -> str:
    rows = ["| case | bytes | recv/pub | build (py) | publish() | serialize_message | "
            "publish -> callback entry | deserialize_message |",
            "|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        if "skipped" in r or "error" in r:
            rows.append(f"| {r['case']} | {r.get('skipped') or r.get('error')} ||||||| ")
            continue
        rows.append(f"| {r['case']} | {r['bytes']:,} | {r['received']}/{r['published']} | "
                    f"{fmt(r['build_ms'])} | {fmt(r['publish_call_ms'])} | "
                    f"{fmt(r['serialize_ms'])} | {fmt(r['delivery_ms'])} | "
                    f"{fmt(r.get('deserialize_ms'))} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--role", choices=["run", "sub"], default="run")
    ap.add_argument("--payload", choices=PAYLOADS, default="full")
    ap.add_argument("--mode", choices=["msg", "raw"], default="msg")
    ap.add_argument("--topic", default="/bench_result_transport/result")
    ap.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                    help="payload:mode[:before|be|freeze|cdr|malloc, + combines], see "
                         "the module docstring")
    ap.add_argument("--executor", choices=["single", "multi"], default="single")
    ap.add_argument("--sub-qos", choices=["reliable", "best_effort"], default="reliable")
    ap.add_argument("--gc-freeze", action="store_true", help="subscriber: gc.freeze() first")
    ap.add_argument("--tune-malloc", action="store_true",
                    help="subscriber: kestrel_common.heap.tune_malloc() first")
    ap.add_argument("--cams", type=int, default=6)
    ap.add_argument("--image-hw", type=int, nargs=2, default=[640, 640])
    ap.add_argument("--output-stride", type=int, default=2)
    ap.add_argument("--dets", type=int, default=120)
    ap.add_argument("--rate", type=float, default=10.0)
    ap.add_argument("--messages", type=int, default=100)
    ap.add_argument("--skip", type=int, default=5, help="first messages not counted")
    ap.add_argument("--sub-seconds", type=float, default=60.0)
    ap.add_argument("--before-rev", default="HEAD",
                    help="git revision whose result_msg.py is the 'before' builder")
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--out", default=None, help="path prefix of the .json")
    args = ap.parse_args()
    if args.role == "sub":
        return subscriber(args)
    for c in args.cases:
        p = c.split(":")
        if p[0] not in PAYLOADS or p[1:2] not in (["msg"], ["raw"]) or len(p) > 3 \
                or not set((p[2:] or [""])[0].split("+")) <= set(VARIANTS):
            ap.error(f"--cases: {c!r} is not payload:mode[:before|be|freeze|cdr|malloc[+...]]")

    import rclpy
    rclpy.init()
    node = rclpy.create_node("bench_result_transport_pub")
    load0 = os.getloadavg()
    results = []
    for k, case in enumerate(args.cases):
        r = run_case(args, node, case, k)
        results.append(r)
        print(json.dumps(r), flush=True)
    node.destroy_node()
    rclpy.try_shutdown()
    doc = {"machine": bc.machine_info(), "git_commit": bc.git_commit(args.git_commit or ""),
           "command": " ".join(["python", "scripts/bench_result_transport.py"] + sys.argv[1:]),
           "rmw": os.environ.get("RMW_IMPLEMENTATION"),
           "fastdds_profile": os.path.basename(os.environ.get("FASTDDS_DEFAULT_PROFILES_FILE",
                                                              "") or "none"),
           "loadavg_start_end": [load0, os.getloadavg()], "cams": args.cams,
           "image_hw": args.image_hw, "output_stride": args.output_stride, "dets": args.dets,
           "rate_hz": args.rate, "messages": args.messages, "executor": args.executor,
           "before_rev": args.before_rev, "results": results}
    table = report(doc)
    print(f"\np50 / p99 ms, {args.messages} messages at {args.rate:g} Hz, subscriber "
          f"{args.executor}:\n{table}")
    doc["table"] = table
    if args.out:  # the .md next to it is written by hand around this table
        with open(args.out + ".json", "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
