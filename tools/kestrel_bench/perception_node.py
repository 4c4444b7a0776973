"""`kestrel_bench perception-node`: the perception NODE end to end with ROS I/O live (message
in -> result out).

Processes on one machine, one ROS domain (localhost discovery): the node
(`python -m kestrel_perception.perception_node`, its own process); the publisher side
(perception_inputs.py, `--publishers one`: one process publishes each set, stamped just before
its first publish(); `per-sensor`: one process per sensor, all triggered at the same wall-clock
time, stamp = trigger time); a sink process recording every result (receipt time, stamp); and
this process, which warms the node up (configure, compile and CUDA-graph capture are not
timed) and reads /diagnostics. Per frame, latency = result receipt - its header stamp (= the
input stamp): serialisation, DDS both ways, synchronisation, the model and post-processing.
Dropped = frames published but never answered. The node's stage timings and counters are
recorded too.

Rows: `e2e` (latency from the stamp), `from_publish` (per-sensor: from the publish() start of
the set's last sensor, i.e. without the simulated drivers' wake-up lateness), `node` (the
node's receipt of the last message -> result publish), and one per node stage. Power: NVML
over the timed frames (J per frame set).
The runtime options are the node's (runtime.engine / precision / compile / cuda_graph /
optimize, default auto). All processes use the stack's Fast DDS profile
(kestrel_bringup/config/fastdds_large_data.xml) unless --fastdds-profile none.

  python -m kestrel_bench perception-node --config tiny --device cpu --cams 1 \
      --image-hw 256 320 --points 20000 --rate 5 --frames 40
  python -m kestrel_bench perception-node --config r50 --device cuda --cams 6 --rate 10 \
      --frames 150 --publishers per-sensor                                   # GPU
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from kestrel_bench import record as rec_mod
from kestrel_bench import stats
from kestrel_bench.repo import ROOT, ensure_paths

NODE = "perception"
SINK_MATCH_TIMEOUT_S = 60.0  # default bound of the sink's wait to match the node's publisher, s
FASTDDS_PROFILE = ROOT / "ros2_ws/src/kestrel_bringup/config/fastdds_large_data.xml"
CONFIGS = {  # node parameters of the model size
    "tiny": {"model.backbone_depth": 18, "model.base_width": 16, "model.fpn_channels": 64,
             "model.head_convs": 1},
    "r50": {"model.backbone_depth": 50, "model.base_width": 64, "model.fpn_channels": 256,
            "model.head_convs": 4},
}
OPTIONAL = (  # (argument, node parameter): passed only when given
    ("engine", "runtime.engine"), ("precision", "runtime.precision"),
    ("compile", "runtime.compile"), ("processing", "processing"), ("executor", "executor"),
    ("receive", "receive.mode"), ("receiver_cpus", "receive.cpus"),
    ("gil_switch_us", "gil_switch_interval_us"))
SWITCHES = (("cuda_graph", "runtime.cuda_graph"), ("optimize", "runtime.optimize"),
            ("region_graph", "runtime.region_graph"),
            ("region_compile", "runtime.region_compile"),
            ("cloud_required", "sync.cloud_required"))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from kestrel_bench.perception_inputs import PUBLISHERS

    ap.add_argument("--role", choices=("main", "sink"), default="main", help=argparse.SUPPRESS)
    ap.add_argument("--stamps-out", default="", help=argparse.SUPPRESS)
    ap.add_argument("--match-timeout", type=float, default=SINK_MATCH_TIMEOUT_S,
                    help=argparse.SUPPRESS)  # the sink's bound on matching the node, s
    ap.add_argument("--config", choices=tuple(CONFIGS), default="tiny")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cams", type=int, default=1)
    ap.add_argument("--image-hw", type=int, nargs=2, default=(640, 640), metavar=("H", "W"))
    ap.add_argument("--points", type=int, default=120_000)
    ap.add_argument("--rate", type=float, default=10.0, help="frame sets per second")
    ap.add_argument("--frames", type=int, default=200)
    ap.add_argument("--publisher-warmup-s", type=float, default=2.0,
                    help="untimed frames the publisher process(es) send first (discovery)")
    ap.add_argument("--publishers", choices=PUBLISHERS, default="one")
    ap.add_argument("--score-threshold", type=float, default=0.0,
                    help="0 = every top candidate is decoded (random weights score low)")
    ap.add_argument("--max-detections", type=int, default=20)
    ap.add_argument("--depth-encoding", choices=("16UC1", "32FC1"), default="16UC1")
    ap.add_argument("--output-stride", type=int, choices=(1, 2, 4, 8), default=4)
    ap.add_argument("--threads", type=int, default=0, help="node torch threads (0 = default)")
    for name, choices in (("engine", ("auto", "torch", "onnxruntime", "tensorrt")),
                          ("precision", ("auto", "fp32", "bf16", "fp16", "int8")),
                          ("compile", ("auto", "off", "whole", "branched")),
                          ("processing", ("callback", "worker")),
                          ("executor", ("single", "multi")),
                          ("receive", ("auto", "executor", "processes"))):
        ap.add_argument(f"--{name}", choices=choices, default=None,
                        help="node parameter (default: the node's)")
    for name, _ in SWITCHES:
        ap.add_argument(f"--{name.replace('_', '-')}", choices=("on", "off", "auto"),
                        default=None, help="node parameter (default: the node's)")
    ap.add_argument("--gil-switch-us", type=int, default=None)
    ap.add_argument("--receiver-cpus", type=int, nargs="+", default=None)
    ap.add_argument("--publisher-cpus", type=int, nargs="+", default=None,
                    help="per-sensor publisher processes pinned to these CPUs")
    ap.add_argument("--node-cpus", type=int, nargs="+", default=None,
                    help="the node process pinned to these CPUs once it is ready")
    ap.add_argument("--malloc", choices=("tuned", "default"), default="tuned",
                    help="default: glibc's heap settings in the node and the sink (A/B)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--fastdds-profile", default=str(FASTDDS_PROFILE),
                    help="Fast DDS XML profile of all processes ('none' = Fast DDS defaults)")
    ap.add_argument("--result-qos", choices=("best_effort", "reliable"), default="best_effort",
                    help="the sink's QoS (best effort: as the stack's consumers read results)")
    rec_mod.add_common_arguments(ap)


def camera_poses(cams: int) -> list[float]:
    """`cams` cameras at the origin, 1 m up, yaw 360/cams apart, looking horizontally: the
    node's camera_poses parameter (x y z qx qy qz qw per camera, optical frame in world)."""
    base_to_cam0 = np.array([[0.0, -1.0, 0.0], [0.0, 0.0, -1.0], [1.0, 0.0, 0.0]])
    flat = []
    for c in range(cams):
        a = 2 * math.pi * c / cams
        yaw = np.array([[math.cos(a), math.sin(a), 0.0], [-math.sin(a), math.cos(a), 0.0],
                        [0.0, 0.0, 1.0]])
        R = (base_to_cam0 @ yaw).T  # world_from_cam rotation
        w = math.sqrt(max(0.0, 1 + R[0, 0] + R[1, 1] + R[2, 2])) / 2
        x = math.copysign(math.sqrt(max(0.0, 1 + R[0, 0] - R[1, 1] - R[2, 2])) / 2,
                          R[2, 1] - R[1, 2])
        y = math.copysign(math.sqrt(max(0.0, 1 - R[0, 0] + R[1, 1] - R[2, 2])) / 2,
                          R[0, 2] - R[2, 0])
        z = math.copysign(math.sqrt(max(0.0, 1 - R[0, 0] - R[1, 1] + R[2, 2])) / 2,
                          R[1, 0] - R[0, 1])
        flat += [0.0, 0.0, 1.0, x, y, z, w]
    return flat


