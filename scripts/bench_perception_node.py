#!/usr/bin/env python3
"""End-to-end benchmark of the perception NODE with ROS I/O live (message in -> result out).

Processes on one machine, one ROS domain (localhost discovery):
  node       `python -m kestrel_perception.perception_node` (the real node, own process)
  publisher  N cameras (Image rgb8 + CameraInfo) and one PointCloud2 per frame at `--rate` Hz
             for `--frames` frames (scripts/bench_perception_pub.py), `--publishers`:
             one        one process publishes each set, stamped with the wall clock just before
                        its first publish() (the default; the figures before this option)
             per-sensor one process per sensor (cams + 1), as one driver per sensor on a robot:
                        frame i is triggered at the same wall-clock time in every process and
                        every message carries that trigger time as its stamp
  sink       this script with `--role sink`: records every result (receipt time, stamp)
  main       this script: starts the others, warms the node up (sets at 2 Hz until a first result:
             configure, compile and CUDA-graph capture are not timed), subscribes to
             ~/output/result and /diagnostics, and measures per frame
             latency = receipt time of the result - its header stamp (= the input stamp; the
             same wall clock in every process), so it includes serialisation, DDS transport
             both ways, synchronisation, the model and post-processing.
Drops = frames published but never answered (newest-wins under overload, or lost by best-
effort transport); the node's own counters (skipped_stale, out_of_sync, ...) are recorded too.

  # CPU smoke run (tiny model, 1 camera):
  python scripts/bench_perception_node.py --config tiny --device cpu --cams 1 --image-hw 256 320 \
      --points 20000 --rate 5 --frames 40 --out docs/benchmarks/perception_node_cpu
  # H200 (after `source scripts/device_ros_env.sh`, with $KPY; see bench_perception_h200.sh):
  $KPY scripts/bench_perception_node.py --config r50 --device cuda --cams 6 --rate 10 \
      --frames 200 --variant compile_bf16w_fold_graph --out $OUT/perception_node_h200
All processes use the Fast DDS profile ros2_ws/src/kestrel_bringup/config/
fastdds_large_data.xml by default: with Fast DDS's default 512 KB shared-memory segment most
camera-sized best-effort samples are lost (see docs/benchmarks/perception_node_h200.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for sub in ("scripts", "tests", "models", "ros2_ws/src/kestrel_common",
            "ros2_ws/src/kestrel_perception"):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from bench_common import pct, write_result  # noqa: E402
from bench_perception_pub import (NODE, PUBLISHERS, InputConfig, SetPublisher,  # noqa: E402
                                  publish_inputs)
from kestrel_common.affinity import pin_threads  # noqa: E402

# Fast DDS profile with a large shared-memory segment (the default 512 KB segment loses
# best-effort camera-sized samples); 'none' keeps Fast DDS's defaults
FASTDDS_PROFILE = ROOT / "ros2_ws/src/kestrel_bringup/config/fastdds_large_data.xml"
CONFIGS = {  # node parameters of the model size
    "tiny": {"backbone_depth": 18, "base_width": 16, "fpn_channels": 64, "head_convs": 1},
    "r50": {"backbone_depth": 50, "base_width": 64, "fpn_channels": 256, "head_convs": 4},
}


def camera_poses(cams: int) -> tuple[list[float], np.ndarray]:
    """`cams` cameras at the origin, 1 m up, yaw 360/cams apart, looking horizontally.
    Returns the node's camera_poses parameter (x y z qx qy qz qw per camera, optical frame
    in world) and the T_world_from_cam [cams,4,4]."""
    base_to_cam0 = np.array([[0.0, -1.0, 0.0], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0]])
    flat, mats = [], []
    for c in range(cams):
        a = 2 * math.pi * c / cams
        yaw = np.array([[math.cos(a), math.sin(a), 0.0], [-math.sin(a), math.cos(a), 0.0],
                        [0.0, 0.0, 1.0]])
        R = (base_to_cam0 @ yaw).T  # world_from_cam rotation
        T = np.eye(4)
        T[:3, :3], T[:3, 3] = R, (0.0, 0.0, 1.0)
        mats.append(T)
        flat += [0.0, 0.0, 1.0, *quat_xyzw(R)]
    return flat, np.stack(mats)


def quat_xyzw(R: np.ndarray) -> list[float]:
    """Rotation matrix [3,3] -> quaternion (x, y, z, w)."""
    w = math.sqrt(max(0.0, 1 + R[0, 0] + R[1, 1] + R[2, 2])) / 2
    x = math.copysign(math.sqrt(max(0.0, 1 + R[0, 0] - R[1, 1] - R[2, 2])) / 2, R[2, 1] - R[1, 2])
    y = math.copysign(math.sqrt(max(0.0, 1 - R[0, 0] + R[1, 1] - R[2, 2])) / 2, R[0, 2] - R[2, 0])
    z = math.copysign(math.sqrt(max(0.0, 1 - R[0, 0] - R[1, 1] + R[2, 2])) / 2, R[1, 0] - R[0, 1])
    return [x, y, z, w]


def result_qos(name: str):
    """best_effort (depth 10: a burst is not dropped by our own queue) = what the planner and
    the monitor do: a lost result is counted as dropped; reliable = in-order delivery."""
    from kestrel_common.base_node import COMMAND_QOS
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
    return COMMAND_QOS if name == "reliable" else QoSProfile(
        depth=10, reliability=ReliabilityPolicy.BEST_EFFORT, history=HistoryPolicy.KEEP_LAST)


def run_sink(args: argparse.Namespace) -> int:
    """--role sink: the measuring subscriber, alone in its own process with a single-threaded
    spin loop (in the main bench process, next to the harness's executor, results were seen
    1-2 s late in bursts that a separate subscriber process did not see: perception_node_cpu.md).
    Records every result until stdin closes, then writes the rows to --stamps-out."""
    import rclpy
    from kestrel_interfaces.msg import PerceptionResult

    rclpy.init()
    node = rclpy.create_node("perception_bench_sink")
    sink = ResultSink()
    node.create_subscription(PerceptionResult, f"/{NODE}/output/result", sink,
                             result_qos(args.result_qos))
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    # As every Kestrel node after configure (kestrel_common.heap): collect once and freeze the
    # start-up heap, so that a full collection triggered by a result's Python objects does not
    # walk it (78-85 ms seen for one result in an unfrozen process that had imported torch:
    # result_transport_cpu.md, section "Before")
    from kestrel_common.heap import freeze_heap, tune_malloc

    freeze_heap()
    print(tune_malloc(), file=sys.stderr)  # as run_node does (KESTREL_MALLOC=default: not)
    print("sink ready", flush=True)
    while not stop.is_set():
        rclpy.spin_once(node, timeout_sec=0.05)
    Path(args.stamps_out).write_text(json.dumps(sink.snapshot()))
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


class ResultSink:
    """Result callback: receipt time, stamp and the node's stage timings; drops the payload."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[dict] = []

    def __call__(self, msg) -> None:
        recv_ns = time.time_ns()
        from kestrel_common.conversions import stamp_to_ns

        row = {"stamp_ns": stamp_to_ns(msg.header.stamp), "recv_ns": recv_ns,
               "node_latency_s": float(msg.latency), "detections": len(msg.score),
               "timings": {t.name: float(t.duration) for t in msg.timings}}
        with self.lock:
            self.rows.append(row)

    def snapshot(self) -> list[dict]:
        with self.lock:
            return list(self.rows)


def node_params(args: argparse.Namespace) -> dict:
    poses, _ = camera_poses(args.cams)
    h, w = args.image_hw
    return {**CONFIGS[args.config], "num_cameras": args.cams, "device": args.device,
            "runtime_variant": args.variant, "warmup_size": [w, h], "camera_poses": poses,
            "frame_id": "world", "score_threshold": args.score_threshold,
            "max_detections": args.max_detections, "sync_slop": 0.005,
            "max_points": max(500_000, args.points), "target_fps": float(args.rate),
            "torch_threads": args.threads, "diagnostics_period": 0.5, "autostart": True,
            "depth_encoding": args.depth_encoding, "output_stride": args.output_stride,
            **{name: value for name, value in (
                ("processing", args.processing), ("gil_switch_interval_us", args.gil_switch_us),
                ("executor", args.executor), ("receive", args.receive),
                ("receiver_cpus", args.receiver_cpus),
                ("region_graph", None if args.region_graph is None
                 else args.region_graph == "on"),
                ("region_compile", None if args.region_compile is None
                 else args.region_compile == "on"),
                ("cloud_required", None if args.cloud_required is None
                 else args.cloud_required == "on")) if value is not None}}


def summarise(rows: list[dict], stamps: list[int], pub_s: list[float],
              publishers: str = "one", lateness_s: list[float] | None = None,
              end_by_sensor_s: dict[str, list[float]] | None = None) -> dict:
    """pub_s [F]: publishing one input set, s (one process's publish() calls, or per-sensor
    the max over the sensors of publish() end - trigger). Per-sensor only: lateness_s [F], the
    max over the sensors of publish() start - trigger, s; end_by_sensor_s {sensor: [F]},
    publish() end - trigger, s."""
    sent = set(stamps)
    got = [r for r in rows if r["stamp_ns"] in sent]
    answered = {r["stamp_ns"] for r in got}
    by_stamp = {r["stamp_ns"]: (r["recv_ns"] - r["stamp_ns"]) / 1e6 for r in got}
    node_by_stamp = {r["stamp_ns"]: r["node_latency_s"] * 1e3 for r in got}
    lat = [(r["recv_ns"] - r["stamp_ns"]) / 1e6 for r in got]
    stages: dict[str, list[float]] = {}
    for r in got:
        for k, v in r["timings"].items():
            stages.setdefault(k, []).append(v * 1e3)
    node_lat = [r["node_latency_s"] * 1e3 for r in got]
    # e2e = input transport (the node's input_age) + node + result transport (the rest)
    out_tr = [(r["recv_ns"] - r["stamp_ns"]) / 1e6 - r["node_latency_s"] * 1e3
              - r["timings"]["input_age"] * 1e3 for r in got if "input_age" in r["timings"]]
    # per-sensor publishers: "messages in -> result out" = result receipt - the moment the
    # set's last sensor started its publish() (trigger + lateness): the simulated drivers'
    # own wake-up lateness (this harness's processes on a shared machine) left out
    from_pub: list[float] = []
    if lateness_s is not None and len(lateness_s) == len(stamps):
        late_by_stamp = dict(zip(stamps, lateness_s, strict=True))
        from_pub = [by_stamp[st] - late_by_stamp[st] * 1e3 for st in stamps if st in by_stamp]
    late = {} if lateness_s is None else {"trigger_lateness_ms": {
        "p50": pct([x * 1e3 for x in lateness_s], 50),
        "p99": pct([x * 1e3 for x in lateness_s], 99),
        "max": max(lateness_s) * 1e3 if lateness_s else float("nan")},
        "publish_end_by_sensor_ms": {k: {"p50": pct([x * 1e3 for x in v], 50),
                                         "p99": pct([x * 1e3 for x in v], 99)}
                                     for k, v in (end_by_sensor_s or {}).items()}}
    return {
        "publishers": publishers, **late,
        **({"latency_from_publish_ms": {
            "p50": pct(from_pub, 50), "p90": pct(from_pub, 90), "p99": pct(from_pub, 99),
            "max": max(from_pub)}} if from_pub else {}),
        "result_transport_ms": {"p50": pct(out_tr, 50), "p99": pct(out_tr, 99)},
        "frames_published": len(stamps), "results": len(got),
        "dropped": len(sent) - len(answered),
        "dropped_frame_indices": [i for i, s in enumerate(stamps) if s not in answered][:100],
        "latency_ms": {"p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99),
                       "max": max(lat) if lat else float("nan"),
                       "mean": sum(lat) / len(lat) if lat else float("nan")},
        "node_latency_ms": {"p50": pct(node_lat, 50), "p99": pct(node_lat, 99)},
        "stage_ms": {k: {"p50": pct(v, 50), "p99": pct(v, 99)} for k, v in stages.items()},
        "publish_set_ms": {"p50": pct([x * 1e3 for x in pub_s], 50),
                           "p99": pct([x * 1e3 for x in pub_s], 99)},
        "detections_per_result_p50": pct([float(r["detections"]) for r in got], 50),
        "latency_by_frame_ms": [None if st not in by_stamp else round(by_stamp[st], 3)
                                for st in stamps],
        # node-internal part (receipt of the set's last message -> result publish)
        "node_latency_by_frame_ms": [None if st not in node_by_stamp else
                                     round(node_by_stamp[st], 3) for st in stamps],
    }