def node_params(args: argparse.Namespace) -> dict:
    h, w = args.image_hw
    params = {**CONFIGS[args.config], "num_cameras": args.cams, "runtime.device": args.device,
              "warmup_size": [w, h], "camera_poses": camera_poses(args.cams),
              "frame_id": "world", "detection.score_threshold": args.score_threshold,
              "detection.max_detections": args.max_detections, "sync.slop": 0.005,
              "lidar.max_points": max(500_000, args.points), "target_fps": float(args.rate),
              "runtime.torch_threads": args.threads, "diagnostics_period": 0.5,
              "autostart": True, "output.depth_encoding": args.depth_encoding,
              "output.stride": args.output_stride}
    for arg, name in OPTIONAL:
        if getattr(args, arg) is not None:
            params[name] = getattr(args, arg)
    for arg, name in SWITCHES:
        v = getattr(args, arg)
        if v is not None:
            params[name] = "auto" if v == "auto" else v == "on"
    return params


def result_qos(name: str):  # noqa: ANN201
    from kestrel_common.base_node import COMMAND_QOS
    from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy

    return COMMAND_QOS if name == "reliable" else QoSProfile(
        depth=10, reliability=ReliabilityPolicy.BEST_EFFORT, history=HistoryPolicy.KEEP_LAST)