PUB_MODE_TEXT = {
    "one": "one process publishes each set with sequential publish() calls (cloud, "
           "CameraInfos, Images), stamped with the wall clock just before the first call; "
           "\"publishing one input set\" = that process's publish() calls.",
    "per-sensor": "one process per sensor (each camera's CameraInfo + Image, the cloud), all "
                  "triggered at the same wall-clock time and stamped with it (hardware "
                  "trigger), serialising and sending in parallel; \"publishing one input set\" "
                  "= max over the sensors of (publish() end - trigger)."}


def late_text(s: dict) -> str:
    t = s.get("trigger_lateness_ms")
    return "" if t is None else (" Trigger lateness (publish() start - trigger, max over the "
                                 f"sensors) p50 / p99 / max {t['p50']:.3f} / {t['p99']:.3f} / "
                                 f"{t['max']:.3f} ms; publish() end - trigger by sensor "
                                 "p50 / p99 ms: " + ", ".join(
                                     f"{k} {v['p50']:.2f} / {v['p99']:.2f}" for k, v in
                                     s.get("publish_end_by_sensor_ms", {}).items()) + ".")


def markdown(res: dict) -> str:
    s = res["summary"]
    lat, st = s["latency_ms"], s["stage_ms"]
    a = res["args"]
    lines = [f"# Perception node end to end ({res['machine']['device']})", "",
             f"Command: `{res['command']}`  ",
             f"git {res['git_commit']}, torch {res['torch']}, config {a['config']}, "
             f"{a['cams']} camera(s) {a['image_hw'][1]}x{a['image_hw'][0]} rgb8 + "
             f"{a['points']}-point PointCloud2 per frame at {a['rate']} Hz, runtime variant "
             f"`{a['variant']}`, depth {a.get('depth_encoding', '32FC1')} at output stride "
             f"{a.get('output_stride', 1)}, {s['frames_published']} timed frames (after the node's "
             f"warm-up and {a['publisher_warmup_s']} s of untimed frames). Fast DDS "
             f"profile: `{Path(a['fastdds_profile']).name}`; result subscription "
             f"{a.get('result_qos', 'reliable')}; glibc heap of the node, its receivers and "
             f"the sink: {a.get('malloc', 'default (before tune_malloc)')}.", "",
             f"Publishers: `{s.get('publishers', 'one')}`: " + PUB_MODE_TEXT[
                 s.get("publishers", "one")] + late_text(s), "",
             "Latency = result receipt (subscriber process) - result header stamp (= input "
             "stamp: " + ("the frame's trigger time" if s.get("publishers") == "per-sensor"
                          else "wall clock when the set was published") + "): serialisation, "
             "DDS both ways, sync, model, post-processing, result message.", "",
             "| frames | results | dropped | p50 ms | p90 ms | p99 ms | max ms | mean ms |",
             "|---|---|---|---|---|---|---|---|",
             f"| {s['frames_published']} | {s['results']} | {s['dropped']} | {lat['p50']:.2f} | "
             f"{lat['p90']:.2f} | {lat['p99']:.2f} | {lat['max']:.2f} | {lat['mean']:.2f} |",
             *([] if "latency_from_publish_ms" not in s else [
                 "", "Messages in -> result out (result receipt - publish() start of the set's "
                 "last sensor, i.e. without the simulated drivers' wake-up lateness), p50 / "
                 "p90 / p99 / max ms: " + " / ".join(
                     f"{s['latency_from_publish_ms'][k]:.2f}" for k in
                     ("p50", "p90", "p99", "max")) + "."]),
             "", "Where the time goes (node-reported, p50 / p99 ms): " + ", ".join(
                 f"{k} {v['p50']:.2f} / {v['p99']:.2f}" for k, v in st.items())
             + f"; node receipt of the last message -> publish {s['node_latency_ms']['p50']:.2f}"
             f" / {s['node_latency_ms']['p99']:.2f}; publishing one input set "
             f"{s['publish_set_ms']['p50']:.2f} / {s['publish_set_ms']['p99']:.2f}; end to end "
             "= input_age (stamp -> node's receipt of the last input) + node + result "
             "transport (publish -> sink receipt) "
             f"{s.get('result_transport_ms', {}).get('p50', float('nan')):.2f} / "
             f"{s.get('result_transport_ms', {}).get('p99', float('nan')):.2f}.", "",
             "Node counters during the publisher run (its untimed frames included): "
             + ", ".join(
                 f"{k[5:-11]} {v}" for k, v in s.items() if k.endswith("_during_run"))
             + f"; dropped frame indices: {s['dropped_frame_indices'][:30]}", "",
             f"Node counters at the end: {res.get('node_counters', {})}", ""]
    return "\n".join(lines)


def run_main(args: argparse.Namespace) -> int:
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from kestrel_interfaces.msg import PerceptionResult
    from ros_harness import DomainLease, Probe, diagnostics_values, ros_env, spawn_node

    if args.fastdds_profile != "none":  # before any participant of this process exists
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(Path(args.fastdds_profile).resolve())
    lease = DomainLease()
    run_dir = Path(tempfile.mkdtemp(prefix="kestrel_bench_perception_node_"))
    env = ros_env(lease.domain_id, run_dir)
    env["OMP_NUM_THREADS"] = str(max(1, args.threads))
    if args.malloc == "default":  # node, its receivers and the sink keep glibc's defaults
        env["KESTREL_MALLOC"] = "default"
    os.environ["ROS_DOMAIN_ID"] = str(lease.domain_id)
    node = spawn_node("kestrel_perception.perception_node", NODE, env, run_dir,
                      params=node_params(args))
    probe = Probe(lease.domain_id, "perception_bench_sink")
    sink = ResultSink()
    # readiness only (the first result); the timed results are recorded by the sink process
    probe.node.create_subscription(PerceptionResult, f"/{NODE}/output/result", sink,
                                   result_qos(args.result_qos))
    diag = probe.subscribe(DiagnosticArray, "/diagnostics", 10)
    try:
        warm = SetPublisher(probe.node, args.cams, tuple(args.image_hw), args.points, seed=2)
        t0 = time.monotonic()
        while not sink.snapshot():  # configure (+ compile, graph capture) is not timed
            if time.monotonic() - t0 > args.ready_timeout or not node.alive():
                print(node.output()[-4000:], file=sys.stderr)
                raise RuntimeError(f"no result within {args.ready_timeout} s (node alive: "
                                   f"{node.alive()})")
            warm.publish()
            time.sleep(0.5)
        ready_s = time.monotonic() - t0
        for _ in range(5):  # a few timed-out-of-band frames through the full path
            warm.publish()
            time.sleep(1.0 / args.rate)
        time.sleep(0.5)
        print(f"node ready after {ready_s:.1f} s", flush=True)
        before = diagnostics_values(diag.snapshot(), NODE)
        rows_path = run_dir / "rows.json"
        sink_proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--role", "sink",
             "--result-qos", args.result_qos, "--stamps-out", str(rows_path)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if sink_proc.stdout.readline().strip() != "sink ready":
            raise RuntimeError("the sink process did not start")
        if args.node_cpus:  # every thread of the node (receivers excepted: own processes)
            print(f"node pinned to CPUs {args.node_cpus} "
                  f"({pin_threads(node.proc.pid, args.node_cpus)} threads)", flush=True)
        pub = publish_inputs(InputConfig.from_args(args), env, run_dir,
                             cpus=tuple(args.publisher_cpus or ()))
        time.sleep(2.0)  # results still in flight after the last set (bounded, not a sync)
        sink_proc.stdin.close()  # the sink writes its rows and exits
        sink_proc.wait(30)
        rows = json.loads(rows_path.read_text())
        diag_deadline = time.monotonic() + 2.0  # one more /diagnostics after the run
        n_diag = len(diag.snapshot())
        while time.monotonic() < diag_deadline and len(diag.snapshot()) == n_diag:
            time.sleep(0.05)
        counters = diagnostics_values(diag.snapshot(), NODE)
    finally:
        probe.close()
        code = node.stop()
        lease.release()
    summary = summarise(rows, pub["stamps_ns"], pub["publish_s"], pub["publishers"],
                        pub.get("trigger_lateness_s"), pub.get("publish_end_by_sensor_s"))
    if pub.get("teardown_hung"):  # sensor processes killed after writing their records
        summary["sensor_teardown_hung"] = pub["teardown_hung"]
    for key in ("processed", "skipped_stale", "out_of_sync", "processing_error"):
        try:  # the node's own counts over the timed frames (from /diagnostics)
            summary[f"node_{key}_during_run"] = int(counters[key]) - int(before.get(key, 0))
        except (KeyError, ValueError):
            pass
    try:
        import torch
        tv = torch.__version__
        dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    except Exception:  # noqa: BLE001 (torch is only reported here)
        tv, dev = "unknown", args.device
    commit = args.git_commit or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
        text=True).stdout.strip() or "unknown"
    res = {"command": "python " + " ".join(sys.argv), "git_commit": commit, "torch": tv,
           "rclpy_rmw": os.environ.get("RMW_IMPLEMENTATION", "default"),
           "machine": {"host": platform.node(), "cpus": os.cpu_count(), "device": dev},
           "args": {k: v for k, v in vars(args).items() if k not in ("role", "stamps_out")},
           "node_ready_s": ready_s, "node_exit_code": code, "summary": summary,
           "node_counters": {k: v for k, v in counters.items() if not k.startswith("latency")},
           "node_diag_latency": {k: v for k, v in counters.items() if k.startswith("latency")},
           "note": "working tree may have uncommitted changes on top of git_commit"}
    md = markdown(res)
    write_result(args.out, res, md)
    rclpy.try_shutdown()
    return 0 if summary["results"] > 0 else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--role", choices=("main", "sink"), default="main")
    ap.add_argument("--config", choices=tuple(CONFIGS), default="tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--variant", default="eager",
                    help="node parameter runtime_variant ('eager' or a runtime VARIANTS name)")
    ap.add_argument("--cams", type=int, default=1)
    ap.add_argument("--image-hw", type=int, nargs=2, default=(640, 640), metavar=("H", "W"))
    ap.add_argument("--points", type=int, default=120_000)
    ap.add_argument("--rate", type=float, default=10.0, help="frame sets per second")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--publisher-warmup-s", type=float, default=2.0,
                    help="untimed frames the publisher process(es) send first (discovery)")
    ap.add_argument("--publishers", choices=PUBLISHERS, default="one",
                    help="one = one process publishes each whole set (stamp = wall clock "
                         "before it); per-sensor = one process per sensor, all triggered at "
                         "the same time, stamp = trigger time (scripts/bench_perception_pub.py)")
    ap.add_argument("--score-threshold", type=float, default=0.0,
                    help="0 = every top candidate is decoded (random weights score ~0.01)")
    ap.add_argument("--max-detections", type=int, default=20)
    ap.add_argument("--depth-encoding", choices=("16UC1", "32FC1"), default="16UC1",
                    help="node parameter depth_encoding (16UC1 = uint16 mm)")
    ap.add_argument("--output-stride", type=int, choices=(1, 2, 4, 8), default=4,
                    help="node parameter output_stride of the published masks/depth maps "
                         "(4 = the node's default; session 10 and earlier ran 2)")
    ap.add_argument("--threads", type=int, default=0, help="node torch threads (0 = default)")
    ap.add_argument("--receiver-cpus", type=int, nargs="+", default=None,
                    help="node parameter receiver_cpus (receiver i on the i-th, round robin)")
    ap.add_argument("--publisher-cpus", type=int, nargs="+", default=None,
                    help="per-sensor publisher processes pinned to these CPUs (all threads)")
    ap.add_argument("--node-cpus", type=int, nargs="+", default=None,
                    help="the node process pinned to these CPUs once it is ready (all "
                         "threads; its receiver processes keep receiver_cpus)")
    # node latency options (not passed unless given: the node's defaults apply)
    ap.add_argument("--executor", choices=("multi", "single"), default=None,
                    help="node parameter executor (default: the node's, 'multi')")
    ap.add_argument("--processing", choices=("callback", "worker"), default=None,
                    help="node parameter processing (default: the node's, 'callback')")
    ap.add_argument("--cloud-required", choices=("on", "off"), default=None,
                    help="node parameter cloud_required (default: the node's, on): a set "
                         "waits for its cloud while the LiDAR is live")
    ap.add_argument("--receive", choices=("auto", "executor", "processes"), default=None,
                    help="node parameter receive: images and cloud taken by the node's "
                         "executor, or by one receiver process per sensor (shared memory)")
    ap.add_argument("--gil-switch-us", type=int, default=None,
                    help="node parameter gil_switch_interval_us (default: the node's, 200)")
    ap.add_argument("--region-compile", choices=("on", "off"), default=None,
                    help="node parameter region_compile (torch.compile'd region steps)")
    ap.add_argument("--region-graph", choices=("on", "off"), default=None,
                    help="node parameter region_graph (CUDA graphs of the device region)")
    ap.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                    help="tuned: the node, its receivers and the sink tune glibc's heap at start "
                         "(kestrel_common.heap.tune_malloc, as every Kestrel process); default: "
                         "glibc's settings (KESTREL_MALLOC=default), for the A/B")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--fastdds-profile", default=str(FASTDDS_PROFILE),
                    help="Fast DDS XML profile for all three processes ('none' = defaults)")
    ap.add_argument("--result-qos", choices=("best_effort", "reliable"), default="best_effort",
                    help="the measuring subscriber's QoS: best_effort = as the stack's consumers "
                         "(planner, monitor) read results; reliable = in-order delivery, where "
                         "one lost sample stalls the ones after it until repaired "
                         "(docs/benchmarks/perception_node_cpu.md)")
    ap.add_argument("--git-commit", default=None)
    ap.add_argument("--stamps-out", default="")
    ap.add_argument("--out", default=None, help="path stem: writes STEM.json and STEM.md")
    args = ap.parse_args()
    try:  # cams, image size, points, rate, frames, warm-up, publishers
        InputConfig.from_args(args)
    except ValueError as exc:
        ap.error(str(exc))
    return run_sink(args) if args.role == "sink" else run_main(args)


if __name__ == "__main__":
    raise SystemExit(main())