class ResultSink:
    """Result callback: receipt time, stamp and the node's stage timings; drops the payload."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.rows: list[dict] = []

    def __call__(self, msg) -> None:  # noqa: ANN001
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


def run_sink(args: argparse.Namespace) -> int:
    """The measuring subscriber, alone in its process with a single-threaded spin loop (next to
    a harness's executor, results arrived late in bursts). Records every result until stdin
    closes, then writes the rows to --stamps-out."""
    import rclpy
    from kestrel_common.heap import freeze_heap, tune_malloc
    from kestrel_interfaces.msg import PerceptionResult

    rclpy.init()
    node = rclpy.create_node("perception_bench_sink")
    sink = ResultSink()
    sub = node.create_subscription(PerceptionResult, f"/{NODE}/output/result", sink,
                                   result_qos(args.result_qos))
    # A best-effort result published before this subscription matches the node's publisher is
    # lost, and the frames start as soon as this process says it is ready: so it says so only
    # once matched (bounded; a slow discovery on a loaded machine lost every result).
    deadline = time.monotonic() + args.match_timeout
    while sub.get_publisher_count() < 1:
        if time.monotonic() > deadline:
            print(f"sink not matched to /{NODE}/output/result within {args.match_timeout} s",
                  flush=True)
            return 1
        rclpy.spin_once(node, timeout_sec=0.05)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    freeze_heap()  # as every Kestrel node after configure: a full collection skips this heap
    print(tune_malloc(), file=sys.stderr)
    print("sink ready", flush=True)
    while not stop.is_set():
        rclpy.spin_once(node, timeout_sec=0.05)
    Path(args.stamps_out).write_text(json.dumps(sink.snapshot()))
    node.destroy_node()
    rclpy.try_shutdown()
    return 0


def summarise(rows: list[dict], pub: dict) -> dict:
    """Per-frame latencies (ms lists) of the answered frames and the counts."""
    stamps = pub["stamps_ns"]
    sent = set(stamps)
    got = [r for r in rows if r["stamp_ns"] in sent]
    by_stamp = {r["stamp_ns"]: (r["recv_ns"] - r["stamp_ns"]) / 1e6 for r in got}
    stages: dict[str, list[float]] = {}
    for r in got:
        for k, v in r["timings"].items():
            stages.setdefault(k, []).append(v * 1e3)
    from_pub = []
    late = pub.get("trigger_lateness_s")
    if late is not None and len(late) == len(stamps):
        from_pub = [by_stamp[s] - x * 1e3 for s, x in zip(stamps, late, strict=True)
                    if s in by_stamp]
    out_tr = [(r["recv_ns"] - r["stamp_ns"]) / 1e6 - r["node_latency_s"] * 1e3
              - r["timings"]["input_age"] * 1e3 for r in got if "input_age" in r["timings"]]
    return {"e2e": list(by_stamp.values()), "from_publish": from_pub,
            "node": [r["node_latency_s"] * 1e3 for r in got], "stages": stages,
            "result_transport": out_tr, "publish_set": [x * 1e3 for x in pub["publish_s"]],
            "frames": len(stamps), "results": len(got),
            "dropped": len(sent) - len({r["stamp_ns"] for r in got}),
            "dropped_frames": [i for i, s in enumerate(stamps) if s not in by_stamp][:50]}


def run_main(args: argparse.Namespace) -> int:
    import rclpy
    from diagnostic_msgs.msg import DiagnosticArray
    from kestrel_common.affinity import pin_threads
    from kestrel_interfaces.msg import PerceptionResult
    from ros_harness import DomainLease, Probe, diagnostics_values, ros_env, spawn_node

    from kestrel_bench.perception_inputs import InputConfig, SetPublisher, publish_inputs
    from kestrel_bench.power import PowerMeter

    if args.fastdds_profile != "none":  # before any participant of this process exists
        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(Path(args.fastdds_profile).resolve())
    lease = DomainLease()
    run_dir = Path(tempfile.mkdtemp(prefix="kestrel_bench_perception_node_"))
    env = ros_env(lease.domain_id, run_dir)
    env["OMP_NUM_THREADS"] = str(max(1, args.threads))
    if args.malloc == "default":
        env["KESTREL_MALLOC"] = "default"
    os.environ["ROS_DOMAIN_ID"] = str(lease.domain_id)
    params = node_params(args)
    node = spawn_node("kestrel_perception.perception_node", NODE, env, run_dir, params=params)
    probe = Probe(lease.domain_id, "perception_bench_probe")
    ready = ResultSink()
    probe.node.create_subscription(PerceptionResult, f"/{NODE}/output/result", ready,
                                   result_qos(args.result_qos))
    diag = probe.subscribe(DiagnosticArray, "/diagnostics", 10)
    meter = PowerMeter() if args.device == "cuda" else None
    try:
        warm = SetPublisher(probe.node, args.cams, tuple(args.image_hw), args.points, seed=2)
        t0 = time.monotonic()
        while not ready.snapshot():  # configure (+ compile, graph capture) is not timed
            if time.monotonic() - t0 > args.ready_timeout or not node.alive():
                print(node.output()[-4000:], file=sys.stderr)
                raise RuntimeError(f"no result within {args.ready_timeout} s (node alive: "
                                   f"{node.alive()})")
            warm.publish()
            time.sleep(0.5)
        ready_s = time.monotonic() - t0
        for _ in range(5):  # a few frames through the full path, untimed
            warm.publish()
            time.sleep(1.0 / args.rate)
        print(f"node ready after {ready_s:.1f} s", flush=True)
        before = diagnostics_values(diag.snapshot(), NODE)
        rows_path = run_dir / "rows.json"
        sink = subprocess.Popen(
            [sys.executable, "-m", "kestrel_bench", "perception-node", "--role", "sink",
             "--result-qos", args.result_qos, "--stamps-out", str(rows_path)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        said = sink.stdout.readline().strip()
        if said != "sink ready":
            raise RuntimeError(f"the sink process is not ready: {said or 'no output'}")
        if args.node_cpus:
            pin_threads(node.proc.pid, args.node_cpus)
        if meter:
            meter.start()
        pub = publish_inputs(InputConfig.from_args(args), env, run_dir,
                             cpus=tuple(args.publisher_cpus or ()))
        if meter:
            meter.stop()
        time.sleep(2.0)  # results still in flight after the last set (bounded, not a sync)
        sink.stdin.close()
        sink.wait(30)
        rows = json.loads(rows_path.read_text())
        deadline, n_diag = time.monotonic() + 2.0, len(diag.snapshot())
        while time.monotonic() < deadline and len(diag.snapshot()) == n_diag:
            time.sleep(0.05)  # one more /diagnostics after the run (bounded)
        counters = diagnostics_values(diag.snapshot(), NODE)
    finally:
        probe.close()
        code = node.stop()
        lease.release()
        rclpy.try_shutdown()
    s = summarise(rows, pub)
    config = {k: v for k, v in vars(args).items()
              if k not in ("role", "stamps_out", "argv", "out", "commit", "note")}
    config["node_params"] = {k: v for k, v in params.items() if k != "camera_poses"}
    config["rmw"] = os.environ.get("RMW_IMPLEMENTATION", "default")
    record = rec_mod.Record("perception-node", config, getattr(args, "argv", None), args.commit)
    during = {}
    for key in ("processed", "skipped_stale", "out_of_sync", "processing_error"):
        try:
            during[f"node_{key}"] = int(counters[key]) - int(before.get(key, 0))
        except (KeyError, ValueError):
            pass
    power = meter.result(s["frames"], "frame set") if meter else {"skipped": "CPU run"}
    record.add("e2e", "variant", latency_ms=stats.summary(s["e2e"]),
               throughput=s["results"] / max(1e-9, s["frames"] / args.rate), unit="results/s",
               power=power, metrics={"frames": s["frames"], "results": s["results"],
                                     "dropped": s["dropped"], "node_ready_s": ready_s,
                                     "node_exit_code": code, **during},
               config={"measure": "result receipt - input stamp"},
               dropped_frames=s["dropped_frames"])
    if s["from_publish"]:
        record.add("from_publish", "variant", latency_ms=stats.summary(s["from_publish"]),
                   config={"measure": "result receipt - publish() start of the set's last "
                           "sensor"})
    record.add("node", "variant", latency_ms=stats.summary(s["node"]),
               config={"measure": "node: receipt of the last message -> result publish"})
    for name, key in (("result_transport", "result_transport"), ("publish_set", "publish_set")):
        record.add(name, "variant", latency_ms=stats.summary(s[key]))
    for k, v in s["stages"].items():
        record.add(f"stage:{k}", "variant", latency_ms=stats.summary(v),
                   config={"measure": "node-reported stage time"})
    record["node_counters"] = {k: v for k, v in counters.items() if not k.startswith("latency")}
    rec_mod.finish(record, args)
    return 0 if s["results"] > 0 else 1


def run(args: argparse.Namespace) -> int:
    ensure_paths("kestrel_models", "kestrel_common", "kestrel_perception", "ros_harness")
    if args.role == "sink":
        return run_sink(args)
    from kestrel_bench.perception_inputs import InputConfig

    try:
        InputConfig.from_args(args)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return run_main(args)
